"""Counting calls of the functions a test patches (shared by CPU and GPU tests; not a test module)."""

from __future__ import annotations


def count_calls(monkeypatch, **targets) -> dict[str, int]:
    """`name=[(owner, attribute), ...]`: each attribute is replaced by a wrapper that counts its calls under
    `name`; returns the counts (reset them by assigning into the dict)."""
    calls = dict.fromkeys(targets, 0)
    for name, pairs in targets.items():
        for owner, attribute in pairs:
            def counted(*args, _run=getattr(owner, attribute), _name=name, **kwargs):
                calls[_name] += 1
                return _run(*args, **kwargs)

            monkeypatch.setattr(owner, attribute, counted)
    return calls


def attention_entry_points():
    """The functions a layer's attention goes through: the MSA ops and the dense varlen attention."""
    from openm3.layers import attention
    from openm3.ops import msa

    return [(msa, "sparse_attention"), (msa, "sparse_attention_with_kl"), (attention, "dense_attention")]
