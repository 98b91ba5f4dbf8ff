"""Dense attention used by M3's full-attention layers and as the baseline for MSA.

`dense_attention(q, k, v, cu_seqlens, *, scale=None, cu_seqlens_k=None) -> o` runs causal softmax attention over a
packed varlen batch (`q [T, Hq, D]`, `k, v [Tk, Hkv, D]`, GQA); see `varlen.py`.
"""

from .varlen import check_cu_seqlens, dense_attention

__all__ = ["dense_attention", "check_cu_seqlens"]
