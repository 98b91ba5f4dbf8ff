"""Run logging: a JSONL file of every logged record, TensorBoard scalars when tensorboard is installed, and the
rank-0 progress bar (loss, tokens/s, ETA).

Records are plain dicts with a `step`; eval records carry keys prefixed `eval/`. After a resume the log is cut
back to the resumed step so the file holds one uninterrupted history.
"""

from __future__ import annotations

import json
import warnings
import math
from pathlib import Path


def _tensorboard_writer(log_dir: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is the optional `train` extra
        return None
    return SummaryWriter(str(log_dir), purge_step=purge_step)


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist). A last line cut short (a crash or a full disk
    mid-write) is dropped with a warning; an unreadable line before it is a ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    out = []
    for i, (n, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: line {n} is not whole JSON (a write cut short?): dropped")
                break
            raise ValueError(f"{path}: line {n} is not JSON ({err})") from None
    return out


class MetricsLogger:
    """Writes records on rank 0 only; other ranks' calls are no-ops."""

    def __init__(self, out_dir: str | Path, *, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self.tb = _tensorboard_writer(Path(out_dir) / "tensorboard")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps >= `step` (written after the checkpoint a resume starts from)."""
        if not self.enabled or not self.path.exists():
            return
        from .checkpoint import write_text_atomic

        keep = [r for r in read_jsonl(self.path) if r.get("step", -1) < step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        if self.tb is not None:  # TensorBoard's points of those steps go too (else a resume plots them twice)
            log_dir = self.tb.log_dir
            self.tb.close()
            self.tb = _tensorboard_writer(Path(log_dir), purge_step=step)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None


class Progress:
    """tqdm bar over optimizer steps on rank 0, showing loss, tokens/s and (tqdm's) ETA."""

    def __init__(self, total: int, initial: int, *, enabled: bool, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def write(self, line: str) -> None:
        """A line printed above the bar (or alone without one)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
