"""M3 mixture of experts: sigmoid router with a selection-only correction bias, routed experts, shared expert.

The routed experts have two implementations with the same numbers (`Experts.impl`):

- ``"reference"``: the spec. Per expert, gather its tokens, run the SwiGLU-OAI MLP, add the weighted result back.
  One host sync (the per-expert token counts) and two small matmuls per expert; the CPU default and what the
  parity tests with transformers run.
- ``"grouped"``: the training path. The (token, slot) pairs are sorted by expert once, each projection is one
  grouped matmul over all experts (``torch._grouped_mm`` with per-expert row offsets computed on the device), the
  activation is one fused elementwise kernel on CUDA (``torch.compile``), and the k expert outputs of a token are
  un-permuted (one gather) and mixed with its routing weights by one fused kernel (no atomics, deterministic). With
  ``torch._grouped_mm`` present and 16-byte aligned rows there is no host sync; otherwise each projection runs
  per expert on contiguous sorted slices, which needs the counts on the host (one sync). Without gradients
  (inference) the mix, the routed scaling and the shared expert's add are one fused kernel that also puts the
  outputs back in token order; where Triton runs (`openm3.ops.norm_rope.inference_kernels`) the router's
  sigmoid / top-k and, for a decode step's few pairs, the sort by expert and the row gather are one kernel each
  (`openm3.ops.moe_routing`): ~12 kernels fewer per layer than the training path, the same experts and outputs.

``"auto"`` (the default) picks ``grouped`` for bf16 on CUDA (the Hopper grouped GEMM is bf16-only), including fp32
inputs under a bf16 CUDA autocast (the trainer's single-GPU mode: fp32 parameters, bf16 compute); ``reference``
everywhere else, except fp32 decode steps on CUDA without gradients (up to ``expert_linear_max_pairs(E)`` pairs):
they take the expert kernels, which sum in fp64 per step for fp32 and make no host sync (a CUDA graph can capture
them; the reference's sync made fp32 graph decode fall back to eager). Inside ``torch.compile`` the reference runs
eagerly as one opaque call (its host sync and per-expert loop would otherwise break the graph at data-dependent
points and recompile for every new expert load). `set_experts_impl(model, impl)` switches every `Experts` inside a
model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.fused import fused_on_cuda
from ..ops.moe_experts import expert_linear, expert_linear_max_pairs
from ..ops.moe_routing import SORT_PAIRS_MAX, route_topk, sort_pairs
from ..ops.norm_rope import inference_kernels
from .joint_weights import join_rows, joint_matrix, rows_intact
from .mlp import DenseMLP, fused_swiglu_oai, swiglu_oai

IMPLS = ("auto", "reference", "grouped")


# Up to this many experts per token, CUDA picks them with k max passes instead of torch.topk.
MAX_PASSES_TOP_K = 4


def top_k_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [N, k]: the columns of the k largest entries of each row of x [N, E], largest first.

    On CUDA with k <= MAX_PASSES_TOP_K, k passes of argmax (each found column masked to -inf for the next): a few
    reductions that inductor fuses inside a compiled layer, where aten's radix top-k took ~130 us per call for
    m3-small's 65,536 x 16 router scores in a training step. The same columns as `torch.topk` unless two entries of
    a row tie (then the lower column comes first here; torch.topk leaves that order unspecified)."""
    if not x.is_cuda or k > MAX_PASSES_TOP_K or k >= x.shape[-1]:
        return torch.topk(x, k, dim=-1).indices
    return _top_k_by_passes(x, k)


def _top_k_by_passes(x: torch.Tensor, k: int) -> torch.Tensor:
    ids = []
    for j in range(k):
        i = x.argmax(dim=-1, keepdim=True)
        ids.append(i)
        if j + 1 < k:
            x = x.scatter(-1, i, float("-inf"))
    return torch.cat(ids, dim=-1)


class Router(nn.Module):
    """Sigmoid top-k router.

    Scores are `sigmoid(x @ weight.T)`; `e_score_correction_bias` (a buffer that a load-balancing rule may move,
    never a gradient) is added only to choose the experts, and the chosen experts' plain sigmoid scores,
    normalised to sum to 1, are the mixing weights.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (router_logits [N, E], weights fp32 [N, k], expert ids int64 [N, k])."""
        logits = F.linear(self._input(x), self.weight)
        return (logits, *self.pick(logits))

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the weight's dtype, as transformers' router casts it, except where autocast would cast that copy
        straight back: x in the autocast dtype beside fp32 weights (the trainer's one-GPU bf16 autocast). The
        matmul runs in the autocast dtype either way, on the same values, but on x itself it saves x, which the
        layer's other ops save anyway, instead of a new bf16 copy: 2 * hidden bytes per token per MoE layer."""
        device = x.device.type
        if self.weight.dtype == torch.float32 and torch.is_autocast_enabled(device) \
                and x.dtype == torch.get_autocast_dtype(device):
            return x
        return x.to(self.weight.dtype)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router after its matmul: (weights fp32 [N, k], expert ids int64 [N, k]) from logits [N, E]."""
        if inference_kernels(logits):  # one kernel (openm3.ops.moe_routing), `route`'s numbers
            return route_topk(logits, self.e_score_correction_bias, self.top_k)
        return route(logits, self.e_score_correction_bias, self.top_k)


@fused_on_cuda
def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its matmul: (mixing weights fp32 [N, k], expert ids int64 [N, k]) from logits [N, E] and
    the selection bias [E]. One or two compiled kernels on CUDA (about ten small ones written out: a decode step
    runs it once per MoE layer)."""
    scores = torch.sigmoid(logits.float())
    experts = top_k_ids(scores + bias, top_k)
    weights = scores.gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class Experts(nn.Module):
    """Routed SwiGLU-OAI experts stored as stacked tensors.

    gate_up_proj: [E, 2I, hidden] (gate rows first, then up rows); down_proj: [E, hidden, I].
    impl: "auto" | "reference" | "grouped" (see the module docstring); may be reassigned at any time.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 impl: str = "auto"):
        super().__init__()
        self.alpha = alpha
        self.limit = limit
        self.impl = impl
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {value!r}")
        self._impl = value

    def resolved_impl(self, x: torch.Tensor) -> str:
        """The implementation `forward(x, ...)` runs: "reference" or "grouped"."""
        if self.impl != "auto":
            return self.impl
        return "grouped" if x.is_cuda and _compute_dtype(x) == torch.bfloat16 and _HAS_GROUPED_MM else "reference"

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                check_ids: bool = True, scale: float = 1.0, add: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [N, hidden], experts: [N, k] ids in [0, E), weights: [N, k] -> weighted sum of expert outputs
        [N, hidden] (dtype of x), times `scale`, plus `add` [N, hidden], then plus `residual` [N, hidden] when given
        (MoE's routed scaling, shared expert and the decoder layer's residual: `out * scale + add + residual` as
        torch ops in that order, in one kernel with the mix in grouped inference). check_ids=False
        skips the ids' range check (on CUDA five small kernels and an asynchronous assert): for ids a `Router`
        made, in range by construction."""
        self._check(x, experts, weights, check_ids)
        for name, t in (("add", add), ("residual", residual)):
            if t is not None and t.shape != x.shape:
                raise ValueError(f"{name} must be [N, hidden] like x {tuple(x.shape)}, got {tuple(t.shape)}")
        if x.shape[0] == 0:
            out = torch.zeros_like(x)
        elif self.resolved_impl(x) == "grouped" or self._fp32_decode_kernels(x, experts, weights):
            if not torch.compiler.is_compiling() and not self._wants_grad(x, weights):
                return self._grouped_inference(x, experts, weights, scale, add, residual)
            out = self._grouped(x, experts, weights)
        elif torch.compiler.is_compiling():
            out = self._reference_eager(x, experts, weights)
        else:
            out = self._reference(x, experts, weights)
        if scale != 1.0:
            out = out * scale
        out = out if add is None else out + add
        return out if residual is None else out + residual

    def _wants_grad(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, *self.parameters()))

    def _fp32_decode_kernels(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> bool:
        """`auto` with fp32 on CUDA, without gradients, for a decode step's few pairs: the expert kernels (fp32 to
        rounding: fp64 sums per step) in place of the reference, whose host sync a CUDA graph cannot capture."""
        return (self.impl == "auto" and x.is_cuda and _compute_dtype(x) == torch.float32
                and experts.dtype == torch.int64
                and experts.numel() <= min(SORT_PAIRS_MAX, expert_linear_max_pairs(self.gate_up_proj.shape[0]))
                and inference_kernels(x) and not self._wants_grad(x, weights))

    @torch.compiler.disable
    def _reference_eager(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._reference(x, experts, weights)

    def _check(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, check_ids: bool) -> None:
        num_experts, _, hidden = self.gate_up_proj.shape
        if x.dim() != 2 or x.shape[1] != hidden:
            raise ValueError(f"x must be [N, {hidden}], got {tuple(x.shape)}")
        autocast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        if x.dtype not in (self.gate_up_proj.dtype, autocast):  # x in the autocast dtype beside fp32 experts
            raise ValueError(f"x must have the experts' dtype {self.gate_up_proj.dtype} (or the autocast dtype), got "
                             f"{x.dtype}")
        if experts.dim() != 2 or experts.shape[0] != x.shape[0] or experts.dtype.is_floating_point \
                or experts.dtype == torch.bool:
            raise ValueError(f"experts must be an integer tensor [N={x.shape[0]}, k], got {experts.dtype} "
                             f"{tuple(experts.shape)}")
        if weights.shape != experts.shape or not weights.dtype.is_floating_point:
            raise ValueError(f"weights must be a float tensor of the shape of experts {tuple(experts.shape)}, got "
                             f"{weights.dtype} {tuple(weights.shape)}")
        if not check_ids:
            return
        in_range = ((experts >= 0) & (experts < num_experts)).all()
        if experts.is_cuda or torch.compiler.is_compiling():
            torch._assert_async(in_range, f"experts: ids must lie in [0, {num_experts})")  # no host sync
        elif not bool(in_range):
            raise ValueError(f"experts: ids must lie in [0, {num_experts}), got [{int(experts.min())}, "
                             f"{int(experts.max())}]")

    def _reference(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        token = order // experts.shape[1]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start:start + n]
            tok = token[start:start + n]
            start += n
            h = swiglu_oai(F.linear(x[tok], self.gate_up_proj[e]), self.alpha, self.limit)
            h = F.linear(h, self.down_proj[e]) * weights.reshape(-1)[idx, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x and the expert weights in the compute dtype: under autocast the GEMMs run in the autocast dtype, as
        F.linear would (`_grouped_mm` is not on autocast's cast lists, and the Hopper kernel takes bf16 only);
        outside autocast this is a no-op."""
        dtype = _compute_dtype(x)
        return x.to(dtype), self.gate_up_proj.to(dtype), self.down_proj.to(dtype)

    def _sorted(self, x: torch.Tensor, experts: torch.Tensor):
        """What both grouped paths start from: x and the expert weights in the compute dtype, the (token, slot)
        pairs' order sorted by expert, and offs[e] = the end of expert e's rows in that order."""
        num_experts = self.gate_up_proj.shape[0]
        x, gate_up_proj, down_proj = self._operands(x)
        # (token, slot) pairs grouped by expert: a radix sort of 8-bit ids takes one pass (int32: four)
        sorted_ids, order = torch.sort(experts.reshape(-1).to(_id_dtype(num_experts)), stable=True)
        # offs computed on the device (no host sync)
        offs = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype),
                                  right=True, out_int32=True)
        return x, gate_up_proj, down_proj, order, offs

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        x, gate_up_proj, down_proj, order, offs = self._sorted(x, experts)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        rows = _PermuteRows.apply(x, order, inverse, k)  # [N*k, hidden]: row i is token order[i] // k
        h = grouped_linear(rows, gate_up_proj, offs)  # [N*k, 2I]
        h = fused_swiglu_oai(h, self.alpha, self.limit)  # [N*k, I]
        y = grouped_linear(h, down_proj, offs)  # [N*k, hidden], expert order
        y = _PermuteRows.apply(y, inverse, order, 1).view(n, k, -1)  # back to (token, slot) order
        return mix_expert_outputs(y, weights)

    def _grouped_inference(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, scale: float,
                           add: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        """`_grouped` without gradients, in fewer kernels (a decode step runs ~15 of these per token): the expert
        outputs put back in token order inside the fused kernel that mixes them and applies `scale`, `add` and
        `residual`.
        A decode step's few pairs are sorted and gathered by one kernel (`openm3.ops.moe_routing.sort_pairs`), and
        up to `expert_linear_max_pairs(E)` of them go through the experts in two more (`openm3.ops.moe_experts`: the
        SwiGLU inside the first); more (prefill) take the radix sort, gathered by `order` directly and put back by
        one `index_copy_`."""
        n, k = experts.shape
        if n * k <= SORT_PAIRS_MAX and experts.dtype == torch.int64 and inference_kernels(x):
            x, gate_up_proj, down_proj = self._operands(x)
            rows, offs, pos = sort_pairs(experts, x, gate_up_proj.shape[0])
            if n * k <= expert_linear_max_pairs(gate_up_proj.shape[0]):
                h = expert_linear(rows, gate_up_proj, offs, swiglu=(self.alpha, self.limit))
                y = expert_linear(h, down_proj, offs)
            else:
                h = fused_swiglu_oai(grouped_linear(rows, gate_up_proj, offs), self.alpha, self.limit)
                y = grouped_linear(h, down_proj, offs)  # expert order; pair p's row is y[pos[p]]
            return mix_gather_scale_add(y, pos, weights, scale, add, residual)
        x, gate_up_proj, down_proj, order, offs = self._sorted(x, experts)
        h = fused_swiglu_oai(grouped_linear(x[order // k], gate_up_proj, offs), self.alpha, self.limit)
        y = grouped_linear(h, down_proj, offs)  # expert order
        y = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)  # (token, slot) order
        return mix_scale_add(y, weights, scale, add, residual)


def _mix(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # unrolled over the k slots: one pointwise kernel reading y once (a sum over dim 1 compiles to a reduction
    # kernel that ran at ~0.5 TB/s on an H200)
    weights = weights.float()
    out = y[:, 0].float() * weights[:, 0:1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j].float() * weights[:, j:j + 1]
    return out.to(y.dtype)


def _mix_scale_add(y: torch.Tensor, weights: torch.Tensor, scale: float, add: torch.Tensor | None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    out = _mix(y, weights) * scale
    out = out if add is None else out + add
    return out if residual is None else out + residual


# `mix_expert_outputs(y, weights) * scale + add + residual` (MoE's routed scaling, shared expert and the decoder
# layer's residual), one kernel on CUDA
mix_scale_add = fused_on_cuda(_mix_scale_add)


@fused_on_cuda
def mix_gather_scale_add(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, scale: float,
                         add: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`mix_scale_add` of y's rows in (token, slot) order, `y[pos]` (y [N*k, hidden] in expert order): the gather
    inside the one fused kernel on CUDA."""
    return _mix_scale_add(y[pos].view(weights.shape[0], weights.shape[1], -1), weights, scale, add, residual)

# sum_j weights[t, j] * y[t, j] in fp32 for y [N, k, hidden], weights [N, k] -> [N, hidden] in y's dtype: one fused
# elementwise-and-reduce kernel each way on CUDA. (A batched matmul [N, 1, k] x [N, k, hidden] ran as cuBLAS gemv at
# ~180 GB/s on an H200: 0.75 ms per m3-small MoE layer for a 32K-token prefill chunk, where reading y takes ~60 us.)
mix_expert_outputs = fused_on_cuda(_mix)


class _PermuteRows(torch.autograd.Function):
    """out = x[index // repeats] where `index` is a permutation of range(len(x) * repeats) and `inverse` its
    inverse: each row of x appears `repeats` times. The backward gathers with `inverse` and sums the repeats, so
    no atomics (unlike the backward of plain indexing): deterministic and cheaper."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, repeats: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return x[index // repeats]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        grad = grad[inverse]
        if ctx.repeats > 1:
            grad = grad.view(-1, ctx.repeats, grad.shape[-1]).sum(dim=1)
        return grad, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group `x[rows of group e] @ weight[e].T`.

    x: [M, in] with rows sorted by group; weight: [E, out, in]; offs: int32 [E], offs[e] = end row of group e
    (non-decreasing, offs[-1] == M). Returns [M, out]. Uses one `torch._grouped_mm` when present and the rows are
    16-byte aligned, else one matmul per group on contiguous slices (one host sync for the offsets).
    """
    if _grouped_mm_ok(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    parts, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            parts.append(F.linear(x[start:end], weight[e]))
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
USE_GROUPED_MM = _HAS_GROUPED_MM  # tests set this to False to run the sliced fallback


def _grouped_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # the grouped GEMM needs every row stride (in, out) to be a multiple of 16 bytes
    align = 16 // x.element_size()
    # (torch.compile traces it with the CUDA kernel's rules: bf16 only; CPU eager takes fp32 too)
    dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else (torch.bfloat16, torch.float32)
    return (USE_GROUPED_MM and x.dtype in dtypes and x.dtype == weight.dtype
            and weight.shape[1] % align == 0 and weight.shape[2] % align == 0)


def _id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds expert ids 0 .. num_experts - 1 and `num_experts` itself."""
    return torch.uint8 if num_experts < 256 else torch.int32


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: the autocast dtype when autocast is on for x's device, else x's dtype."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def set_experts_impl(module: nn.Module, impl: str) -> int:
    """Set `impl` ("auto" | "reference" | "grouped") on every `Experts` inside `module`; returns how many."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    found = [m for m in module.modules() if isinstance(m, Experts)]
    for m in found:
        m.impl = impl
    return len(found)


class MoE(nn.Module):
    """x [N, hidden] -> (routed_scaling_factor * routed experts + shared expert, router logits [N, E])."""

    def __init__(self, hidden_size: int, intermediate_size: int, shared_intermediate_size: int, num_experts: int,
                 top_k: int, routed_scaling_factor: float, alpha: float, limit: float, impl: str = "auto"):
        super().__init__()
        self.routed_scaling_factor = routed_scaling_factor
        self.gate = Router(hidden_size, num_experts, top_k)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, alpha, limit, impl)
        self.shared_experts = DenseMLP(hidden_size, shared_intermediate_size, alpha, limit)
        self._joint_rows: tuple[int, ...] | None = None  # set by `fuse_projections`

    def _joint_weights(self) -> list[torch.Tensor]:
        return [self.shared_experts.gate_up_proj.weight, self.gate.weight]

    def fuse_projections(self) -> bool:
        """Inference layout (`openm3.layers.joint_weights`): the shared expert's gate_up weight and the router's,
        which both read the layer's input, become consecutive row blocks of one matrix, so that where the
        inference kernels run (no gradient) one GEMM computes both: a decode step's MoE layer loses the router's
        own GEMM. Names, values and memory unchanged; a `.to` undoes it. Returns whether the layout was made (it
        needs one dtype and device and no bias)."""
        if rows_intact(self._joint_weights(), self._joint_rows):
            return True
        if self.shared_experts.gate_up_proj.bias is not None:
            return False
        rows = join_rows(self._joint_weights())
        if rows is not None:
            self._joint_rows = rows
        return rows is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual [N, hidden]: added last (`residual + moe(x)` as the decoder layer's residual add, in the mix's
        fused kernel in inference)."""
        if self._joint_rows is not None and x.dtype == self.gate.weight.dtype \
                and inference_kernels(x, self.gate.weight) and rows_intact(self._joint_weights(), self._joint_rows):
            joint = joint_matrix(self.shared_experts.gate_up_proj.weight, self._joint_rows)
            gate_up, logits = F.linear(x, joint).split(self._joint_rows, dim=-1)
            shared = self.shared_experts.from_gate_up(gate_up)
            weights, experts = self.gate.pick(logits)
        else:
            shared = self.shared_experts(x)
            logits, weights, experts = self.gate(x)
        # the router's ids are in range: eagerly the check is five small kernels per layer and is skipped; under
        # torch.compile it fuses into the graph and stays (without it Dynamo recompiled a graph once more, CPU test)
        return self.experts(x, experts, weights, check_ids=torch.compiler.is_compiling(),
                            scale=self.routed_scaling_factor, add=shared, residual=residual), logits


def fuse_moe_projections(model: nn.Module) -> int:
    """`MoE.fuse_projections` on every MoE layer of `model`; returns how many took the layout. Opt-in:
    `openm3.engine.generate.for_inference` does not call it, as it measured no gain (session 40, H100, m3-small
    8 x 16K decode, same process: CUDA-graph replay 1.854-1.857 ms separate, 1.868-1.870 ms joint; the router's
    own GEMM was ~5 us under the profiler, but the joint GEMM of 2048 + 16 rows costs about as much more).
    `benchmarks/generate_repeat.py`'s step `fusemoe` times it."""
    return sum(m.fuse_projections() for m in model.modules() if isinstance(m, MoE))


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all MoE layers, computed as transformers' M3 does.

    router_logits: per MoE layer [N, E]. With p = softmax(logits) and f_e the fraction of (token, slot) pairs whose
    top-k of p picks expert e (pooled over layers), loss = E * sum_e f_e * mean(p_e). A scalar fp32 tensor; 0 for
    no rows at all (transformers' mean over none is NaN), still connected to the logits (zero gradients).
    """
    if len(router_logits) == 0:
        raise ValueError("router_logits must hold at least one MoE layer's [N, E] logits")
    for logits in router_logits:
        if logits.dim() != 2 or logits.shape[1] != num_experts:
            raise ValueError(f"router_logits entries must be [N, {num_experts}], got {tuple(logits.shape)}")
    # every layer's rows in one call: the sums over layers are sums over the rows of all layers (one compiled
    # graph on CUDA instead of one call per layer, whose host overhead set the pace of this loss)
    logits = router_logits[0] if len(router_logits) == 1 else torch.cat(list(router_logits))
    counts, prob_sum = _balance_terms(logits, top_k)
    rows = max(logits.shape[0], 1)  # no rows: both sums are zeros, so the loss is 0 instead of 0 / 0
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


@fused_on_cuda
def _balance_terms(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The load-balancing loss's sums over the rows of logits [N, E]: (how many (token, slot) pairs the top-k of
    softmax(logits) gives each expert, fp32 [E] (counted in int64), the column sums of the softmax,
    fp32 [E]). One fused kernel on CUDA (the counts compare ids with each expert: no atomics, no host read)."""
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = top_k_ids(probs, top_k)  # [N, k]
    experts = torch.arange(logits.shape[1], device=logits.device)
    counts = (chosen.unsqueeze(-1) == experts).sum(dim=(0, 1)).float()
    return counts, probs.sum(dim=0)
