#!/usr/bin/env bash
# Downloads (here, where pip reaches the registries) the wheels `openm3 serve` needs beyond the device image's
# packages, for its Python (3.12, x86_64 Linux), into .whl/ (git-ignored through .git/info/exclude), pinned to the
# versions this checkout's .venv runs. The device call then names ".whl" in `carry`; `gpu_all.sh servetools`
# installs them into /tmp/site there (and serves with the tokenizer exported to .whl/tokenizer).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# fastapi and httpx2 (starlette's TestClient, the benchmark's client, imports it) with everything they require,
# walked from this .venv's installed metadata (requirements whose markers exclude the device's
# Python 3.12 on x86_64 Linux, extras among them, are skipped), each at its version here
mapfile -t pins < <(.venv/bin/python - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
device = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
seen, todo = {}, ["fastapi", "httpx2"]
while todo:
    name = todo.pop()
    if name in seen:
        continue
    dist = md.distribution(name)
    seen[name] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(device):
            todo.append(req.name.lower().replace("_", "-"))
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
# the tokenizer `openm3 serve --preset` trains from the data extra's corpora, which the device image lacks:
# servetools passes this export (its cache key names the tokenizers version, which differs there)
.venv/bin/python -m openm3.data.cli tokenizer --out .whl/tokenizer
ls .whl
