"""Triton import point and the device-side helpers every kernel may share.

Importing Triton through here keeps ``import fusetune`` working where Triton is not installed
(macOS, Windows): kernels are then never launched and every op runs its reference.
"""

from __future__ import annotations

from fusetune._env import interpreting

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAS_TRITON = False

    class OutOfResources(Exception):  # type: ignore[no-redef]
        """Never raised: no kernel launches without Triton."""

    class _Missing:
        """Stands in for ``triton`` and ``triton.language`` so kernel definitions still parse."""

        constexpr = object

        def __getattr__(self, name: str) -> object:
            return self

        def __call__(self, *args: object, **kwargs: object) -> object:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # bare decorator (@triton.jit)
            return self

    triton = tl = _Missing()  # type: ignore[assignment]

INTERPRET = interpreting()

__all__ = ["HAS_TRITON", "INTERPRET", "OutOfResources", "dot", "tanh", "tl", "triton"]


@triton.jit
def tanh(x):
    """tanh in fp32 through exp (the interpreter lacks libdevice.tanh), exact to ~1e-7 absolute
    and saturating cleanly for large |x|. The divide is the fast one (2 ulp, not IEEE): it was
    the costliest instruction of the softcapped cross-entropy."""
    return 1.0 - tl.fdiv(2.0, 1.0 + tl.exp(2.0 * x), ieee_rounding=False)


@triton.jit
def dot(a, b, acc, UPCAST_BF16: tl.constexpr):
    """``acc + a @ b``. Pass ``UPCAST_BF16=INTERPRET``: Triton's interpreter returns garbage
    for bf16 ``tl.dot``, so there the operands go through fp32; compiled kernels keep bf16
    tensor cores. fp32 operands run as tf32 on the GPU (tl.dot's default): where fp32 inputs must
    stay exact, call ``tl.dot(a, b, input_precision="ieee")`` instead (as the GSA kernels do)."""
    if UPCAST_BF16:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    return tl.dot(a, b, acc)
