"""The measurement kernels of `benchmarks/msa_floors.py` that time how fast the key cache's bytes can be read
(issue 4's floor): each must load every byte it is timed on, so each program's reported maximum must equal the
maximum over exactly the tiles it walks. Under TRITON_INTERPRET=1 on CPU; with a GPU, on CUDA tensors.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.msa_floors import (_descriptor, _stream_contig_kernel, _stream_kernel,  # noqa: E402
                                   _stream_ptr_kernel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES, PROGRAMS = 10, 3


def _bytes(rows: int) -> torch.Tensor:
    x = torch.randint(0, 200, (TILES * rows, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for t in range(TILES):  # a distinct maximum in every tile, at a different place in each
        x[t * rows + (7 * t) % rows, (13 * t) % 128] = 201 + t
    return x.to(DEVICE)


def _want(x: torch.Tensor, rows: int, tiles_of) -> list[int]:
    tile_max = x.view(TILES, rows * 128).amax(1).int().tolist()
    return [max(tile_max[t] for t in tiles_of(p)) for p in range(PROGRAMS)]


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("contig", [False, True], ids=["grid_stride", "contiguous"])
def test_tma_streams_read_every_tile_they_walk(rows, contig):
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90+")
    x = _bytes(rows)
    out = torch.zeros(PROGRAMS, dtype=torch.int32, device=DEVICE)
    kernel = _stream_contig_kernel if contig else _stream_kernel
    kernel[(PROGRAMS,)](_descriptor(x, [rows, 128]), out, TILES, ROWS=rows, COLS=128, STAGES=2)
    per = -(-TILES // PROGRAMS)
    tiles_of = (lambda p: range(p * per, min(p * per + per, TILES))) if contig else (
        lambda p: range(p, TILES, PROGRAMS))
    assert out.tolist() == _want(x, rows, tiles_of)


@pytest.mark.parametrize("evict_first", [False, True])
def test_pointer_stream_reads_every_tile_it_walks(evict_first):
    x = _bytes(64)
    words = x.view(torch.int32).view(-1)  # 64 x 32 int32 words per tile, as bandwidth_part launches it
    out = torch.zeros(PROGRAMS, dtype=torch.int32, device=DEVICE)
    _stream_ptr_kernel[(PROGRAMS,)](words, out, TILES, ROWS=64, WORDS=32, STAGES=2, EVICT_FIRST=evict_first)
    tile_max = words.view(TILES, -1).amax(1).tolist()
    assert out.tolist() == [max(tile_max[t] for t in range(p, TILES, PROGRAMS)) for p in range(PROGRAMS)]
