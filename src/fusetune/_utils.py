"""Host-side helpers every op shares: dispatch, argument checks, allocation, launch settings."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from fusetune._triton import HAS_TRITON, INTERPRET, triton

Backend = Literal["triton", "interpreter", "reference"]
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- dispatch


def backend(tensor: torch.Tensor) -> Backend:
    """Which implementation an op runs for ``tensor``: compiled Triton on CUDA, Triton's
    interpreter on CPU when ``FUSETUNE_INTERPRET=1``, else the pure-PyTorch reference."""
    if HAS_TRITON and tensor.dtype in KERNEL_DTYPES:
        if tensor.is_cuda and not INTERPRET:
            return "triton"
        if tensor.device.type == "cpu" and INTERPRET:
            return "interpreter"
    return "reference"


@functools.cache
def _properties_of(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _cuda_properties(device: torch.device):
    """The (cached) properties of a CUDA ``device``; no index means the current device."""
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


def shared_memory_per_block(device: torch.device) -> int | None:
    """The most shared memory one block may take on a CUDA ``device`` (bytes, opt-in: H100 232448,
    A100 166912); None elsewhere (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return _cuda_properties(device).shared_memory_per_block_optin


def num_programs_in_flight(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a small fixed number under the interpreter, so
    that CPU tests exercise the same launch-shape decisions as a GPU does on larger inputs)."""
    if device.type == "cuda":
        return _cuda_properties(device).multi_processor_count
    return 4


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def autotune(configs: Sequence[object], key: Sequence[str], **kwargs: object):
    """``triton.autotune``, except under the interpreter, where autotuning needs a GPU driver:
    there the kernel runs with the first config."""
    if not INTERPRET:
        return triton.autotune(configs=list(configs), key=list(key), **kwargs)

    first = configs[0]

    def decorate(kernel):
        def launch(grid):
            def run(*args, **kw):
                return kernel[grid](*args, **kw, **first.all_kwargs())

            return run

        class _FirstConfig:
            def __getitem__(self, grid):
                return launch(grid)

        return _FirstConfig()

    return decorate


# ----------------------------------------------------------------------------- op registration

_LIBRARY = torch.library.Library("fusetune", "DEF")


def register_op(schema: str, fake: Callable) -> Callable:
    """Register ``fusetune::<schema>`` with one kernel for every device (the implementation
    dispatches to Triton or the reference itself) and ``fake`` for tracing and
    torch.compile. Autograd is the caller's (an autograd.Function around the op).

    This is the low-level torch.library API: ``torch.library.custom_op`` measured about
    0.25 ms of Python per call on the GPU machine, as much as a whole 32k-vocab kernel.
    """

    def decorate(impl: Callable) -> Callable:
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fusetune::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.fusetune, name).default

    return decorate


# ----------------------------------------------------------------------------- allocation

_POISON = os.environ.get("FUSETUNE_POISON", "0") == "1"


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fill every buffer ops allocate with NaN (ints with -1) so that an element a kernel forgot
    to write shows up in the comparison. For tests; also on with ``FUSETUNE_POISON=1``."""
    global _POISON
    previous, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = previous


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, NaN-poisoned under :func:`poison_outputs`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        out.fill_(math.nan if dtype.is_floating_point else -1)
    return out


def scalar_tensor(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor on ``device`` from a Python number or a tensor, without a host sync."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``: t itself when it has that dtype (Tensor.to returns it too, after
    microseconds of argument parsing: host time in a host-bound step); else the dtype's own
    method (the same call inside, without parsing to()'s arguments: about 1 us less a cast)."""
    if t.dtype == dtype:
        return t
    if dtype == torch.bfloat16:
        return t.bfloat16()
    if dtype == torch.float32:
        return t.float()
    if dtype == torch.float16:
        return t.half()
    return t.to(dtype)


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, last dim] view with a unit column stride (a copy only when no such view exists),
    for kernels that index rows by one row stride."""
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:  # leading dims that do not collapse to one row stride
        return tensor.contiguous().view(-1, tensor.shape[-1])


# The types plain_eager accepts (None: an absent optional tensor), as one set: a set test of
# the arguments' types runs in C, where a generator over them cost a Python frame per tensor.
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True in plain eager mode on ordinary tensors: there an autograd Function may call its
    launchers directly, skipping the dispatcher's round trip into Python (host time that a
    sub-millisecond kernel notices). Tracing (torch.compile, export) and tensor subclasses
    (FakeTensor, DTensor) must go through the registered op."""
    if torch.compiler.is_compiling():
        return False
    return _PLAIN_TYPES.issuperset(map(type, tensors))


def matmul_dtype(
    inputs: torch.Tensor, weight: torch.Tensor, names: tuple[str, str] = ("hidden", "weight")
) -> torch.dtype:
    """The dtype a matmul of ``inputs`` with ``weight`` runs in, for every op with one.

    Under torch.autocast: the autocast dtype, as F.linear. Outside it: the two dtypes when they
    agree; with float32 and a 16-bit dtype mixed, the 16-bit one (as if autocast to it were on);
    float16 with bfloat16 is a TypeError naming ``names``."""
    device_type = inputs.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if inputs.dtype == weight.dtype:
        return inputs.dtype
    narrow = {inputs.dtype, weight.dtype} - {torch.float32, torch.float64}
    if len(narrow) != 1:
        first, second = names
        raise TypeError(
            f"{first} and {second} mix float16 and bfloat16; cast one of them or use "
            f"torch.autocast (got {first} {inputs.dtype}, {second} {weight.dtype})"
        )
    return narrow.pop()


# ----------------------------------------------------------------------------- argument checks


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(name: str, tensor: torch.Tensor) -> None:
    check_tensor(name, tensor)
    if not tensor.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating-point tensor (float32, float16 or bfloat16), "
            f"got dtype {tensor.dtype}"
        )


def check_integer(name: str, tensor: torch.Tensor) -> None:
    check_tensor(name, tensor)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (int64 or int32), got dtype {tensor.dtype}"
        )


def check_ndim(name: str, tensor: torch.Tensor, allowed: Sequence[int], layout: str) -> None:
    if tensor.dim() not in allowed:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"tensors must be on one device, got {listed}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> int:
    """Packed-sequence offsets ``cu_seqlens`` [N + 1] of a linear-attention op over [1, T, ...]
    inputs; returns N. Values are checked for CPU tensors outside torch.compile only (on the
    GPU it would cost a host sync; the kernels clamp every offset into [0, T] instead)."""
    check_integer("cu_seqlens", cu_seqlens)
    check_ndim("cu_seqlens", cu_seqlens, (1,), "1-D [N + 1]")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens must hold N + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}"
        )
    if batch != 1:
        raise ValueError(
            f"with cu_seqlens the batch size must be 1 (sequences packed along time), got B = "
            f"{batch}"
        )
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        values = cu_seqlens.tolist()
        if values[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
        if any(b < a for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
        if values[-1] != seq_len:
            raise ValueError(
                f"cu_seqlens must end at T = {seq_len} (the packed length), got {values[-1]}"
            )
    return cu_seqlens.shape[0] - 1


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    optional: bool = False,
) -> None:
    """A finite Python number within [low, high] (or (low, ...] with low_inclusive=False)."""
    if value is None and optional:
        return
    # A chained comparison, not math.isfinite: under torch.compile value may be a SymFloat.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (-math.inf < value < math.inf)
    ):
        raise TypeError(f"{name} must be a finite Python number{_got(value)}")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and value > high
    if too_low or too_high:
        bounds = f"{'[' if low_inclusive else '('}{'-inf' if low is None else low}, "
        bounds += f"{'inf' if high is None else high}]"
        raise ValueError(f"{name} must be in {bounds}{_got(value)}")


def _got(value: object) -> str:
    """ ", got <value>" for a message; empty under torch.compile, where a symbolic float cannot
    be formatted (the name and the expected range still say what is wrong)."""
    return "" if torch.compiler.is_compiling() else f", got {value!r}"
