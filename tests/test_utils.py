"""The shared helpers every op builds on: dispatch, jit helpers, autotune wrapper, checks."""

from __future__ import annotations

import pytest
import torch

from fusetune import _triton, _utils
from fusetune._triton import INTERPRET, tl, triton
from harness import DEVICE, ON_GPU, assert_raises


@triton.jit
def _dot_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
):
    rows, cols, inner = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * N + cols[None, :])
    acc = _triton.dot(a, b, tl.zeros([M, N], dtype=tl.float32), UPCAST_BF16)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_dot_helper_is_exact_in_every_dtype(dtype):
    """bf16 tl.dot is garbage under Triton's interpreter: the helper must route around it."""
    a = torch.randn(16, 32, device=DEVICE).to(dtype)
    b = torch.randn(32, 16, device=DEVICE).to(dtype)
    out = torch.empty(16, 16, device=DEVICE)
    _dot_kernel[(1,)](a, b, out, M=16, N=16, K=32, UPCAST_BF16=INTERPRET)
    expected = a.double() @ b.double()
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < (1e-2 if dtype == torch.float32 and ON_GPU else 1e-3)  # GPU fp32 dot is tf32


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, _triton.tanh(x), mask=offsets < n)


def test_tanh_helper_matches_torch_including_large_inputs():
    x = torch.cat([torch.randn(500) * 3, torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4])]).to(DEVICE)
    out = torch.empty_like(x)
    _tanh_kernel[(1,)](x, out, x.numel(), BLOCK=512)
    assert torch.isfinite(out).all()
    assert (out.double() - torch.tanh(x.double())).abs().max().item() < 1e-6


@triton.jit
def _fill_kernel(out_ptr, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.full([BLOCK], VALUE, tl.float32))


def test_autotune_wrapper_runs_a_config():
    """Under the interpreter autotuning cannot benchmark: the wrapper runs the first config."""
    configs = [triton.Config({"VALUE": 3.0}, num_warps=4), triton.Config({"VALUE": 3.0})]
    tuned = _utils.autotune(configs, key=["BLOCK"])(_fill_kernel)
    out = torch.zeros(64, device=DEVICE)
    tuned[(1,)](out, BLOCK=64)
    assert torch.equal(out.cpu(), torch.full((64,), 3.0))


def test_backend_dispatch():
    expected = "triton" if ON_GPU else "interpreter"
    assert _utils.backend(torch.empty(0, device=DEVICE)) == expected
    assert _utils.backend(torch.empty(0, device=DEVICE, dtype=torch.float64)) == "reference"
    if not ON_GPU:
        assert INTERPRET, "the CPU test run must execute the kernels through the interpreter"


def test_backend_without_interpreter_is_reference(monkeypatch):
    monkeypatch.setattr(_utils, "INTERPRET", False)
    assert _utils.backend(torch.empty(0)) == "reference"


def test_poisoned_allocation():
    with _utils.poison_outputs():
        assert _utils.empty((3,), torch.float32, DEVICE).isnan().all()
        assert (_utils.empty((3,), torch.int64, DEVICE) == -1).all()


def test_scalar_tensor_keeps_values_on_device():
    assert _utils.scalar_tensor(7, DEVICE).item() == 7.0
    value = _utils.scalar_tensor(torch.tensor([5], device=DEVICE), DEVICE)
    assert value.shape == () and value.dtype == torch.float32 and value.item() == 5.0


def test_number_checks_name_the_argument():
    assert_raises(
        ValueError,
        "eps must be in [0.0, 1.0]|got 2.0",
        _utils.check_number,
        "eps",
        2.0,
        low=0.0,
        high=1.0,
    )
    assert_raises(
        ValueError,
        "scale must be in (0.0, inf]",
        _utils.check_number,
        "scale",
        0.0,
        low=0.0,
        low_inclusive=False,
    )
    assert_raises(
        TypeError,
        "scale must be a finite Python number",
        _utils.check_number,
        "scale",
        float("nan"),
    )
    assert_raises(
        TypeError, "flag must be a finite Python number", _utils.check_number, "flag", True
    )
    _utils.check_number("maybe", None, optional=True)
    assert_raises(
        ValueError, "mode must be one of 'a', 'b'", _utils.check_choice, "mode", "c", ("a", "b")
    )
