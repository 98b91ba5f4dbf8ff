import os

import pytest
import torch

# Without a GPU every Triton kernel runs under the interpreter on CPU tensors. This must be set before the first
# import of a kernel module, and pytest imports every test module (tests/gpu/ first) while collecting, so it is
# set here, once, for the whole run. The sm_90 compile tests start subprocesses without it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _module_setting(request, name: str):
    if not hasattr(request.module, name):
        pytest.fail(f"{request.module.__name__} uses the shared tiny-model fixtures (tests/conftest.py) but sets no "
                    f"{name}", pytrace=False)
    return getattr(request.module, name)


@pytest.fixture(scope="module")
def model(request):
    """The tiny random text model of a module that tests the public surface (tests/test_model_input_checks.py,
    tests/test_python_api.py): the m3-tiny preset with the module's `TINY` overrides, seed 0, in eval mode, built
    once per module. A module that defines its own `model` fixture gets that one instead."""
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    return M3TextModel(M3TextConfig.from_name("m3-tiny", **_module_setting(request, "TINY"))).eval()


@pytest.fixture(scope="module")
def vl(request):
    """The VL counterpart of `model`: m3-tiny with the module's `TINY` overrides and its `IMG` and `VID` as the
    image and video placeholder ids, seed 0, in eval mode."""
    from openm3.models import M3ForConditionalGeneration, M3VLConfig

    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=_module_setting(request, "IMG"),
                                  video_token_index=_module_setting(request, "VID"),
                                  **_module_setting(request, "TINY"))
    return M3ForConditionalGeneration(config).eval()


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
