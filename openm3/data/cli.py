"""`openm3 data <command>`: `preview` (sample PNG/GIF files) and `tokenizer` (train or load, export).

python -m openm3.data.cli preview --out /tmp/openm3-preview
python -m openm3.data.cli tokenizer --out /tmp/openm3-tokenizer
"""

from __future__ import annotations

import sys

COMMANDS = ("preview", "tokenizer")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: openm3 data {{{','.join(COMMANDS)}}} [options]  (-h after a command for its options)",
              file=sys.stderr)  # fmt: skip
        return 2
    if argv[0] == "preview":
        from .preview import main as run
    else:
        from .tokenizer import main as run
    return run(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
