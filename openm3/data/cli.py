"""`openm3 data <command>`: `preview` (sample PNG/GIF files) and `tokenizer` (train or load, export).

python -m openm3.data.cli preview --out /tmp/openm3-preview
python -m openm3.data.cli tokenizer --out /tmp/openm3-tokenizer
"""

from __future__ import annotations

import sys

COMMANDS = {"preview": "write sample images, videos and QA of the bundled data as PNG / GIF files and an index",
            "tokenizer": "train openm3's tokenizer (or load it from the cache) and export it (--out DIR)"}
USAGE = "usage: openm3 data {" + ",".join(COMMANDS) + "} [options]  (-h after a command for its options)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + "\n".join(f"  {name:10s} {text}" for name, text in COMMANDS.items()))
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(f"{USAGE}\nopenm3 data: error: " + (f"unknown command {argv[0]!r}" if argv else "a command is needed")
              + f": one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if argv[0] == "preview":
        from .preview import main as run
    else:
        from .tokenizer import main as run
    return run(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
