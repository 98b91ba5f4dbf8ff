"""`openm3.ops.paged_write`: a step's keys, values and index keys written into a paged cache by one Triton kernel,
bit for bit what the torch ops (its spec) write, under TRITON_INTERPRET=1 on CPU tensors (conftest sets it without
a GPU); the engine cache uses it; the kernel compiles for sm_90."""

from __future__ import annotations

import pytest
import torch

from hopper_compile import run_compile_script
from openm3.ops.msa import decode, use_backend
from openm3.ops.paged_write import write_paged

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests (tests/gpu on a GPU)")


def _pools(pages, page, hkv, d, di, kv_dtype, index_dtype):
    k = torch.randn(pages, page, hkv, d).to(kv_dtype)  # old contents: what the write must leave alone
    v = torch.randn(pages, page, hkv, d).to(kv_dtype)
    ki = None if index_dtype is None else torch.randn(pages, page, di).to(index_dtype)
    scale = torch.randint(0, 255, (pages, page), dtype=torch.uint8) if index_dtype == decode.FP8_DTYPE else None
    return k, v, ki, scale


def _write_both(slots, k, v, ki, pools):
    """(kernel's pools, torch ops' pools) after writing the same rows into copies of `pools`."""
    out = []
    for backend in ("triton", "reference"):
        copies = [None if p is None else p.clone() for p in pools]
        with use_backend(backend):
            write_paged(slots, k, v, copies[0], copies[1], ki, copies[2], copies[3])
        out.append(copies)
    return out


def _assert_same(got, want):
    for g, w in zip(got, want):
        if g is not None:
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype, in_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("index_dtype", [decode.FP8_DTYPE, "kv", None])
def test_kernel_writes_what_the_torch_ops_write(kv_dtype, in_dtype, index_dtype):
    """Scattered slots across pages, 1 and 37 tokens, a dtype cast on the way in, a non-power-of-2 head dim, keys
    as a strided view (the fused projection's output); index keys in the KV dtype, fp8 + e8m0 or none (dense)."""
    torch.manual_seed(0)
    idt = kv_dtype if index_dtype == "kv" else index_dtype
    pools = _pools(6, 16, 2, 24, 40, kv_dtype, idt)
    for n in (1, 37):
        slots = torch.randperm(6 * 16)[:n]
        fused = torch.randn(n, 2 * 24 * 2 + 40 + 8).to(in_dtype) * 3
        k = fused[:, :48].view(n, 2, 24)
        v = fused[:, 48:96].view(n, 2, 24)
        ki = None if idt is None else fused[:, 96:136]
        got, want = _write_both(slots, k, v, ki, pools)
        _assert_same(got, want)
        assert not torch.equal(got[0], pools[0])  # something was written


def test_fp8_quantizer_over_magnitudes_and_exact_powers():
    """Rows whose largest entry spans 1e-35..1e35, an exact power of two times 448 (the e8m0 edge), zeros and
    entries that round to fp8's subnormals: the kernel's bytes and exponents equal quantize_index_keys'."""
    torch.manual_seed(1)
    mags = [1e-35, 1e-20, 3e-8, 0.5, 1.0, 7.3, 448.0, 896.0, 2.0 ** 20 * 448, 1e20, 1e35]
    rows = [torch.randn(64) * m for m in mags]
    rows += [torch.zeros(64), torch.full((64,), 448.0 * 2 ** -3), torch.tensor([1.0] + [1e-5] * 63)]
    ki = torch.stack(rows)
    n = ki.shape[0]
    pools = _pools(2, 16, 1, 8, 64, torch.float32, decode.FP8_DTYPE)
    slots = torch.randperm(32)[:n]
    got, want = _write_both(slots, torch.randn(n, 1, 8), torch.randn(n, 1, 8), ki, pools)
    _assert_same(got, want)
    q8, scale = decode.quantize_index_keys(ki)
    assert torch.equal(got[3].view(-1)[slots], scale)
    assert torch.equal(got[2].view(-1, 64)[slots].view(torch.uint8), q8.view(torch.uint8))


def test_engine_cache_writes_through_it(monkeypatch):
    """A paged cache step (MSA layer, fp8 index keys) goes through write_paged, once per layer."""
    from openm3.engine import cache as cache_mod

    calls = []
    real = cache_mod.write_paged
    monkeypatch.setattr(cache_mod, "write_paged", lambda *a, **kw: calls.append(a[0].numel()) or real(*a, **kw))
    layout = cache_mod.CacheLayout(sparse=(False, True), num_kv_heads=2, head_dim=16, index_head_dim=8,
                                   page_size=16)
    cache = cache_mod.PagedCache(cache_mod.plan_cache(layout, 64, kv_dtype=torch.float32, index_dtype="fp8"))
    cache.admit({0: 5})
    q, kv, qi, ki = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 8), torch.randn(5, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with cache.step([0], [5]):
        cache.attend(0, q, kv, kv, None, None, cu_seqlens=cu, scale=0.25)
        cache.attend(1, q, kv, kv, qi, ki, cu_seqlens=cu, scale=0.25, block_size=16, topk=2, local_blocks=1)
    assert calls == [5, 5]


def test_bad_arguments_fail_with_the_argument_named():
    k = torch.zeros(3, 2, 8)
    pool = torch.zeros(4, 16, 2, 8)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="slots must be int64"):
        write_paged(slots.int(), k, k, pool, pool)
    with pytest.raises(ValueError, match=r"v must have one row per slot \(3\)"):
        write_paged(slots, k, k[:2], pool, pool)
    with pytest.raises(ValueError, match=r"k_pool must be contiguous \[\.\.\., 2, 8\]"):
        write_paged(slots, k, k, torch.zeros(4, 16, 8, 2), pool)
    with pytest.raises(ValueError, match="ki and ki_pool must be given together"):
        write_paged(slots, k, k, pool, pool, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="an fp8 ki_pool needs ki_scale"):
        write_paged(slots, k, k, pool, pool, torch.zeros(3, 8), torch.zeros(4, 16, 8).to(decode.FP8_DTYPE))


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openm3.ops import _paged_write_kernels as k

fn = k._write_kernel
names = list(fn.arg_names)
for kv, ki, fp8 in (("bf16", "fp8e4nv", 1), ("bf16", "bf16", 0), ("fp32", "fp32", 0)):
    sig = {"slot_ptr": "*i64", "k_ptr": "*" + kv, "v_ptr": "*" + kv, "ki_ptr": "*" + kv, "kp_ptr": "*" + kv,
           "vp_ptr": "*" + kv, "kip_ptr": "*" + ki, "scale_ptr": "*u8",
           **{n: "i32" for n in ("n_tokens", "stride_k", "stride_v", "stride_ki", "kv_width", "ki_width")}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    c = triton.compile(ASTSource(fn, sig, dict(BLOCK_KV=512, BLOCK_I=128, INDEX=1, FP8=fp8), attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 3})
    assert "cubin" in c.asm
print("compiled")
"""


def test_the_kernel_compiles_for_hopper(tmp_path):
    run_compile_script(_COMPILE_SCRIPT, tmp_path)
