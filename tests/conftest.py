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


def _share_cpu_threads() -> None:
    """Under pytest-xdist each worker takes the cores / workers share of torch's intra-op threads:
    with every worker at torch's default (all cores) the float64 references thrash (on a 16-core
    GPU host, 14 workers left Gated DeltaNet's T = 1000 references unfinished after 8 minutes;
    each takes 13 s on one core). The share goes to the processes a test starts too (the
    commands' subprocess runs, the distributed ranks) through OMP_NUM_THREADS: at torch's
    default of every core, `fusetune grpo` took 226 s beside the other worker on CI's 2 cores
    and 20 s alone (2026-11-28, twenty-second; two such runs side by side: 62 s at 2 threads
    each, 21 s at 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_cpu_threads()

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


GATED_DELTA_MODELING = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(autouse=True, scope="session")
def _unpatched_gated_delta_runs_transformers_torch_loop():
    """The unpatched Qwen3.5 / Qwen3-Next models the tests compare against run transformers'
    own torch loop for the delta rule, also where flash-linear-attention is installed: the GPU
    pass carries FLA as a bench peer, transformers then picks it, and FLA 0.6 refuses its
    backward on Hopper with Triton < 3.7.1 (every unpatched reference failed). Pinned at both
    of transformers' seams (see fusetune/integrations/gated_delta.py): the modeling module's
    ``torch_*_gated_delta_rule`` names (hub / FLA wrappers keep the torch function as
    ``__wrapped__``) and, in versions that bind the kernel per layer, the layer's attributes."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        yield
        return
    from fusetune.integrations.gated_delta import LAYER_CLASSES, SEAMS

    patch = pytest.MonkeyPatch()
    for family in GATED_DELTA_MODELING:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        torch_loops = {}
        for name, attribute, _ in SEAMS:
            function = getattr(module, name, None)
            if function is not None:
                torch_loops[attribute] = getattr(function, "__wrapped__", function)
                patch.setattr(module, name, torch_loops[attribute])
        for class_name in LAYER_CLASSES:
            layer_class = getattr(module, class_name, None)
            if layer_class is not None:
                patch.setattr(layer_class, "__init__", _pinned_init(layer_class, torch_loops))
    yield
    patch.undo()


def _pinned_init(layer_class, torch_loops):
    original = layer_class.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for attribute, function in torch_loops.items():
            if attribute in vars(self):
                setattr(self, attribute, function)

    return init
