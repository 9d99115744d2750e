"""Gradient checkpointing that keeps each checkpointed layer's input in pinned CPU memory.

With transformers' gradient checkpointing a decoder layer keeps only its input for the backward,
which recomputes the layer; at long context those inputs ([batch, seq, hidden] per layer) are
most of what remains. Here they are copied to pinned host memory on a side stream as soon as the
layer has run (the GPU copy is then free for reuse) and copied back when the layer's backward
starts, ordered by CUDA events: no host synchronisation.

    from fusetune.integrations.checkpointing import enable_offloaded_checkpointing
    enable_offloaded_checkpointing(model)          # a transformers model (PEFT-wrapped too)

Each layer runs through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, whose
saved inputs pass through :class:`HostOffload`'s saved-tensor hooks; the recompute restores the
RNG and autocast state as torch's checkpoint does, so gradients equal plain checkpointing's
exactly. Tensors off the GPU or under ``min_bytes`` stay where they are.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

MIN_OFFLOAD_BYTES = 1 << 20


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move CUDA tensors of at least ``min_bytes`` to pinned host
    memory (asynchronously, on one side stream) and back on the current stream when unpacked."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.min_bytes = min_bytes
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if not tensor.is_cuda or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        stream = _side_stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done
        return _Offloaded(host, tensor.device, copied, tensor.requires_grad)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _Offloaded):
            return packed
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.copied)
        tensor = packed.host.to(packed.device, non_blocking=True)
        return tensor.requires_grad_(packed.requires_grad)


class _Offloaded:
    __slots__ = ("copied", "device", "host", "requires_grad")

    def __init__(self, host, device, copied, requires_grad):
        self.host, self.device, self.copied, self.requires_grad = (
            host,
            device,
            copied,
            requires_grad,
        )


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def offloaded_checkpoint(function, *args, min_bytes: int | None = None):
    """``function(*args)`` checkpointed, its tensor inputs kept in pinned host memory until the
    backward. A first input that needs no gradient (a frozen embedding's output, as under LoRA)
    is given one, so that the layer's own parameters still get theirs (reentrant checkpointing
    differentiates only through inputs that require grad)."""
    if torch.is_grad_enabled() and not any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        if first is not None and args[first].is_floating_point():
            args = list(args)
            args[first] = args[first].detach().requires_grad_(True)
    with HostOffload(MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def enable_offloaded_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Turn on gradient checkpointing with host offload in every layer of ``model`` that
    transformers checkpoints (a ``GradientCheckpointingLayer``: it has a
    ``gradient_checkpointing`` flag). Returns ``model``.

    Raises:
        ValueError: ``model`` has no such layer (not a transformers model).
    """
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if not layers:
        raise ValueError(
            f"model ({type(model).__name__}) has no layer that transformers checkpoints "
            "(no module with a gradient_checkpointing flag)"
        )
    for module in layers:
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = offloaded_checkpoint
    return model
