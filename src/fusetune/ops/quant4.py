"""4-bit base weights (bitsandbytes' NF4 / FP4, blocksize 64 or 128, with or without double
quantisation): a Triton dequantisation into a dense buffer, read in place from the packed codes.

The LoRA ops call :func:`dense` where a dense weight would be read: the frozen 4-bit base is
dequantised into a fresh buffer for the forward matmul and again for the backward's dx, and no
dense copy outlives the matmul that reads it (the caching allocator reuses the block). The format
and its float64 semantics are in :mod:`fusetune.reference.quant4`.

Measured in NOTES.md (QLoRA): the dequantisation moves 2.5 bytes per element (half a byte read,
two written); a Llama-3-8B MLP weight (4096 x 14336) is about 60 us on an H100, against ~1.2 ms
for its matmul at 8192 tokens.
"""

from __future__ import annotations

import math

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
    n_elements = math.prod(shape)
    nested = outer_absmax is not None
    placeholder = absmax  # a valid pointer for the branch the constexpr compiles away
    grid = (_utils.cdiv(n_elements, BLOCK),)  # (triton.cdiv is a constexpr function: ~4 us)
    _dequantize_4bit_kernel[grid](
        packed, absmax, code, outer_absmax if nested else placeholder,
        outer_code if nested else placeholder, offset if nested else placeholder, out,
        n_elements, BLOCKSIZE=blocksize, OUTER_BLOCKSIZE=outer_blocksize if nested else 1,
        NESTED=nested, BLOCK=BLOCK,
    )
    return _utils.cast(out, dtype)


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


def _dequantize(weight: torch.Tensor, dtype: torch.dtype, backward: bool = False) -> torch.Tensor:
    # (the packed codes are uint8, which backend() sends to the reference: ask the code table)
    if _utils.backend(weight.quant_state.code) == "reference":
        return reference.dequantize_4bit(weight, dtype)
    state = weight.quant_state
    tensors = _state_tensors(weight)
    outer_blocksize = state.state2.blocksize if tensors[3] is not None else 1
    args = (*tensors, state.blocksize, outer_blocksize, list(state.shape), dtype)
    if _utils.plain_eager(tensors[1], tensors[2]):
        return _launch(*args)
    return _dequantize_4bit_op(*args, int(backward))


def dense(weight: torch.Tensor, dtype: torch.dtype, *, backward: bool = False) -> torch.Tensor:
    """``weight`` as a dense tensor in ``dtype`` (see :func:`fusetune.reference.quant4.dense`):
    a 4-bit weight dequantised to the dtype it stands for, then cast. ``backward``: called from
    a backward (a traced backward's dequantisation is kept apart from the forward's)."""
    if is_4bit(weight):
        return _utils.cast(_dequantize(weight, weight.quant_state.dtype, backward), dtype)
    return _utils.cast(weight, dtype)
