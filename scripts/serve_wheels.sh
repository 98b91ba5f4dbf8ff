#!/usr/bin/env bash
# Downloads (here, where pip reaches the registries) the wheels `openm3 serve` needs beyond the device image's
# packages, for its Python (3.12, x86_64 Linux), into .whl/ (git-ignored through .git/info/exclude), pinned to the
# versions this checkout's .venv runs. The device call then names ".whl" in `carry`; `gpu_all.sh servetools`
# installs them into /tmp/site there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
# httpx2 and its own: starlette's TestClient (the benchmark's client) imports it, or httpx where that is missing
for name in fastapi starlette pydantic pydantic_core typing-inspection annotated-types typing_extensions anyio \
    httpx2 httpcore2 h11 idna sniffio; do
  pins+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
