import os

import pytest
import torch

# Without a GPU every Triton kernel runs under the interpreter on CPU tensors. This must be set before the first
# import of a kernel module, and pytest imports every test module (tests/gpu/ first) while collecting, so it is
# set here, once, for the whole run. The sm_90 compile tests start subprocesses without it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, restored after them: tiny models run fastest on one thread (and do
    not oversubscribe a shared CPU). A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
