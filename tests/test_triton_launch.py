"""fusetune's cached Triton launch (``fusetune._triton.jit``): its key is at least as fine as
Triton's own specialisation, and launches that hit the cache run the right kernel on the right
arguments (alignment, ints equal to 1 or divisible by 16, dtypes, constexprs, keywords)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusetune import _triton, _utils
from fusetune._triton import jit, tl
from harness import DEVICE


def test_argument_key_is_at_least_as_fine_as_tritons_specialisation():
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    base = torch.arange(64, dtype=torch.float32)
    values = [1, 0, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**31 + 1, -(2**31),
              -(2**31) - 16, 2**63 - 16, 2**63, 2**64 - 16, 0.0, 1.0, 2.5, True, False, None,
              base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
              base.to(torch.int64), base.double()[2:]]  # fmt: skip
    triton_key = {}
    for value in values:
        spec = libtriton.native_specialize_impl(BaseBackend, value, False, True, True)
        triton_key.setdefault(_triton._argument_key(value), set()).add(spec)
    assert len(triton_key) >= 14  # (the values above are keyed apart, not lumped)
    for key, specs in triton_key.items():
        assert len(specs) == 1, f"{key} stands for {specs}"


@jit
def _scale_kernel(x_ptr, y_ptr, n, alpha, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (x * alpha + SHIFT).to(y_ptr.dtype.element_ty), mask=mask)


def test_cached_launches_run_the_kernel_of_their_arguments():
    source = torch.randn(300, device=DEVICE)
    calls = []
    for offset, n, dtype, shift, keyword in itertools.product(
        (0, 1), (1, 16, 17, 200), (torch.float32, torch.bfloat16), (0, 3), (False, True)
    ):
        x = source.to(dtype)[offset:]
        y = torch.full_like(x, float("nan"))
        grid = (_utils.cdiv(n, 64),)
        for alpha in (0.5, 2.0):  # (the second launch of a key hits the cache)
            if keyword:
                _scale_kernel[grid](x, y, n=n, alpha=alpha, SHIFT=shift, BLOCK=64)
            else:
                _scale_kernel[grid](x, y, n, alpha, shift, 64)
            expected = x[:n].float() * alpha + shift
            # (one bf16 rounding: Triton's interpreter truncates where the GPU rounds)
            rtol = 2**-7 if dtype == torch.bfloat16 else 0.0
            torch.testing.assert_close(y[:n].float(), expected, rtol=rtol, atol=0)
            assert y[n:].isnan().all()
            calls.append((offset, n, dtype, shift, keyword))
    if isinstance(_scale_kernel, getattr(_triton, "_Kernel", ())):
        # one cached kernel per key: misalignment, n == 1, n % 16 == 0 and the i32 width,
        # dtype, the constexpr and the keyword spelling each tell keys apart
        assert len(_scale_kernel._launches) == len(set(calls))
