"""Host copies of small device tensors that every op of a forward reads (`cu_seqlens`).

Reading a CUDA tensor on the host (`.tolist()`) waits for the device to finish all queued work. The MSA ops and the
varlen dense attention each validate `cu_seqlens` on the host, and a model calls them once or twice per layer with
the same tensor, so without a cache a training step stops the launch queue dozens of times and the GPU idles while
Python launches the next kernels. `host_list` reads each tensor once: the copy is keyed by the tensor object and
its version counter (any in-place write invalidates it) and dropped when the tensor is freed. A caller that made
the device tensor from host values (the trainer's batch copy) hands them over with `remember_host_list`, and then
no read is needed at all.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["check_not_meta", "copy_from_host", "host_list", "remember_host_list", "to_device"]

_CACHE: dict[int, tuple] = {}


def check_not_meta(t: torch.Tensor, name: str) -> None:
    """ValueError naming `name` when `t` is a meta tensor (shapes without values: nothing can be computed from it)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor ({t.dtype} {list(t.shape)}), which holds no values: pass it on "
                         f"the CPU or a GPU")


def host_list(t: torch.Tensor, name: str = "tensor") -> list:
    """`t.tolist()`, read from the device once per (tensor, version) for CUDA tensors. ValueError naming `name`
    (the argument it came in as) for a meta tensor, which has no values to read."""
    check_not_meta(t, name)
    version = _cacheable_version(t)
    if version is None:
        return t.tolist()
    hit = _CACHE.get(id(t))
    if hit is not None:
        ref, hit_version, ptr, values = hit
        if ref() is t and hit_version == version and ptr == t.data_ptr():
            return list(values)
    values = t.tolist()
    _remember(t, version, values)
    return values


def remember_host_list(t: torch.Tensor, values: list) -> None:
    """Record `values` (what `t.tolist()` would return: nested for a tensor of several dimensions) as the host copy
    of CUDA tensor `t` (its current contents, e.g. what was just copied into it), so `host_list(t)` needs no device
    read. Ignored for other tensors."""
    version = _cacheable_version(t)
    if version is None:
        return
    count = _leaves(values)
    if count != t.numel() or (t.dim() > 1 and len(values) != t.shape[0]):
        raise ValueError(f"values: expected the {t.numel()} host values of a {tuple(t.shape)} tensor (as tolist() "
                         f"nests them), got {count} in {len(values)} rows")
    _remember(t, version, values)


def to_device(t: torch.Tensor, device: torch.device | str, *, remember: bool = False) -> torch.Tensor:
    """`t` on `device`. A host tensor goes to a GPU through pinned memory without blocking (a copy from pageable
    memory first waits for the stream's queued work, so the GPU idles while Python issues what comes next);
    `remember=True` also hands its values to `host_list` (small index tensors the model reads on the host)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        out = t.pin_memory().to(device, non_blocking=True)
        if remember:
            remember_host_list(out, t.tolist())
        return out
    return t.to(device)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` that does not wait for the device: a host `src` goes to a CUDA `dst` through pinned memory
    without blocking (from pageable memory the copy first waits for the stream's queued work, which would hold a
    decode step launched ahead of the host until the step before it has run). Any other pair: a plain copy."""
    if dst.is_cuda and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def _leaves(values) -> int:
    return sum(_leaves(v) for v in values) if isinstance(values, (list, tuple)) else 1


def _cacheable_version(t: torch.Tensor) -> int | None:
    """The version counter of a CUDA tensor whose host copy may be cached; None for host tensors and for
    inference tensors (they have no version counter, so a write could not be detected)."""
    if not t.is_cuda:
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def _remember(t: torch.Tensor, version: int, values: list) -> None:
    key = id(t)
    _CACHE[key] = (weakref.ref(t, lambda _ref, k=key: _CACHE.pop(k, None)), version, t.data_ptr(), tuple(values))
