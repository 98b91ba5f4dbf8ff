import os

import pytest
import torch

# Without a GPU every Triton kernel runs under the interpreter on CPU tensors. This must be set before the first
# import of a kernel module, and pytest imports every test module (tests/gpu/ first) while collecting, so it is
# set here, once, for the whole run. The sm_90 compile tests start subprocesses without it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
