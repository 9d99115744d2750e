"""Test-session setup: pick the device and make the CPU run the Triton kernels.

Without a GPU the suite sets FUSETUNE_INTERPRET=1 before fusetune (or triton) is imported, so
every kernel line executes through Triton's interpreter instead of the reference path.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("FUSETUNE_INTERPRET", "1")

import pytest  # noqa: E402

import fusetune  # noqa: E402
from fusetune import _utils  # noqa: E402
from harness import DEVICE  # noqa: E402


def pytest_report_header(config):
    probe = torch.empty(0, device=DEVICE)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    return f"fusetune device: {name}; backend: {fusetune.backend(probe)}"


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _poison_and_seed(request):
    """NaN-poison every buffer the ops allocate; seed from the test's name so that each test
    draws its own fresh inputs, reproducibly."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    with _utils.poison_outputs():
        yield
