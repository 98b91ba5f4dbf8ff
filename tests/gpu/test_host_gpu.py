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
