"""Training checkpoints: sharded through `torch.distributed.checkpoint` (DCP), written atomically.

Layout under `root`:
```
step_00000010/          one complete checkpoint
  .metadata, __*_*.distcp   DCP shards of {"model", "optim"} (every rank writes its own shard)
  rng_rank{r}.pt        each rank's RNG states (python, numpy, torch CPU, CUDA)
  trainer_state.pt      step, scheduler state, data position, config (rank 0)
  meta.json             written last, just before the rename: the "this checkpoint is complete" mark
step_00000020.tmp/      a checkpoint being written (ignored by `latest`, removed by the next save)
LATEST                  name of the newest complete checkpoint, replaced atomically
```
A checkpoint is written under a temporary name and renamed when every rank is done, then `LATEST` is replaced
(write to a temporary file, fsync, `os.replace`), so a crash mid-write leaves the previous checkpoint current.
`export_consolidated` writes an unsharded copy in the published M3 layout through the model's `save_pretrained`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..files import atomic_write
from ..models.checkpoint import replace_directory, sync_dir
from ..models.vision import DEFAULT_FRAMES_PER_CLIP
from .distributed import DistInfo, barrier

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a crash leaves either the old file or the new one: a temporary file beside
    it (`openm3.files.atomic_write`: removed where the write fails, e.g. text the encoding cannot hold or a full
    disk), flushed to disk, then renamed over it."""
    path = Path(path)
    with atomic_write(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    sync_dir(path.parent)


def save_synced(obj, path: Path) -> None:
    """`torch.save` of `obj` to `path`, flushed to disk before it returns."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / "meta.json").is_file()


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (LATEST first, else the highest complete step dir; a LATEST
    naming no complete checkpoint, which only a deletion from outside leaves, is said in a warning)."""
    root = Path(root)
    pointer = root / "LATEST"
    named = None
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    done = sorted(p for p in root.glob("step_*") if is_complete(p)) if root.is_dir() else []
    if named is not None:
        warnings.warn(f"{pointer} names {named.name}, which is not a complete checkpoint; "
                      + (f"taking the newest complete one, {done[-1].name}" if done else "there is none"))
    return done[-1] if done else None


def saved_run(root: str | Path) -> tuple[Path, int, dict] | None:
    """(the newest complete checkpoint under `root`, its step, the `TrainConfig` fields its run was made with) or
    None when there is none; read on the host, before anything is built."""
    path = latest_checkpoint(root)
    if path is None:
        return None
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    return path, state["step"], state["config"]


class CheckpointManager:
    def __init__(self, root: str | Path, info: DistInfo, keep: int = 2):
        if keep <= 0:
            raise ValueError(f"keep must be > 0, got {keep}")
        self.root = Path(root)
        self.info = info
        self.keep = keep

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             *, _after_shards: Callable[[], None] | None = None) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(self.info)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with warnings.catch_warnings():  # DCP warns that it runs without a process group; that is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                     no_dist=not self.info.distributed)
        save_synced(rng_state(), tmp / f"rng_rank{self.info.rank}.pt")
        if _after_shards is not None:  # test hook: simulate a crash after the shards, before completion
            _after_shards()
        barrier(self.info)
        if self.info.is_main:
            save_synced(trainer_state, tmp / "trainer_state.pt")
            meta = {"step": step, "world_size": self.info.world_size, "time": time.time()}
            write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=1))  # syncs tmp's names too
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            sync_dir(self.root)
            write_text_atomic(self.root / "LATEST", final.name)
            self._prune(final)
        barrier(self.info)
        return final

    def _prune(self, current: Path) -> None:
        """Keep the newest `keep` complete checkpoints, `current` (the one just written) always among them."""
        done = sorted(p for p in self.root.glob("step_*") if is_complete(p) and p != current)
        for old in done[:max(0, len(done) - (self.keep - 1))]:
            (old / "meta.json").unlink(missing_ok=True)  # first: a deletion cut short leaves no "complete" mark
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Collective: restore model, optimizer and this rank's RNG; returns the trainer state dict."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        path = Path(path)
        if not is_complete(path):
            raise ValueError(f"checkpoint {path} is not a complete checkpoint directory (no meta.json)")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # get_state_dict gives every parameter optimizer state (zeros), but the run's parameters that never had a
        # gradient (the vision tower of a text-only run, or of a mid / cpt run before its vision starts) have
        # none in the checkpoint: load only the state it holds, and leave the others without, as they were
        saved = {key[len("optim.state."):].rsplit(".", 1)[0] for key in
                 dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if key.startswith("optim.state.")}
        optim_sd["state"] = {name: value for name, value in optim_sd["state"].items() if name in saved}
        state = {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.info.distributed)
        optimizer.state.clear()
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        rng_file = path / f"rng_rank{self.info.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return torch.load(path / "trainer_state.pt", weights_only=False)


def export_consolidated(model: nn.Module, build_model: Callable[[], nn.Module], out: str | Path,
                        info: DistInfo, tokenizer=None, *,
                        video_frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP) -> Path | None:
    """Collective: gather the full weights and (rank 0) write them with the model's `save_pretrained`
    (published M3 layout for openm3 models), if given the `M3Tokenizer` (`tokenizer.json`, its config and chat
    template), and for a vision-language model the video processor's settings with the clip length it was
    trained with (`video_preprocessor_config.json`), under a temporary name, then rename. Returns the path on
    rank 0. The weights are saved from a fresh model: `build_model.skeleton()` when the builder has one (the
    same architecture built without reading a checkpoint: a run started from one does not read it again), else
    `build_model()`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(out)
    result = None
    if info.is_main:
        fresh = (getattr(build_model, "skeleton", None) or build_model)()
        fresh.load_state_dict(full)
        if not hasattr(fresh, "save_pretrained"):
            raise ValueError(f"{type(fresh).__name__} has no save_pretrained; cannot export a consolidated checkpoint")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        fresh.save_pretrained(tmp)
        if tokenizer is not None:  # generate / serve (and transformers' AutoTokenizer) find it beside the weights
            tokenizer.save(tmp)
        if hasattr(fresh, "vision_tower"):
            from ..models.processor import save_video_processor_config

            save_video_processor_config(tmp, video_frames_per_clip)
        replace_directory(tmp, out, keep_other_files=False)  # no moment without a whole export, old or new
        result = out
    barrier(info)
    return result
