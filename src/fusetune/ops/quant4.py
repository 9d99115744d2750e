"""4-bit base weights (bitsandbytes' NF4 / FP4, blocksize 64 or 128, with or without double
quantisation): a Triton dequantisation into a dense buffer, read in place from the packed codes.

The LoRA ops call :func:`dense` where a dense weight would be read: the frozen 4-bit base is
dequantised for the forward matmul and again for the backward's dx, and no dense copy outlives
the matmul that reads it. On CUDA each weight's dequantisation is a CUDA graph, replayed into one
buffer per device and dtype (host time: see "replayed launches"). The format
and its float64 semantics are in :mod:`fusetune.reference.quant4`.

Measured in NOTES.md (QLoRA): the dequantisation moves 2.5 bytes per element (half a byte read,
two written); a Llama-3-8B MLP weight (4096 x 14336) is about 60 us on an H100, against ~1.2 ms
for its matmul at 8192 tokens.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from fusetune import _utils
from fusetune._triton import INTERPRET, tl, triton
from fusetune.reference import quant4 as reference
from fusetune.reference.quant4 import check_4bit, is_4bit, logical_dtype, logical_shape

__all__ = ["dense", "dequantize_4bit", "is_4bit", "logical_dtype", "logical_shape"]

BLOCK = 2048  # output elements per program


@triton.jit
def _dequantize_4bit_kernel(packed_ptr, absmax_ptr, code_ptr, outer_absmax_ptr, outer_code_ptr,
                            offset_ptr, out_ptr, n_elements, BLOCKSIZE: tl.constexpr,
                            OUTER_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                            BLOCK: tl.constexpr):
    # one byte holds two neighbouring elements (high nibble first) of the same quantisation
    # block (blocksizes are even): its scale is read once, and the contiguous byte load and the
    # interleaved store of both values vectorise
    byte_index = tl.program_id(0).to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    byte_mask = byte_index < (n_elements + 1) // 2
    byte = tl.load(packed_ptr + byte_index, mask=byte_mask, other=0).to(tl.int32)
    high = tl.load(code_ptr + (byte >> 4), mask=byte_mask, other=0.0).to(tl.float32)
    low = tl.load(code_ptr + (byte & 15), mask=byte_mask, other=0.0).to(tl.float32)
    block = byte_index // (BLOCKSIZE // 2)
    if NESTED:
        quantised = tl.load(absmax_ptr + block, mask=byte_mask, other=0).to(tl.int32)
        outer = tl.load(outer_absmax_ptr + block // OUTER_BLOCKSIZE, mask=byte_mask, other=0.0)
        scale = tl.load(outer_code_ptr + quantised, mask=byte_mask, other=0.0).to(tl.float32)
        scale = scale * outer.to(tl.float32) + tl.load(offset_ptr).to(tl.float32)
    else:
        scale = tl.load(absmax_ptr + block, mask=byte_mask, other=0.0).to(tl.float32)
    value = tl.interleave(high * scale, low * scale)
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + index, value.to(out_ptr.dtype.element_ty), mask=index < n_elements)


def _state_tensors(weight: torch.Tensor):
    """(packed uint8, absmax, code, outer absmax, outer code, offset) of a 4-bit weight; the
    outer three are None without double quantisation."""
    state = weight.quant_state
    packed = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
    if getattr(state, "nested", False):
        outer = state.state2
        offset = state.offset if isinstance(state.offset, torch.Tensor) else None
        if offset is None:
            offset = torch.full((), float(state.offset), device=weight.device)
        return packed, state.absmax, state.code, outer.absmax, outer.code, offset.reshape(1)
    return packed, state.absmax, state.code, None, None, None


def _launch(packed, absmax, code, outer_absmax, outer_code, offset, blocksize: int,
            outer_blocksize: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    # Triton's interpreter rounds 16-bit stores differently from the GPU and from torch (NOTES):
    # there the kernel writes fp32 and torch rounds, so both paths equal the reference exactly.
    store_dtype = torch.float32 if INTERPRET and dtype != torch.float64 else dtype
    out = _utils.empty(shape, store_dtype, packed.device)
    _launch_into(out, packed, absmax, code, outer_absmax, outer_code, offset, blocksize,
                 outer_blocksize)  # fmt: skip
    return _utils.cast(out, dtype)


def _launch_into(out, packed, absmax, code, outer_absmax, outer_code, offset, blocksize: int,
                 outer_blocksize: int) -> None:
    n_elements = out.numel()
    nested = outer_absmax is not None
    placeholder = absmax  # a valid pointer for the branch the constexpr compiles away
    grid = (_utils.cdiv(n_elements, BLOCK),)  # (triton.cdiv is a constexpr function: ~4 us)
    _dequantize_4bit_kernel[grid](
        packed, absmax, code, outer_absmax if nested else placeholder,
        outer_code if nested else placeholder, offset if nested else placeholder, out,
        n_elements, BLOCKSIZE=blocksize, OUTER_BLOCKSIZE=outer_blocksize if nested else 1,
        NESTED=nested, BLOCK=BLOCK,
    )


def _fake(packed, absmax, code, outer_absmax, outer_code, offset, blocksize, outer_blocksize,
          shape, dtype, call):
    return packed.new_empty(shape, dtype=dtype)


@_utils.register_op(
    "dequantize_4bit(Tensor packed, Tensor absmax, Tensor code, Tensor? outer_absmax, "
    "Tensor? outer_code, Tensor? offset, int blocksize, int outer_blocksize, SymInt[] shape, "
    "ScalarType dtype, int call) -> Tensor",
    _fake,
)
def _dequantize_4bit_op(packed, absmax, code, outer_absmax, outer_code, offset, blocksize,
                        outer_blocksize, shape, dtype, call):
    """``call``: 0 in a forward, 1 in a backward. Two calls that differ only there are the same
    computation, but torch.compile would merge identical calls into one, and then keep its
    dense result alive from the forward to the backward: a whole dense model for QLoRA."""
    return _launch(packed, absmax, code, outer_absmax, outer_code, offset, blocksize,
                   outer_blocksize, list(shape), dtype)


def dequantize_4bit(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight a bitsandbytes 4-bit ``weight`` stands for.

    Args:
        weight: a bitsandbytes ``Params4bit`` (packed codes with a ``quant_state``): NF4 or
            FP4, any blocksize, with or without double quantisation, any quant_storage dtype.
        dtype: the output dtype (default: the dtype the weight was quantised from). Each
            element is ``code * scale`` in float32, rounded once to ``dtype``.

    Returns:
        A new dense [out, in] tensor on the weight's device. No gradient: 4-bit weights are
        frozen.

    Raises:
        TypeError: ``weight`` carries no ``quant_state``.
        ValueError: a quantisation state fusetune cannot read (not 2-D, too few packed bytes
            or scales, a code table that is not 16 values).
    """
    if not is_4bit(weight):
        raise TypeError(
            f"weight must be a bitsandbytes 4-bit weight (a Params4bit with a quant_state), "
            f"got {type(weight).__name__}"
        )
    check_4bit("weight", weight)
    return _dequantize(weight, dtype or weight.quant_state.dtype)


def _dequantize(weight: torch.Tensor, dtype: torch.dtype, backward: bool = False,
                shared: bool = False) -> torch.Tensor:
    """``shared``: the result may live in the shared buffer (see below), valid until the next
    shared dequantisation on its device."""
    # (the packed codes are uint8, which backend() sends to the reference: ask the code table)
    state = weight.quant_state
    backend = _utils.backend(state.code)
    if backend == "reference":
        return reference.dequantize_4bit(weight, dtype)
    eager = _utils.plain_eager(state.absmax, state.code)
    if shared and eager and REPLAY and backend == "triton":
        out = _replayed(weight, dtype)
        if out is not None:
            return out
    tensors = _state_tensors(weight)
    outer_blocksize = state.state2.blocksize if tensors[3] is not None else 1
    args = (*tensors, state.blocksize, outer_blocksize, list(state.shape), dtype)
    if eager:
        return _launch(*args)
    return _dequantize_4bit_op(*args, int(backward))


# ============================================================================ replayed launches
# Host time: a QLoRA step's forward is host-bound (NOTES: the GPU waits for the host there), and
# a dequantisation's launch cost ~35-60 us of Python and Triton's launcher on the H100's host
# for a kernel of ~15 us (Llama-3.2-1B). A weight never changes, so on CUDA in plain eager mode
# dense() captures its dequantisation once as a CUDA graph and then replays it (a few us).
#
# The graphs of one device and dtype write into one shared buffer (the size of the largest
# weight seen), the buffer a fresh dense weight took before: the LoRA ops read each dense
# weight in one matmul, enqueued before their next dense(), and stream order does the rest.
# So a dense() result is valid until the next dense() on its device, on one stream.
# A weight whose storage or quantisation state changes more than MAX_RECAPTURES times (a
# sharding engine regathering it, say) goes back to plain launches.

REPLAY = True  # plain launches when False (tools time both)
MAX_RECAPTURES = 2


class _SharedBuffer:
    """The flat buffer the graphs of one device and dtype write into."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def at_least(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # (a grown buffer replaces the old one here; graphs captured on the old one keep it
        # alive until they are captured again)
        if self.tensor is None or self.tensor.numel() < numel:
            self.tensor = torch.empty(numel, dtype=dtype, device=device)
        return self.tensor


class _Replay:
    """One weight's captured dequantisation into ``shared``, and what it was captured from."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, shared: _SharedBuffer,
                 recaptures: int) -> None:
        state = weight.quant_state
        # weakly: the record dies with the weight (the packed codes are the weight, or a view)
        self.weight = weakref.ref(weight, _forget((id(weight), dtype)))
        self.state, self.recaptures, self.shared = state, recaptures, shared
        self.pointers = _pointers(weight)
        packed, *scales = _state_tensors(weight)
        self.scales = scales  # (a float offset becomes a tensor: the graph reads this one)
        outer_blocksize = state.state2.blocksize if scales[2] is not None else 1
        numel = math.prod(state.shape)
        self.buffer = shared.at_least(numel, dtype, weight.device)
        self.out = self.buffer[:numel].view(list(state.shape))
        launch = functools.partial(_launch_into, self.out, packed, *scales, state.blocksize,
                                   outer_blocksize)  # fmt: skip
        launch()  # outside the capture: compiles the kernel; this call's result
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(weight.device)
        side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                self.graph.capture_end()

    def moved(self, weight: torch.Tensor) -> bool:
        """True when ``weight``'s storage or quantisation state is not what was captured."""
        return self.state is not weight.quant_state or self.pointers != _pointers(weight)

    def current(self, weight: torch.Tensor) -> bool:
        """True when the graph still reads ``weight``'s storage and writes the shared buffer."""
        return (self.weight() is weight and not self.moved(weight)
                and self.buffer is self.shared.tensor)

    def give_up(self) -> None:
        """Plain launches for this weight from now on (the record stays: it dies with it)."""
        self.graph = self.buffer = self.out = self.scales = None


_NOT_SEEN = object()
_replays: dict[tuple[int, torch.dtype], _Replay] = {}
_shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (device, dtype) -> buffer


def _pointers(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight.quant_state.absmax.data_ptr()


def _forget(key: tuple[int, torch.dtype]):
    return lambda _: _replays.pop(key, None)


def _replayed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``weight`` dequantised to ``dtype`` into the shared buffer by its replayed graph; None
    where it is not replayed (see above), and while a graph is being captured."""
    key = (id(weight), dtype)
    replay = _replays.get(key, _NOT_SEEN)
    seen = replay is not _NOT_SEEN
    if (seen and replay.graph is None) or torch.cuda.is_current_stream_capturing():
        return None
    if seen and replay.current(weight):
        replay.graph.replay()
        return replay.out
    recaptures = 0
    if seen:  # captured for another storage or state, or into a smaller buffer
        recaptures = replay.recaptures + replay.moved(weight)
        if recaptures > MAX_RECAPTURES:
            replay.give_up()
            return None
    shared = _shared.setdefault((weight.device.index, dtype), _SharedBuffer())
    replay = _replays[key] = _Replay(weight, dtype, shared, recaptures)
    return replay.out


def dense(weight: torch.Tensor, dtype: torch.dtype, *, backward: bool = False) -> torch.Tensor:
    """``weight`` as a dense tensor in ``dtype`` (see :func:`fusetune.reference.quant4.dense`):
    a 4-bit weight dequantised to the dtype it stands for, then cast. ``backward``: called from
    a backward (a traced backward's dequantisation is kept apart from the forward's).

    On CUDA in eager mode a 4-bit weight's result may be the shared buffer of its device (see
    "replayed launches"): read it before the next dense() call on that device, on one stream."""
    if is_4bit(weight):
        dense_weight = _dequantize(weight, weight.quant_state.dtype, backward, shared=True)
        return _utils.cast(dense_weight, dtype)
    return _utils.cast(weight, dtype)
