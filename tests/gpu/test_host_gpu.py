"""`openm3.ops.host.host_list` on a CUDA tensor: read once per (tensor, version), invalidated by writes and frees."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_host_list_caches_per_tensor_version():
    from openm3.ops import host

    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    assert host.host_list(cu) == [0, 5, 9]
    assert id(cu) in host._CACHE
    assert host.host_list(cu) == [0, 5, 9]  # served from the cache
    cu[1] = 6  # an in-place write bumps the version counter: read again
    assert host.host_list(cu) == [0, 6, 9]
    other = cu.clone()
    other[2] = 11
    assert host.host_list(other) == [0, 6, 11] and host.host_list(cu) == [0, 6, 9]
    key = id(other)
    del other  # freed: its entry goes with it
    assert key not in host._CACHE
    with torch.inference_mode():
        inf = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
        assert host.host_list(inf) == [0, 2]  # no version counter: read directly, not cached
    assert id(inf) not in host._CACHE


def test_batch_to_cuda_does_not_wait_for_queued_work():
    """`Batch.to` copies through pinned memory without a host sync (a pageable copy waits for the stream's queued
    work: the previous micro-batch's backward), the values arrive intact, and the model's host read of
    cu_seqlens is served from the values the copy handed over."""
    from openm3.ops.host import host_list
    from openm3.train.batches import Batch

    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, 100, (300,), generator=gen), torch.randint(0, 100, (300,), generator=gen),
                  torch.arange(300), torch.tensor([0, 120, 300], dtype=torch.int32),
                  {"pixel_values": torch.randn(16, 8, generator=gen)}, ["text", "text"], [120, 180])
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # queue work the copies must not wait for
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = batch.to(torch.device("cuda"))
        assert host_list(moved.cu_seqlens) == [0, 120, 300]  # handed over by the copy: no device read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        assert torch.equal(getattr(moved, name).cpu(), getattr(batch, name)), name
    assert torch.equal(moved.vision["pixel_values"].cpu(), batch.vision["pixel_values"])
    assert moved.kinds == batch.kinds and moved.row_lens == batch.row_lens


def test_remember_host_list_serves_the_values_until_a_write():
    from openm3.ops import host

    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    host.remember_host_list(cu, [0, 5, 9])
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert host.host_list(cu) == [0, 5, 9]  # no device read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cu[1] = 6  # a write invalidates the handed-over copy
    assert host.host_list(cu) == [0, 6, 9]
    with pytest.raises(ValueError, match="values: expected the 3"):
        host.remember_host_list(cu, [0, 6])
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]], device="cuda")
    host.remember_host_list(grid, [[1, 4, 6], [2, 2, 2]])  # nested, as tolist() gives it
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert host.host_list(grid) == [[1, 4, 6], [2, 2, 2]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="values: expected the 6"):
        host.remember_host_list(grid, [1, 4, 6, 2, 2, 2])  # flat: not what tolist() gives


def test_vl_embed_reads_nothing_back_when_the_caller_checked():
    """The VL model's embedding of a batch `Batch.to` copied (grids' host values handed over) inside
    `input_ids_checked_by_caller`: no device sync (grid reads, placeholder counts, position and cu_seqlens
    copies), same result as without; nor in its backward (the features' gradient is a gather)."""
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    from openm3.models.text import input_ids_checked_by_caller
    from openm3.train.batches import Batch

    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=7, video_token_index=8)
    model = M3ForConditionalGeneration(config).cuda()
    grid = torch.tensor([[1, 4, 6]])
    n_img = 1 * 4 * 6 // 4
    ids = torch.cat([torch.full((3,), 5), torch.full((n_img,), config.image_token_index), torch.full((5,), 6)])
    pixels = torch.randn(24, 3 * 2 * 14 * 14)
    batch = Batch(ids, ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()], dtype=torch.int32),
                  {"pixel_values": pixels, "image_grid_thw": grid}, ["image"], [ids.numel()])
    with torch.no_grad():
        want = model.embed(ids.cuda(), pixels.cuda(), grid.cuda())
        moved = batch.to(torch.device("cuda"))
        torch.cuda.synchronize()
        with input_ids_checked_by_caller(model):
            model.check_visual_placeholders(batch.input_ids, image_grid_thw=grid)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = model.embed(moved.input_ids, moved.vision["pixel_values"], moved.vision["image_grid_thw"])
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    # ... and its backward into the vision tower reads nothing back either
    model.zero_grad()
    with input_ids_checked_by_caller(model):
        out = model.embed(moved.input_ids, moved.vision["pixel_values"], moved.vision["image_grid_thw"])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out.square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert model.multi_modal_projector.linear_1.weight.grad.abs().sum() > 0
