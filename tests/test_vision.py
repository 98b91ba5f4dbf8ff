"""Vision tower: parity with transformers' MiniMaxM3VLVisionModel (+ projector), clip attention pattern, costs."""

import pytest
import torch
import torch.nn.functional as F

from openm3.layers.vision import VisionProjector, apply_axial_rope, axial_rope_cos_sin
from openm3.models.vision import (DEFAULT_FRAMES_PER_CLIP, M3VisionConfig, M3VisionModel, attention_mask,
                                  attention_plan, format_plan, segment_ids, split_clips, vision_position_ids)

PATCH_DIM = 3 * 2 * 14 * 14
TINY = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)  # head_dim 12


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights far from the init (norm scales around 1, biases non-zero) so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.1 * noise)


@pytest.fixture(scope="module")
def tiny_tower():
    torch.manual_seed(0)
    model = M3VisionModel(M3VisionConfig(**TINY)).eval()
    _randomize(model, 1)
    return model


# ------------------------------------------------------------------------------------------ parity with HF
@pytest.mark.parametrize("grid", [[[1, 4, 6]], [[4, 4, 4]], [[1, 2, 2], [4, 2, 4], [2, 2, 4]]],
                         ids=["image-T1-H4-W6", "video8f-T4-H4-W4", "image+2clips"])
def test_tower_and_projector_match_transformers(grid):
    hf_cfg = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")
    hf_mod = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    vcfg = hf_cfg.MiniMaxM3VLVisionConfig(**TINY, rope_parameters={"rope_type": "axial", "rope_theta": 500.0})
    tcfg = hf_cfg.MiniMaxM3VLTextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=16, vocab_size=64)
    full_cfg = hf_cfg.MiniMaxM3VLConfig(vision_config=vcfg.to_dict(), text_config=tcfg.to_dict(),
                                        projector_hidden_size=40)
    torch.manual_seed(0)
    hf_tower = hf_mod.MiniMaxM3VLVisionModel(full_cfg.vision_config).eval()
    hf_proj = hf_mod.MiniMaxM3VLMultiModalProjector(full_cfg).eval()
    _randomize(hf_tower, 2)
    _randomize(hf_proj, 3)

    config = M3VisionConfig.from_dict(vcfg.to_dict())
    assert config.rope_theta == 500.0 and config.hidden_size == 48
    tower = M3VisionModel(config).eval()
    tower.load_state_dict(hf_tower.state_dict(), strict=True)
    proj = VisionProjector(48, 40, 32, config.spatial_merge_size)
    proj.load_state_dict(hf_proj.state_dict(), strict=True)

    grid_thw = torch.tensor(grid)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf_tower(pixels, grid_thw).last_hidden_state.squeeze(0)
        out = tower(pixels, grid_thw)
        ref_tokens, out_tokens = hf_proj(ref), proj(out)
    assert ref.std() > 0.5
    assert (out - ref).abs().max().item() < 1e-4
    assert out_tokens.shape == (pixels.shape[0] // 4, 32)
    assert (out_tokens - ref_tokens).abs().max().item() < 1e-4


def test_config_from_hf_dict_roundtrip_and_errors():
    hf_cfg = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")
    d = hf_cfg.MiniMaxM3VLVisionConfig().to_dict()
    config = M3VisionConfig.from_dict(d)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.rope_theta) == (1280, 32, 80, 1e4)
    again = hf_cfg.MiniMaxM3VLVisionConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    assert again.to_dict()["rope_parameters"] == d["rope_parameters"]
    assert M3VisionConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="rope_type"):
        M3VisionConfig.from_dict({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="num_attention_heads"):
        M3VisionConfig(hidden_size=50, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_act"):
        M3VisionModel(M3VisionConfig(**{**TINY, "hidden_act": "swish2"}))


# ------------------------------------------------------------------------------------------ clips and pattern
def test_split_clips_matches_hf_chunking_rule():
    grid = torch.tensor([[1, 4, 6], [9, 2, 2], [4, 2, 2]])
    clips, counts = split_clips(grid, DEFAULT_FRAMES_PER_CLIP)
    assert DEFAULT_FRAMES_PER_CLIP == 4
    assert clips.tolist() == [[1, 4, 6], [4, 2, 2], [4, 2, 2], [1, 2, 2], [4, 2, 2]]
    assert counts == [1, 3, 1]
    whole, counts = split_clips(grid, None)
    assert whole.tolist() == grid.tolist() and counts == [1, 1, 1]
    with pytest.raises(ValueError, match="frames_per_clip"):
        split_clips(grid, 0)
    with pytest.raises(ValueError, match="grid_thw"):
        split_clips(torch.tensor([[1.0, 2.0, 2.0]]), 4)


@pytest.mark.parametrize("frames_per_clip", [1, 2, 4, 8], ids=lambda k: f"clip{k}-T8-H2-W4")
def test_attention_pattern_is_block_diagonal_over_clips(frames_per_clip):
    t, h, w = 8, 2, 4
    plan = attention_plan(torch.tensor([[1, 2, 2], [t, h, w]]), frames_per_clip, hidden_size=48)
    mask = attention_mask(plan)
    frame = torch.cat([torch.full((4,), -1), torch.arange(t).repeat_interleave(h * w)])  # image = frame -1
    clip = torch.where(frame < 0, -1, frame // frames_per_clip)
    assert torch.equal(mask, clip[:, None] == clip[None, :])
    n_clips = t // frames_per_clip
    assert len(plan) == 1 + n_clips
    size = frames_per_clip * h * w
    assert [c.patches for c in plan] == [4] + [size] * n_clips
    assert [c.pairs for c in plan] == [16] + [size * size] * n_clips
    assert [c.flops for c in plan] == [4 * 16 * 48] + [4 * size * size * 48] * n_clips
    assert [c.first_frame for c in plan[1:]] == list(range(0, t, frames_per_clip))
    assert torch.equal(segment_ids(plan), torch.unique_consecutive(segment_ids(plan), return_inverse=True)[1])
    table = format_plan(plan)
    assert f"total {1 + n_clips} segments, {4 + t * h * w} patches" in table
    assert len(table.splitlines()) == 2 + len(plan)


def _masked_reference(tower: M3VisionModel, pixels, grid_thw, mask):
    """The tower written as one dense attention over all patches with an explicit mask and positions
    counted over the whole video: what frames_per_clip must reduce to."""
    cos, sin = axial_rope_cos_sin(vision_position_ids(grid_thw, 2), tower.inv_freq)
    x = tower.pre_layrnorm(tower.embeddings(pixels))
    for layer in tower.layers:
        a = layer.self_attn
        y = layer.layer_norm1(x)
        q, k, v = (proj(y).view(len(y), a.num_heads, a.head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_axial_rope(q, cos, sin), apply_axial_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + a.out_proj(o.transpose(0, 1).reshape(len(y), -1))
        x = x + layer.mlp(layer.layer_norm2(x))
    return x


@pytest.mark.parametrize("frames_per_clip", [1, 2, 4, 8], ids=lambda k: f"clip{k}-T8-H2-W2")
def test_frames_per_clip_changes_only_who_attends_to_whom(tiny_tower, frames_per_clip):
    grid = torch.tensor([[8, 2, 2]])
    g = torch.Generator().manual_seed(5)
    pixels = torch.randn(32, PATCH_DIM, generator=g)
    with torch.no_grad():
        out = tiny_tower(pixels, grid, frames_per_clip=frames_per_clip)
        mask = attention_mask(attention_plan(grid, frames_per_clip))
        # Same weights, same (global) positions, only the mask from the reported pattern differs.
        ref = _masked_reference(tiny_tower, pixels, grid, mask)
        assert (out - ref).abs().max().item() < 1e-5
        # Black-box check of the pattern: perturbing the first temporal patch moves exactly its clip.
        bumped = pixels.clone()
        bumped[:4] += torch.randn(4, PATCH_DIM, generator=g)
        moved = (tiny_tower(bumped, grid, frames_per_clip=frames_per_clip) - out).abs().amax(-1) > 1e-6
    assert torch.equal(moved, mask[0])
    assert int(moved.sum()) == 4 * frames_per_clip


def test_whole_video_is_one_segment_and_rows_are_independent(tiny_tower):
    grid = torch.tensor([[1, 2, 2], [8, 2, 2]])
    pixels = torch.randn(36, PATCH_DIM, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        both = tiny_tower(pixels, grid, frames_per_clip=None)
        image_alone = tiny_tower(pixels[:4], grid[:1])
        video_alone = tiny_tower(pixels[4:], grid[1:])
        clipped = tiny_tower(pixels, grid)  # rows as given: the 8-frame row is one segment
    torch.testing.assert_close(both, torch.cat([image_alone, video_alone]), atol=1e-5, rtol=0)
    torch.testing.assert_close(clipped, both, atol=0, rtol=0)
    assert [c.patches for c in attention_plan(grid, None)] == [4, 32]


def test_position_ids_are_block_major():
    pos = vision_position_ids(torch.tensor([[2, 2, 4]]), 2)
    assert pos.shape == (16, 3)
    assert pos[:8].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1],
                                [0, 0, 2], [0, 0, 3], [0, 1, 2], [0, 1, 3]]
    assert pos[8:, 0].tolist() == [1] * 8 and pos[8:, 1:].tolist() == pos[:8, 1:].tolist()


def test_gradient_checkpointing_gives_the_same_gradients(tiny_tower):
    grid = torch.tensor([[2, 2, 2]])
    pixels = torch.randn(8, PATCH_DIM, generator=torch.Generator().manual_seed(8))
    grads = []
    for flag in (False, True):
        tiny_tower.zero_grad()
        tiny_tower.train()
        tiny_tower.gradient_checkpointing = flag
        tiny_tower(pixels, grid).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_tower.parameters()]))
    tiny_tower.gradient_checkpointing = False
    tiny_tower.eval().zero_grad()
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_bad_inputs_fail_fast(tiny_tower):
    grid = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match="pixel_values"):
        tiny_tower(torch.randn(4, PATCH_DIM - 1), grid)
    with pytest.raises(ValueError, match="pixel_values"):
        tiny_tower(torch.randn(8, PATCH_DIM), grid)
    with pytest.raises(ValueError, match="grid_thw"):
        tiny_tower(torch.randn(3, PATCH_DIM), torch.tensor([[1, 1, 3]]))
    with pytest.raises(ValueError, match="features"):
        VisionProjector(48, 40, 32, 2)(torch.randn(6, 48))


@pytest.mark.gpu
def test_tower_on_cuda_bf16_matches_cpu_fp32(tiny_tower):
    grid = torch.tensor([[1, 4, 6], [4, 4, 4], [4, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = tiny_tower(pixels, grid)
        gpu = M3VisionModel(tiny_tower.config).to("cuda", torch.bfloat16).eval()
        gpu.load_state_dict(tiny_tower.state_dict())
        out = gpu(pixels.to("cuda", torch.bfloat16), grid.cuda()).float().cpu()
        # bf16 error bound: the same computation in bf16 on CPU
        cpu_bf16 = M3VisionModel(tiny_tower.config).to(torch.bfloat16).eval()
        cpu_bf16.load_state_dict(tiny_tower.state_dict())
        bound = (cpu_bf16(pixels.bfloat16(), grid).float() - ref).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * bound + 1e-3


def test_checkpointed_blocks_keeping_the_attention_run_it_once(tiny_tower, monkeypatch):
    """A vision block checkpointed with `reuse_contexts(keep_attention=True)` (the trainer's
    `ac_keep_attention`): its segment attention runs in the forward only, with the unchecked block's gradients."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from openm3.layers import recompute
    from openm3.layers.vision import VisionAttention

    calls = []
    segments = VisionAttention._segments
    monkeypatch.setattr(VisionAttention, "_segments", lambda self, *a: calls.append(1) or segments(self, *a))
    from openm3.layers.vision import axial_rope_cos_sin

    block = tiny_tower.layers[0].train()
    n, hidden = 8, block.self_attn.q_proj.in_features
    x0 = torch.randn(n, hidden, generator=torch.Generator().manual_seed(2))
    positions = torch.stack([torch.arange(n) // 4, torch.arange(n) % 4 // 2, torch.arange(n) % 2], dim=1)
    cos, sin = axial_rope_cos_sin(positions, tiny_tower.inv_freq)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # two segments of unequal length
    runs = []
    for context_fn in (None, functools.partial(recompute.reuse_contexts, keep_attention=True),
                       recompute.reuse_contexts):
        block.zero_grad(set_to_none=True)
        calls.clear()
        x = x0.clone().requires_grad_(True)
        out = block(x, cos, sin, cu) if context_fn is None else \
            checkpoint(block, x, cos, sin, cu, use_reentrant=False, context_fn=context_fn)
        out.square().mean().backward()
        runs.append((len(calls), x.grad.clone(), torch.cat([p.grad.flatten() for p in block.parameters()])))
    assert [r[0] for r in runs] == [1, 1, 2]
    # the tower's own switch: one segment attention per block with keep_attention, two without
    grid, pixels = torch.tensor([[2, 2, 2]]), torch.randn(8, PATCH_DIM, generator=torch.Generator().manual_seed(8))
    counts = []
    tiny_tower.train()
    for keep in (True, False):
        tiny_tower.gradient_checkpointing_enable(keep_attention=keep)
        calls.clear()
        tiny_tower(pixels, grid).square().mean().backward()
        counts.append(len(calls))
    tiny_tower.gradient_checkpointing_disable()
    tiny_tower.eval().zero_grad()
    assert counts == [len(tiny_tower.layers), 2 * len(tiny_tower.layers)]
    torch.testing.assert_close(runs[1][1], runs[0][1])
    torch.testing.assert_close(runs[1][2], runs[0][2])
    assert runs[0][2].abs().sum() > 0


def test_vl_model_checkpointing_switch_reaches_both_towers():
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig

    model = M3ForConditionalGeneration(M3VLConfig.from_name("m3-tiny", image_token_index=7, video_token_index=8))
    model.gradient_checkpointing_enable(keep_attention=True)
    towers = (model.language_model, model.vision_tower)
    assert all(t.gradient_checkpointing and t.checkpoint_keep_attention for t in towers)
    model.gradient_checkpointing_disable()
    assert not any(t.gradient_checkpointing or t.checkpoint_keep_attention for t in towers)
