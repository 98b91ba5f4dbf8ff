"""Checkpoint I/O for the M3 text model: safetensors shards + `model.safetensors.index.json` + `config.json`.

Two layouts are read (and may even be mixed):

- what `transformers` writes with `save_pretrained` for `MiniMaxM3VLForCausalLM` (`model.layers.N...`,
  fused `mlp.gate_up_proj.weight`, stacked `mlp.experts.gate_up_proj [E, 2I, H]`, `self_attn.indexer.*`), or
  for the VL model without conversion (`model.language_model.*`);
- the layout MiniMax publishes (the `minimax_m3_vl` entry of `transformers/conversion_mapping.py`):
  `language_model.model.*`, `language_model.lm_head.weight`, `block_sparse_moe.{gate,experts.E.w1|w2|w3,
  shared_experts.*, e_score_correction_bias}`, split `gate_proj`/`up_proj`, `self_attn.index_{q,k}_{proj,norm}`.
  Vision tower and projector tensors (and MTP heads) are skipped by this text-only loader.

The model's own `state_dict()` names load too (`save_file(model.state_dict(), ...)` beside a config.json): they
are transformers' names without `model.` (the VL model's: `language_model.` + them), fused parameters whole.

Either layout may be FP8 block-quantized, as MiniMax's releases are (config.json's `quantization_config`,
`openm3.models.fp8`): those weights are dequantized as they are read (`TensorSource`) and the model holds them in
its dtype (config.json's `dtype` / `torch_dtype`, or the one asked for); `save_pretrained` writes them unquantized.

`save_pretrained` writes the published layout through `write_checkpoint`, which every model's save uses: shards,
index and config.json go to a temporary directory beside the target that is then renamed into place, so a reader
never sees a half-written checkpoint. `load_text_model` builds the model on the meta device, allocates it once on
the target device, checks every name and shape against the shard headers before reading any data, then copies the
tensors shard by shard (a fused parameter receives its published pieces in place), so the weights are never held
twice. `load_pretrained` reads config.json and returns the VL model (`openm3.models.multimodal`) for a config with
a `vision_config`, the text model otherwise. Every problem raises `CheckpointError` (a `ValueError`) that names
the file or tensors involved.

To extend the mapping (e.g. for the VL model), add rows to `_LOAD_RULES` / `_SAVE_RULES` or prefixes to
`_PREFIXES` / `_IGNORED`.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import M3TextConfig
from .fp8 import SCALE_SUFFIX, Fp8Scheme, is_scale, scale_name, weight_name
from .text import M3TextModel

if TYPE_CHECKING:
    from .multimodal import M3ForConditionalGeneration

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as an M3 text model (message says which file/tensor)."""


def open_shard(file: Path):
    """`safe_open(file)` for reading; CheckpointError naming the file when it is no readable safetensors file (cut
    short by an interrupted copy or download, say) instead of safetensors' own error."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err}); copy or download it "
                              "again") from None


# ---------------------------------------------------------------------------------------------- name mapping
# Checkpoint name prefix -> our prefix (first match wins). A name with none of them may be one of the model's own
# (`map_checkpoint_name`).
_PREFIXES = (
    ("language_model.model.", ""),   # published
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", ""),   # transformers VL model, unconverted
    ("model.", ""),                  # transformers MiniMaxM3VLForCausalLM
    ("lm_head.", "lm_head."),
)
# Tensors of the checkpoint that the text model does not use.
_IGNORED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: `param[expert]` (if set), then half `half` of dim 0 (if set)."""

    param: str
    expert: int | None = None
    half: int | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            tensor = tensor[self.expert]
        if self.half is not None:
            rows = tensor.shape[0] // 2
            tensor = tensor[self.half * rows:(self.half + 1) * rows]
        return tensor

    def describe(self) -> str:
        parts = [] if self.expert is None else [f"expert {self.expert}"]
        parts += [] if self.half is None else [("gate", "up")[self.half] + " half"]
        return self.param + (f" ({', '.join(parts)})" if parts else "")


_L = r"layers\.(\d+)\."
# (pattern on the de-prefixed name, our parameter name template, group holding the expert id, half)
_LOAD_RULES = (
    (_L + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight", "layers.{0}.mlp.experts.gate_up_proj", 1, 0),
    (_L + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight", "layers.{0}.mlp.experts.gate_up_proj", 1, 1),
    (_L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", "layers.{0}.mlp.experts.down_proj", 1, None),
    (_L + r"block_sparse_moe\.gate\.weight", "layers.{0}.mlp.gate.weight", None, None),
    (_L + r"block_sparse_moe\.e_score_correction_bias", "layers.{0}.mlp.gate.e_score_correction_bias", None, None),
    (_L + r"block_sparse_moe\.shared_experts\.gate_proj\.weight", "layers.{0}.mlp.shared_experts.gate_up_proj.weight",
     None, 0),
    (_L + r"block_sparse_moe\.shared_experts\.up_proj\.weight", "layers.{0}.mlp.shared_experts.gate_up_proj.weight",
     None, 1),
    (_L + r"block_sparse_moe\.shared_experts\.down_proj\.weight", "layers.{0}.mlp.shared_experts.down_proj.weight",
     None, None),
    (_L + r"mlp\.gate_proj\.weight", "layers.{0}.mlp.gate_up_proj.weight", None, 0),
    (_L + r"mlp\.up_proj\.weight", "layers.{0}.mlp.gate_up_proj.weight", None, 1),
    (_L + r"self_attn\.index_(q|k)_(proj|norm)\.weight", "layers.{0}.self_attn.indexer.{1}_{2}.weight", None, None),
)
_LOAD_RULES = tuple((re.compile(p), t, g, h) for p, t, g, h in _LOAD_RULES)

# (pattern on our parameter name, published names: one per piece; "{e}" = expert id; pieces split dim 0 in halves)
_SAVE_RULES = (
    (_L + r"mlp\.experts\.gate_up_proj", ("layers.{0}.block_sparse_moe.experts.{e}.w1.weight",
                                          "layers.{0}.block_sparse_moe.experts.{e}.w3.weight")),
    (_L + r"mlp\.experts\.down_proj", ("layers.{0}.block_sparse_moe.experts.{e}.w2.weight",)),
    (_L + r"mlp\.gate\.weight", ("layers.{0}.block_sparse_moe.gate.weight",)),
    (_L + r"mlp\.gate\.e_score_correction_bias", ("layers.{0}.block_sparse_moe.e_score_correction_bias",)),
    (_L + r"mlp\.shared_experts\.gate_up_proj\.weight", ("layers.{0}.block_sparse_moe.shared_experts.gate_proj.weight",
                                                        "layers.{0}.block_sparse_moe.shared_experts.up_proj.weight")),
    (_L + r"mlp\.shared_experts\.down_proj\.weight", ("layers.{0}.block_sparse_moe.shared_experts.down_proj.weight",)),
    (_L + r"mlp\.gate_up_proj\.weight", ("layers.{0}.mlp.gate_proj.weight", "layers.{0}.mlp.up_proj.weight")),
    (_L + r"self_attn\.indexer\.(q|k)_(proj|norm)\.weight", ("layers.{0}.self_attn.index_{1}_{2}.weight",)),
)
_SAVE_RULES = tuple((re.compile(p), names) for p, names in _SAVE_RULES)


# (`params` lacks it with tied embeddings, where `_plan` skips a checkpoint's copy)
_LM_HEAD = "lm_head.weight"


def map_checkpoint_name(name: str, params: dict[str, torch.Tensor]) -> _Target | None:
    """The target of checkpoint tensor `name` among `params` (our names), None if the name is to be skipped.
    Raises CheckpointError for a name that matches nothing."""
    if _IGNORED.search(name):
        return None
    body = None
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            body = ours + name[len(prefix):]
            break
    if body is not None:
        for pattern, template, expert_group, half in _LOAD_RULES:
            m = pattern.fullmatch(body)
            if m:
                groups = m.groups()
                expert = int(groups[expert_group]) if expert_group is not None else None
                return _Target(template.format(*groups), expert, half)
        if body in params or body == _LM_HEAD:
            return _Target(body)
    else:
        # The model's own `state_dict()` names (a `save_file(model.state_dict())`; `language_model.` + them from
        # the VL model's): transformers' names without `model.`, already in the fused layout, so they fill
        # whole parameters. No published name lacks a prefix, and none of ours starts with `model.`.
        own = name.removeprefix("language_model.")
        if own in params or own == _LM_HEAD:
            return _Target(own)
    raise CheckpointError(name)


def published_tensors(model: M3TextModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor view) for every weight of `model`, in the layout MiniMax publishes."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        prefix = "language_model." if name.startswith("lm_head.") else "language_model.model."
        for pattern, names in _SAVE_RULES:
            m = pattern.fullmatch(name)
            if m:
                break
        else:
            yield prefix + name, tensor
            continue
        groups = m.groups()
        experts = range(tensor.shape[0]) if "{e}" in names[0] else [None]
        for e in experts:
            piece = tensor if e is None else tensor[e]
            rows = piece.shape[0] // len(names)
            for i, template in enumerate(names):
                part = piece if len(names) == 1 else piece[i * rows:(i + 1) * rows]
                yield prefix + template.format(*groups, e=e), part


# ---------------------------------------------------------------------------------------------- save
def save_pretrained(model: M3TextModel, path, *, max_shard_size: int | str = "5GB") -> Path:
    """Write the text model to `path` in the published layout (see `write_checkpoint`); returns the path."""
    if not isinstance(model, M3TextModel):
        raise ValueError(f"model must be an M3TextModel, got {type(model).__name__}")
    config = model.config.to_dict()
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return write_checkpoint(published_tensors(model), config, path, max_shard_size)


def write_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], config_dict: dict, path,
                     max_shard_size: int | str = "5GB") -> Path:
    """Write `config.json`, `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` into `path`.

    named_tensors: (checkpoint name, tensor of any shape/device) pairs; views of one storage are fine (each shard
    is copied to the CPU on its own, one shard at a time). Tensors are grouped in order into shards of at most
    `max_shard_size` bytes (an int, or a string like "5GB" / "500MiB"); a larger tensor gets a shard of its own.
    config_dict: written as config.json (must be JSON-serialisable).

    Atomic: everything is written into a temporary directory beside `path`, which is then renamed to `path`. When
    `path` already exists, the previous checkpoint files (config.json, the index, `model*.safetensors`) are
    replaced as a whole and its other files (a tokenizer, say) are kept; `path` is briefly absent during the swap.
    Returns `path` as a Path.
    """
    limit = parse_size(max_shard_size)
    if not isinstance(config_dict, dict):
        raise ValueError(f"config_dict must be a dict, got {type(config_dict).__name__}")
    try:
        config_text = json.dumps(config_dict, indent=2) + "\n"
    except (TypeError, ValueError) as err:
        raise ValueError(f"config_dict must be JSON-serialisable: {err}") from None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"path must be a directory (or not exist yet), got the file {out}")
    shards = _plan_shards(named_tensors, limit)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(out, "partial")
    tmp.mkdir()  # (not mkdtemp: its 0700 mode would become the checkpoint's)
    try:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            # clone: published pieces are views of one fused parameter, and safetensors refuses shared storage
            save_file({n: t.detach().to("cpu", copy=True).contiguous() for n, t in shard}, str(tmp / file),
                      metadata={"format": "pt"})
            os.chmod(tmp / file, 0o666 & ~_umask())  # safetensors writes 0600; the other files follow the umask
            weight_map.update({n: file for n, _ in shard})
            total += sum(t.numel() * t.element_size() for _, t in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (tmp / CONFIG_FILE).write_text(config_text)
        replace_directory(tmp, out, keep_other_files=True)  # out's tokenizer and the like stay
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plan_shards(named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int
                 ) -> list[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into shards of at most `limit` bytes; checks names and types."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    seen: set[str] = set()
    size = 0
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"named_tensors must yield (non-empty name, tensor) pairs, got {item!r:.80}")
        name, tensor = item
        if name in seen:
            raise ValueError(f"named_tensors: the name {name!r} appears twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    if not seen:
        raise ValueError("named_tensors must hold at least one tensor")
    return shards


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG_FILE, INDEX_FILE) or (name.startswith("model") and name.endswith(".safetensors"))


def sync_dir(path) -> None:
    """fsync the directory `path` itself: the names it holds (a rename into it, a new file) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root) -> None:
    """fsync every file and directory under `root` (and `root`): before a rename publishes a directory written
    with plain writes, so that after a power loss the published name never stands for data not yet on disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        sync_dir(folder)


def hidden_sibling(out: Path, tag: str) -> Path:
    """A fresh hidden name beside `out` (same file system, so renames between them are atomic)."""
    return out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.{tag}"


def replace_directory(tmp: Path, out: Path, *, keep_other_files: bool) -> None:
    """Put the finished directory `tmp` at `out` (both on one file system). keep_other_files: `out`'s entries that
    are not checkpoint files and that `tmp` lacks (a tokenizer, a chat template) are hard-linked (copied where
    links fail) into `tmp` first, so no `out` is ever seen without them. A crash leaves `out` whole, old or new,
    except between the two renames, when it is absent and both copies sit beside it as hidden `.NAME.*.old` /
    `.partial` directories (the loader's not-found error names them); those an earlier crash left are removed
    after a swap succeeds. Everything under `tmp` is flushed to disk before the rename, and the parent's names
    after it, so a power loss does not leave `out` naming data that never reached the disk."""
    tmp, out = Path(tmp), Path(out)
    if out.exists() and keep_other_files:
        for entry in out.iterdir():
            if _is_checkpoint_file(entry.name) or (tmp / entry.name).exists():
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                try:
                    os.link(entry, tmp / entry.name)
                except OSError:
                    shutil.copy2(entry, tmp / entry.name)
    sync_tree(tmp)
    old = hidden_sibling(out, "old") if out.exists() else None
    if old is not None:
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    sync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in leftover_copies(out):
        shutil.rmtree(stale, ignore_errors=True)


def leftover_copies(out: Path) -> list[Path]:
    """The hidden `.NAME.*.old` / `.partial` directories beside `out` that a crashed write left."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.glob(f".{glob.escape(out.name)}.*") if p.is_dir()
                  and re.fullmatch(rf"\.{re.escape(out.name)}\.[0-9a-f]{{12}}\.(old|partial)", p.name))


def parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size must be a positive int or a string like '5GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


# ---------------------------------------------------------------------------------------------- load
# The dtypes a model's parameters may have. fp8 is not among them: an fp8 checkpoint is dequantized into one of
# these as it is read (`TensorSource`).
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# the names a load's `dtype` argument takes (torch's, optionally with its `torch.` prefix)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# config.json's `dtype` / `torch_dtype`: torch's names and the usual short spellings
_CONFIG_DTYPES = {**_DTYPES, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
                  "fp32": torch.float32, "float": torch.float32, "float64": torch.float64, "fp64": torch.float64,
                  "double": torch.float64}


def check_dtype(dtype) -> torch.dtype | None:
    """The parameter dtype a load asks for: torch.bfloat16, float16, float32 or float64 as given, torch's name of one
    of the first three as a string ('bfloat16', 'float16', 'float32', with or without `torch.`), or None for None /
    'auto' (config.json's, see `load_text_model`). ValueError naming `dtype` for anything else, fp8 dtypes included
    (the model computes in its parameters' dtype; an fp8 checkpoint is dequantized as it loads)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in PARAM_DTYPES):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype == "auto":
        return None
    raise ValueError(f"dtype must be a floating torch.dtype, one of {['auto', *_DTYPES]} or None, got {dtype!r} "
                     f"(parameters may be torch.bfloat16, torch.float16, torch.float32 or torch.float64; fp8 "
                     f"checkpoints are dequantized into one of these as they load)")


def config_dtype(raw: dict, file) -> torch.dtype:
    """The parameter dtype config.json `raw` (at `file`) names in `dtype` / `torch_dtype`, float32 when it names
    none. CheckpointError naming the field for a name that is not a parameter dtype (`_CONFIG_DTYPES`)."""
    for key in ("dtype", "torch_dtype"):
        name = raw.get(key)
        if name is None:
            continue
        dtype = _CONFIG_DTYPES.get(name.removeprefix("torch.").lower()) if isinstance(name, str) else None
        if dtype is None:
            raise CheckpointError(f"{file}: {key}={name!r} is not a parameter dtype: expected one of "
                                  f"{sorted(_CONFIG_DTYPES)} (or pass dtype= to the loader)")
        return dtype
    return torch.float32


def _training_hint(root: Path) -> str:
    """What to do when `root` is an `openm3 train` run folder, its checkpoints folder or one of its (sharded)
    checkpoints instead of a model checkpoint; empty otherwise."""
    if (root / "trainer_state.pt").is_file():
        run, what = (root.parent.parent if root.parent.name == "checkpoints" else root.parent), "sharded checkpoint"
    elif (root / "LATEST").is_file():
        run, what = root.parent, "checkpoints folder"
    elif (root / "checkpoints").is_dir() or (root / "train_config.json").is_file():
        run, what = root, "folder"
    else:
        return ""
    if (run / "model" / CONFIG_FILE).is_file():  # `openm3 demo` exports there
        return f" but a training run's {what}; its exported model is {run / 'model'}"
    return (f" but a training run's {what}: `openm3 train --out {run} --resume --export DIR` writes the run's "
            f"latest model to DIR, which loads here")


def config_json(path) -> dict:
    """The parsed config.json of checkpoint directory `path`; raises CheckpointError if it is missing, not JSON,
    or of a model_type other than minimax_m3*."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE} there, so not a model checkpoint{_training_hint(Path(path))}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type is not None and not str(model_type).startswith("minimax_m3"):
        raise CheckpointError(f"{file}: unsupported model_type {model_type!r} (expected minimax_m3_vl[_text])")
    return data


def read_config(path) -> M3TextConfig:
    """The `M3TextConfig` of a checkpoint directory (its config.json; a VL config's `text_config` is used)."""
    data = config_json(path)
    try:
        return M3TextConfig.from_dict(data)
    except ValueError as err:
        raise CheckpointError(f"{Path(path) / CONFIG_FILE}: unsupported config: {err}") from None


def read_configs(path):
    """(`M3VLConfig` or None, `M3TextConfig`) of checkpoint directory `path`, from its config.json alone: the VL
    config when it has a `vision_config` (the text config is then its `text_config`). Raises CheckpointError."""
    if config_json(path).get("vision_config") is None:
        return None, read_config(path)
    from .multimodal import read_config as read_vl_config

    vl = read_vl_config(path)
    return vl, vl.text_config


def shard_index(path) -> dict[str, list[str]]:
    """Shard file -> the tensor names the index lists for it (or the single `model.safetensors`'s names) of
    checkpoint directory `path`; raises CheckpointError when the index or a shard it lists is missing."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({err})") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = sorted(f for f in files if not (root / f).is_file())
        if missing:
            raise CheckpointError(f"{root}: missing shard file(s) listed in {INDEX_FILE}: {missing[:5]}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        return files
    if (root / SINGLE_FILE).is_file():
        with open_shard(root / SINGLE_FILE) as f:
            return {SINGLE_FILE: list(f.keys())}
    raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


class TensorSource:
    """The tensors of checkpoint directory `root`, by shard. With an fp8 `quantization_config` in config.json
    (`openm3.models.fp8`), quantized weights come back dequantized to float32 and their scale tensors are not
    listed; every scale is read up front (a 1/16,384 share of the weights) and checked against its weight."""

    def __init__(self, root: Path):
        self.root = root
        files = shard_index(root)
        try:
            self.scheme = Fp8Scheme.from_config(config_json(root), root / CONFIG_FILE)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        scales = sorted(n for names in files.values() for n in names if is_scale(n))
        if scales and self.scheme is None:
            raise CheckpointError(f"{root}: tensors of an fp8 checkpoint ({_few(scales, 3)}) but config.json has "
                                  "no fp8 quantization_config")
        self.files = {file: [n for n in names if not is_scale(n)] for file, names in files.items()}
        self.scales: dict[str, torch.Tensor] = {}
        for file, names in files.items():
            wanted = [n for n in names if n.endswith(SCALE_SUFFIX)]
            if wanted:
                with open_shard(root / file) as f:
                    self.scales.update((n, f.get_tensor(n)) for n in wanted)
        listed = {n for names in self.files.values() for n in names}
        orphans = sorted(n for n in self.scales if weight_name(n) not in listed)
        if orphans:
            raise CheckpointError(f"{root}: scale tensors without their weight: {_few(orphans)}")

    def check(self, f, name: str) -> None:
        """Raise CheckpointError when fp8 weight `name` (of open shard `f`) lacks a matching scale, or a scale
        comes with a weight that is not fp8."""
        dtype = f.get_slice(name).get_dtype()
        scale = self.scales.get(scale_name(name))
        if dtype.startswith("F8") and dtype != "F8_E4M3":
            raise CheckpointError(f"{self.root}: {name} is {dtype}; openm3 reads float8_e4m3fn weights only")
        if dtype == "F8_E4M3":
            if self.scheme is None:
                raise CheckpointError(f"{self.root}: {name} is float8_e4m3fn but config.json has no fp8 "
                                      "quantization_config")
            if scale is None:
                raise CheckpointError(f"{self.root}: {name} is float8_e4m3fn but {scale_name(name)} is missing")
            shape = tuple(f.get_slice(name).get_shape())
            want = self.scheme.scale_shape(shape)
            if tuple(scale.shape) != want:
                raise CheckpointError(f"{self.root}: {scale_name(name)}: shape {list(scale.shape)}, expected "
                                      f"{list(want)} for {name} {list(shape)} in blocks of {list(self.scheme.block)}")
        elif scale is not None:
            raise CheckpointError(f"{self.root}: {scale_name(name)} scales {name}, which is {dtype}, not fp8")

    def get(self, f, name: str, device: torch.device | None = None) -> torch.Tensor:
        """Tensor `name` of open shard `f`, dequantized (float32) when it is an fp8 weight; that happens on
        `device` (the model's: a GPU moves 1 byte per weight over PCIe instead of 4 and multiplies faster)."""
        tensor = f.get_tensor(name)
        if tensor.dtype == torch.float8_e4m3fn:
            self.check(f, name)
            tensor = self.scheme.dequantize(tensor.to(device), self.scales[scale_name(name)].to(device))
        return tensor


def _plan(source: TensorSource, params: dict[str, torch.Tensor], tied: bool) -> dict[str, list[tuple[str, _Target]]]:
    """Check every checkpoint tensor's name and shape (and an fp8 weight's scales) against the model before any
    data is read. Returns shard file -> [(checkpoint name, target)]. With `tied` embeddings an lm_head tensor is
    skipped."""
    root = source.root
    plan: dict[str, list[tuple[str, _Target]]] = {}
    unknown, mismatched, duplicated = [], [], []
    covered: dict[str, int] = {}
    seen: set[_Target] = set()
    for file, listed in source.files.items():
        with open_shard(root / file) as f:
            present = set(f.keys())
            absent = sorted(set(listed) - present)
            if absent:
                raise CheckpointError(f"{root / file}: tensors listed in the index are missing: {_few(absent)}")
            entries = plan.setdefault(file, [])
            for name in sorted(listed):
                try:
                    target = map_checkpoint_name(name, params)
                except CheckpointError:
                    unknown.append(name)
                    continue
                if target is None or (tied and target.param == "lm_head.weight"):
                    continue
                if target.param not in params:
                    unknown.append(name)
                    continue
                if target in seen:
                    duplicated.append(name)
                    continue
                seen.add(target)
                try:
                    expected = tuple(target.view(params[target.param]).shape)
                except IndexError:
                    expected = None
                source.check(f, name)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    mismatched.append(f"{name}: checkpoint {list(shape)} vs model "
                                      f"{list(expected) if expected else 'no such slot'} ({target.describe()})")
                    continue
                covered[target.param] = covered.get(target.param, 0) + int(torch.Size(shape).numel())
                entries.append((name, target))
    if unknown:
        raise CheckpointError(f"{root}: unknown tensor names (not part of this config's M3 text model): "
                              f"{_few(unknown)}")
    if duplicated:
        raise CheckpointError(f"{root}: tensors that fill the same weight twice: {_few(duplicated)}")
    if mismatched:
        raise CheckpointError(f"{root}: shape mismatch between checkpoint and config: {_few(mismatched, 3)}")
    missing = [n for n, p in params.items() if covered.get(n, 0) != p.numel()]
    if missing:
        raise CheckpointError(f"{root}: checkpoint lacks tensors for: {_few(missing)}")
    return plan


def load_pretrained(path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None
                    ) -> M3TextModel | M3ForConditionalGeneration:
    """Load an M3 model from a local checkpoint directory (either layout, see the module docstring).

    Returns `M3ForConditionalGeneration` (text decoder + vision tower + projector) when config.json is a VL config
    with a `vision_config`, else `M3TextModel`; `load_text_model` reads only the text decoder of either.
    dtype: parameter dtype, torch.bfloat16 / float16 / float32 / float64 or the name of one of the first three
    ('bfloat16', 'float16', 'float32'); None or 'auto': the `dtype` / `torch_dtype` of config.json, else float32.
    device: where to allocate the model (default CPU).
    Returns the model in eval mode.
    """
    root = _checkpoint_dir(path)
    check_dtype(dtype)
    if config_json(root).get("vision_config") is not None:
        from .multimodal import load_pretrained as load_vl

        return load_vl(root, dtype=dtype, device=device)
    return load_text_model(root, dtype=dtype, device=device)


def _checkpoint_dir(path) -> Path:
    root = Path(path)
    if not root.is_dir():
        left = leftover_copies(root)
        raise CheckpointError(f"{root}: checkpoint directory not found" + (
            f" (a write to it was cut short; beside it: {', '.join(p.name for p in left)}: an .old directory is "
            f"the checkpoint before, a .partial one the new, maybe incomplete; rename one to {root.name})"
            if left else ""))
    return root


def load_text_model(path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None, *,
                    source: TensorSource | None = None) -> M3TextModel:
    """Load the M3 text decoder from a local checkpoint directory, text-only or VL (vision tensors are skipped).

    dtype: parameter dtype, torch.bfloat16 / float16 / float32 / float64 or the name of one of the first three
    ('bfloat16', 'float16', 'float32'); None or 'auto': the `dtype` / `torch_dtype` of config.json, else float32.
    device: where to allocate the model (default CPU).
    Returns the model in eval mode.
    source: the checkpoint's `TensorSource` when the caller has built it already (the VL loader reads the vision
    tensors through the same one: config.json and the fp8 scales are read once).
    """
    root = _checkpoint_dir(path)
    dtype = check_dtype(dtype)
    config = read_config(root)
    if dtype is None:
        dtype = config_dtype(config_json(root), root / CONFIG_FILE)
    device = torch.device(device if device is not None else "cpu")

    source = source if source is not None else TensorSource(root)
    with torch.device("meta"):
        model = M3TextModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    plan = _plan(source, params, config.tie_word_embeddings)

    total = sum(p.numel() * p.element_size() for p in params.values())
    with torch.no_grad(), _progress(total, f"loading {root.name}") as bar:
        for file, entries in plan.items():
            with open_shard(root / file) as f:
                for name, target in entries:
                    view = target.view(params[target.param])
                    view.copy_(source.get(f, name, device))
                    bar.update(view.numel() * view.element_size())
    return model.eval()


# a checkpoint load takes a progress bar (on stderr) from this many bytes of weights on
PROGRESS_BYTES = 2 << 30


def _progress(total: int, desc: str):
    """A tqdm bar over `total` bytes when they are at least `PROGRESS_BYTES` (a real M3 checkpoint loads for
    minutes), else one that shows nothing."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=total < PROGRESS_BYTES, file=sys.stderr)
