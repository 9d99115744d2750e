"""Triton import point and the device-side helpers every kernel may share.

Importing Triton through here keeps ``import fusetune`` working where Triton is not installed
(macOS, Windows): kernels are then never launched and every op runs its reference.
"""

from __future__ import annotations

import os

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

__all__ = ["HAS_TRITON", "INTERPRET", "OutOfResources", "dot", "jit", "tanh", "tl", "triton"]

# Triton releases whose launch path (JITFunction.run, CompiledKernel.run's arguments) the fast
# launch below was written against; any other version launches through Triton's own path.
_FAST_LAUNCH_VERSIONS = ("3.6.", "3.7.", "3.8.", "3.9.")


def _argument_key(value: object) -> object:
    """What Triton's specialisation of a non-constexpr argument depends on (its
    ``native_specialize_impl``): a tensor's dtype and 16-byte alignment; an int's equality to 1
    (then a constant), divisibility by 16 and width (i32 / i64 / u64). A float or bool never
    specialises. Raises TypeError for anything else (the launch then takes Triton's path)."""
    kind = type(value)
    if kind is int:
        return (value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if kind is float or kind is bool or value is None:
        return kind
    return (value.dtype, value.data_ptr() % 16 == 0)  # a tensor (AttributeError otherwise)


if (
    HAS_TRITON
    and not INTERPRET
    and triton.__version__.startswith(_FAST_LAUNCH_VERSIONS)
    and os.environ.get("FUSETUNE_FAST_LAUNCH", "1") != "0"  # (0: Triton's own, to compare)
):
    from triton.runtime import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction

    class _Kernel(_JITFunction):
        """A JIT function whose host launch skips Triton's per-call binding once a launch of
        the same specialisation has compiled (or found) its kernel: 28 -> ~15 us of host a
        launch on an H100 machine (tools/bench_launch.py). The key (device, each argument's
        :func:`_argument_key`, constexpr and option values with their types: True == 1) is at
        least as fine as Triton's own,
        so a hit is the kernel Triton would have launched. Profiler hooks (``launch_enter_hook``)
        and warm-ups take Triton's path."""

        def __init__(self, fn):
            super().__init__(fn)
            self._constexpr = tuple(p.is_constexpr for p in self.params)
            self._names = tuple(p.name for p in self.params)
            self._keyword_constexpr = {p.name: p.is_constexpr for p in self.params}
            self._defaults = {p.name: p.default for p in self.params if p.has_default}
            self._launches = {}

        def run(self, *args, grid, warmup, **kwargs):
            key = None if warmup or callable(grid) else self._key(args, kwargs)
            kernel = self._launches.get(key) if key is not None else None
            if kernel is None or triton.knobs.runtime.launch_enter_hook.calls:
                kernel = super().run(*args, grid=grid, warmup=warmup, **kwargs)
                if key is not None and not hasattr(kernel, "result"):
                    self._launches[key] = kernel
                return kernel
            values = list(args)
            for name in self._names[len(args):]:
                values.append(kwargs[name] if name in kwargs else self._defaults[name])
            stream = _driver.active.get_current_stream(key[0])
            kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                       stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
            return kernel

        def _key(self, args, kwargs):
            if len(args) > len(self._constexpr):
                return None  # (Triton's path raises the error)
            try:
                key = [_driver.active.get_current_device()]
                for value, constexpr in zip(args, self._constexpr, strict=False):
                    key.append((type(value), value) if constexpr else _argument_key(value))
                for name, value in kwargs.items():
                    # (a name that is no parameter is an option: num_warps, num_stages)
                    constexpr = self._keyword_constexpr.get(name, True)
                    key += (name, (type(value), value) if constexpr else _argument_key(value))
                key = tuple(key)
                hash(key)
            except (AttributeError, TypeError):
                return None
            return key

    def jit(fn):
        """``triton.jit`` for a kernel the host launches, with a faster host launch
        (:class:`_Kernel`)."""
        return _Kernel(fn)

else:
    jit = triton.jit


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
