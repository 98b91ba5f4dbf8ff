"""Helpers that build tiny random transformers M3 models (the numeric reference) for parity tests.

Every helper is deterministic in its `seed`. The models run on CPU in fp32 with eager attention. Weights are
perturbed away from transformers' init (non-zero norms, router correction bias, larger MLP weights so the SwiGLU
clamp is active) so that parity covers every term of the forward pass.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, MiniMaxM3VLForCausalLM,
                          MiniMaxM3VLTextConfig)

TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def tiny_text_config(**overrides) -> dict:
    """Keyword arguments of a tiny `MiniMaxM3VLTextConfig` (4 layers mixing dense/MSA attention, dense MLP/MoE).

    RoPE is partial (8 of 16 head channels), stated through `partial_rotary_factor` because transformers 5.24.0
    does not read `rotary_dim`.
    """
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rotary_dim=8, dense_intermediate_size=40,
               shared_intermediate_size=20, num_local_experts=6, num_experts_per_tok=2, index_n_heads=2,
               index_head_dim=8, index_block_size=16, index_topk_blocks=3, index_local_blocks=1,
               layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
               mlp_layer_types=["dense", "sparse", "dense", "sparse"], rms_norm_eps=1e-6, initializer_range=0.1,
               bos_token_id=None, eos_token_id=None)
    cfg.update(overrides)
    head_dim = cfg["head_dim"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta", 10000.0),
                              "partial_rotary_factor": cfg["rotary_dim"] / head_dim}
    return cfg


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Move a freshly initialised HF M3 model off its special init values, in place and deterministically."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        elif "gate_up_proj" in name:
            p.mul_(6.0)  # pre-activations beyond +-7 exercise the SwiGLU-OAI clamp
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)


def build_hf_causal_lm(seed: int = 0, **overrides) -> MiniMaxM3VLForCausalLM:
    """A tiny random `MiniMaxM3VLForCausalLM` (eager attention, fp32, eval mode)."""
    torch.manual_seed(seed)
    config = MiniMaxM3VLTextConfig(**tiny_text_config(**overrides))
    config._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(config).eval()
    perturb_(model, seed + 1)
    return model


def build_hf_vl_from_text(text_model: MiniMaxM3VLForCausalLM, seed: int = 0
                          ) -> MiniMaxM3SparseForConditionalGeneration:
    """The VL model (tiny vision tower) whose language model and lm_head are `text_model`'s weights.

    Its `save_pretrained` writes the published MiniMax layout (transformers reverts the `minimax_m3_vl` entry of
    `conversion_mapping.py` when saving).
    """
    torch.manual_seed(seed)
    text_cfg = text_model.config.to_dict()
    config = MiniMaxM3VLConfig(text_config=text_cfg, vision_config=dict(TINY_VISION),
                               projector_hidden_size=text_model.config.hidden_size)
    config.text_config._attn_implementation = "eager"
    vl = MiniMaxM3SparseForConditionalGeneration(config).eval()
    with torch.no_grad():
        vl.model.language_model.load_state_dict(text_model.model.state_dict())
        vl.lm_head.weight.copy_(text_model.lm_head.weight)
    return vl


def save_hf(model: torch.nn.Module, path: Path, max_shard_size: str | int = "200KB") -> Path:
    """`save_pretrained` into `path` with small shards (so loading crosses shard boundaries)."""
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return Path(path)


def hf_selections(model: torch.nn.Module) -> tuple[dict[int, torch.Tensor], list]:
    """Capture every MSA layer's indexer output during forward passes.

    Returns (captured, handles): `captured[layer_idx]` is the last block selection [B, Hi, S, k] (int64, -1 for
    unused slots) of that layer; remove the hooks with `for h in handles: h.remove()`.
    """
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for module in model.modules():
        if type(module).__name__ == "MiniMaxM3VLIndexer":
            def hook(mod, args, output, idx=module.layer_idx):
                captured[idx] = output.detach().clone()
            handles.append(module.register_forward_hook(hook))
    return captured, handles


def random_ids(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    """One random token sequence [L] per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [T], cu_seqlens int32 [B+1]) of a list of sequences."""
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return torch.cat(seqs), torch.cumsum(lengths, 0).to(torch.int32)


def selection_sets(block_idx: torch.Tensor) -> list[list[list[int]]]:
    """[Hi, S, k] block indices -> per head, per query, the sorted valid blocks (order of slots ignored)."""
    return [[sorted(b for b in row if b >= 0) for row in head] for head in block_idx.tolist()]
