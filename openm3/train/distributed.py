"""Process group set-up and FSDP2 sharding.

One process, or `torchrun --nproc_per_node=N`: the environment variables torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK) decide. CUDA uses NCCL, CPU uses gloo (the CI distributed test). Sharding follows torchtitan's order:
activation checkpointing, then compile, then FSDP2 `fully_shard` on every block and finally on the root module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False")
    return torch.device(name)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the torchrun process group if there is one (idempotent)."""
    dev = pick_device(device)
    world = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def shutdown_distributed() -> None:
    """Leave the process group before the process exits (idempotent). Left to the interpreter's teardown, gloo's
    threads can be destroyed while running and abort a rank after its work is done ("terminate called without an
    active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a model: every child of a ModuleList named `layers` or `blocks`
    (text decoder layers and vision tower blocks alike)."""
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "blocks"):
            blocks.extend(module)
    return blocks


def apply_activation_checkpointing(model: nn.Module, context_fn=None) -> int:
    """Recompute each block's activations in backward (non-reentrant). Returns the number of blocks wrapped.

    `context_fn` goes to `torch.utils.checkpoint.checkpoint` (called once per checkpointed call: a pair of context
    managers around the forward and the recomputation); `openm3.layers.recompute.reuse_contexts` lets MSA layers
    hand their selection and indexer KL to the recomputation instead of running them twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "blocks"):
            for i, block in enumerate(module):
                module[i] = checkpoint_wrapper(block, **kwargs)
                count += 1
    return count


def apply_compile(model: nn.Module, *, backend: str = "inductor", dynamic: bool | None = None) -> int:
    """`torch.compile` every text decoder layer and vision tower block in place; returns how many.

    Per layer, not the whole model: the layers share one code object, so all MSA+MoE layers reuse one set of
    compiled graphs (and the dense layers another), and what cannot be traced stays local to a layer. Inside a
    layer only `Attention.attend` runs eagerly (the varlen dense and MSA ops read `cu_seqlens` on the host), and
    on CPU the MoE's reference experts; the norms, the q/k/v projections, QK-norm, partial RoPE, the indexer's
    projections, norms and RoPE, o_proj, the residuals and the MLP or MoE are compiled. Dynamo breaks the graph
    at the call of `self_attn` and again at `attend`, so a layer runs four graphs (input norm | projections, norms
    and RoPE | o_proj | residual and MLP); with `torch._dynamo.config.nested_graph_breaks = True` it runs two
    (input norm to RoPE | o_proj to the end). `dynamic=None` compiles for the first shapes seen and recompiles
    once with dynamic sizes when the token count or the number of packed documents changes, so later packings
    reuse it. A layer wrapped for activation checkpointing is compiled inside the wrapper, so the backward
    recomputation runs the same compiled code. Vision tower blocks compile the same way around their segment
    attention (`VisionAttention.attend`, eager: it reads `cu_seqlens` on the host): layer norms, projections, axial
    RoPE, the MLP and the residuals.
    """
    from ..layers.vision import VisionBlock
    from ..models.text import DecoderLayer

    count = 0
    for block in find_blocks(model):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if isinstance(inner, (DecoderLayer, VisionBlock)):
            inner.compile(backend=backend, dynamic=dynamic)
            count += 1
    if count == 0:
        raise ValueError(f"compile: {type(model).__name__} has no openm3 decoder layers (DecoderLayer) to compile")
    return count


def apply_fsdp(model: nn.Module, info: DistInfo, param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: `fully_shard` every block, then the root. With `param_dtype` (bf16 on GPU) parameters are
    gathered in that dtype for compute while gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
    for block in find_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
