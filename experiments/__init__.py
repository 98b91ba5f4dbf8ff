"""Scripts that reproduce the talk's claims at a small scale; their tables and figures go to docs/experiments.md."""
