"""The benchmark scripts, one per question (`openm3 bench` lists them). `RESULTS` is the checkout's results folder:
those that write their JSON by default write it there, whatever directory they run from (`--out DIR` elsewhere)."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
