"""Pure-PyTorch 4-bit weights in bitsandbytes' format: the semantics of
:func:`fusetune.dequantize_4bit`, its CPU path and the tests' oracle.

A bitsandbytes ``Params4bit`` holds a [out, in] weight as packed 4-bit codes, two per byte (the
first element in the high nibble), in ``weight.quant_state``:
    code      [16] float32: the value of each 4-bit code (the NF4 or FP4 table)
    absmax    [blocks]: one scale per ``blocksize`` consecutive elements (64 or 128), float32,
              or with double quantisation (``nested``) uint8 codes of a second, 8-bit blockwise
              quantisation: absmax = state2.code[q] * state2.absmax[i // state2.blocksize]
              + offset
    shape, dtype: the weight's shape and dtype before quantisation
so that element i of the flattened weight is ``code[nibble_i] * absmax[i // blocksize]``, in
float32, rounded once to ``dtype``. A 4-bit weight stands for that dense weight everywhere in
fusetune (the LoRA ops accept either).
"""

from __future__ import annotations

import math

import torch


def is_4bit(weight: object) -> bool:
    """A bitsandbytes 4-bit weight (anything with a ``quant_state``, as ``Params4bit``)."""
    return getattr(weight, "quant_state", None) is not None


def logical_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The shape ``weight`` stands for: the dense shape of a 4-bit weight, else its own."""
    return tuple(weight.quant_state.shape) if is_4bit(weight) else tuple(weight.shape)


def logical_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``weight`` stands for: a 4-bit weight's dtype before quantisation."""
    return weight.quant_state.dtype if is_4bit(weight) else weight.dtype


def stand_in(weight: torch.Tensor) -> torch.Tensor:
    """A tensor with the dense weight's shape, dtype and device that holds no memory (one
    element, expanded): what the argument checks read in place of a 4-bit weight."""
    if not is_4bit(weight):
        return weight
    one = torch.empty((), dtype=logical_dtype(weight), device=weight.device)
    return one.requires_grad_(weight.requires_grad).expand(logical_shape(weight))


def check_4bit(name: str, weight: torch.Tensor) -> None:
    """The quantisation state is one fusetune reads: raise naming ``name`` otherwise."""
    state = weight.quant_state
    numel = math.prod(state.shape)
    problems = []
    if len(state.shape) != 2:
        problems.append(f"shape {tuple(state.shape)} is not [out, in]")
    if weight.numel() * weight.element_size() * 2 < numel:
        problems.append(f"{weight.numel() * weight.element_size()} packed bytes for {numel} values")
    if state.code.numel() != 16:
        problems.append(f"a code table of {state.code.numel()} values, not 16")
    if state.blocksize % 2:  # a byte's two elements share their block's scale
        problems.append(f"an odd blocksize {state.blocksize}")
    if state.absmax.numel() * state.blocksize < numel:
        problems.append(f"{state.absmax.numel()} scales of blocks of {state.blocksize}")
    if not state.dtype.is_floating_point:
        problems.append(f"dtype {state.dtype}")
    if problems:
        raise ValueError(f"{name} is a 4-bit weight fusetune cannot read: {'; '.join(problems)}")


def block_scales(weight: torch.Tensor) -> torch.Tensor:
    """Each block's scale [blocks], float32 (double quantisation undone)."""
    state = weight.quant_state
    absmax = state.absmax
    if getattr(state, "nested", False):
        outer = state.state2
        per_block = outer.absmax.float().repeat_interleave(outer.blocksize)[: absmax.numel()]
        absmax = outer.code.float()[absmax.long()] * per_block + state.offset.float()
    return absmax.float()


def codes(weight: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes [numel] (int64), first element of each byte from its high nibble."""
    packed = weight.reshape(-1)
    if packed.dtype != torch.uint8:  # bitsandbytes' quant_storage may be another dtype
        packed = packed.view(torch.uint8)
    pairs = torch.stack([packed >> 4, packed & 15], dim=-1)
    return pairs.reshape(-1)[: math.prod(weight.quant_state.shape)].long()


def dequantize_4bit(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight a 4-bit ``weight`` stands for, in ``dtype`` (default: the dtype it
    was quantised from): the products in float32 (float64 when dtype is float64), rounded once."""
    state = weight.quant_state
    dtype = dtype or state.dtype
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    values = state.code.to(math_dtype)[codes(weight)]
    scales = block_scales(weight).to(math_dtype).repeat_interleave(state.blocksize)
    return (values * scales[: values.numel()]).to(dtype).reshape(state.shape)


def dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as a dense tensor in ``dtype``: a 4-bit weight dequantised, rounded to the
    dtype it stands for and then to ``dtype``, exactly as its dense twin's ``.to(dtype)``."""
    if is_4bit(weight):
        return dequantize_4bit(weight).to(dtype)
    return weight.to(dtype)
