"""FSDP2 for LoRA: the frozen base sharded, the adapters replicated.

Under FSDP2 a LoRA step is host-bound. FSDP2 spends Python per parameter on every all-gather
and every gradient reduction, and LoRA adds two small parameters to each linear layer. On one
H100, a Llama-3.2-1B LoRA step (batch 4 x 2048, every decoder layer and the root sharded) took
as long to issue from Python as to run (~132 ms with fusetune), about a third of it in FSDP2's
per-parameter bookkeeping (docs/bench/fsdp2-host-2026-11-26/).

:func:`shard_lora` gives FSDP2 only the frozen parameters (``fully_shard`` with the trainable
ones in ``ignored_params``) and keeps the adapters whole on every rank, as DDP would: when a
backward ends, their gradients are averaged over the ranks in one flat all-reduce. FSDP2 then
has no gradient to reduce at all, and fewer than half the parameters to gather (a Llama layer
with LoRA on its 7 linears: 9 of 23). The adapters stay in their own dtype (FSDP2's
``mp_policy`` casts only the base), which fusetune's LoRA ops take beside a 16-bit base:
float32 adapters, bf16 base is the usual mix.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def shard_lora(
    model: torch.nn.Module,
    *,
    layers: list[torch.nn.Module] | None = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    mesh=None,
) -> torch.nn.Module:
    """Shard ``model``'s frozen parameters with FSDP2 and replicate its trainable ones.

    ``fully_shard`` runs on each of ``layers`` (default: every transformers decoder layer, the
    modules gradient checkpointing wraps) and then on ``model``, with ``mp_policy``,
    ``reshard_after_forward`` and ``mesh`` (a 1-D DeviceMesh) passed through and the trainable
    parameters left out. Those must already sit on this rank's device (FSDP2 does not move what
    it ignores); their gradients are averaged over the mesh's ranks (the default group
    without a mesh) at the end of every backward, so gradient accumulation needs nothing more.
    An adapter that got no gradient on a rank counts as zero there: after the average every
    trainable parameter has a gradient.

    ``mp_policy`` casts only what FSDP2 manages: the adapters compute in their own dtype.
    fusetune's LoRA ops read fp32 adapters beside a bf16 base at bf16 speed; plain PEFT casts
    its input to the adapters' dtype and runs the LoRA products in fp32 (2x H100, Llama-3.2-1B:
    HF + PEFT 41.7k -> 30.9k tokens/s per GPU with shard_lora, fusetune 42.6k -> 54.5k). One
    warning names such layers (:func:`adapters_left_wide`): call ``fusetune.apply`` first.

    Returns ``model`` (sharded in place). Raises ValueError when ``model`` has no trainable
    parameter, or no frozen one (nothing to shard: use ``fully_shard``), or no layer to shard.
    """
    from torch.distributed.fsdp import fully_shard

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("model: no trainable parameter (shard_lora replicates the adapters)")
    if all(p.requires_grad for p in model.parameters()):
        raise ValueError("model: every parameter trains; shard_lora shards a frozen base: "
                         "use torch.distributed.fsdp.fully_shard")  # fmt: skip
    layers = decoder_layers(model) if layers is None else layers
    if not layers:
        raise ValueError("layers: none given and model has no transformers decoder layer")
    note = adapters_left_wide(model, mp_policy)
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=2)
    options = dict(reshard_after_forward=reshard_after_forward, ignored_params=set(trainable))
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if mesh is not None:
        options["mesh"] = mesh
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    group = None if mesh is None else mesh.get_group()
    if dist.get_world_size(group) > 1:
        model._fusetune_gradient_average = GradientAverage(trainable, group)
    return model


def adapters_left_wide(model: torch.nn.Module, mp_policy) -> str | None:
    """Why plain PEFT layers would compute in the adapters' wider dtype under ``mp_policy``, or
    None. The policy casts only what FSDP2 manages, so a PEFT LoRA layer fusetune does not
    route (``fusetune.apply`` not called first, or a layer it skipped) casts its input to
    float32 adapters and runs its LoRA products in float32: on 2x H100 that took HF + PEFT
    from 41.7k to 30.9k tokens/s per GPU (Llama-3.2-1B LoRA)."""
    compute = getattr(mp_policy, "param_dtype", None)
    if compute is None:
        return None
    from fusetune.integrations import peft as peft_integration

    routed = set(peft_integration.patched(model))

    def left_wide(name: str, module: torch.nn.Module) -> bool:
        if name in routed or not peft_integration.is_lora_layer(module):
            return False
        return any(p.requires_grad and p.dtype.itemsize > compute.itemsize
                   for p in module.parameters())  # fmt: skip

    wide = [name for name, module in model.named_modules() if left_wide(name, module)]
    if not wide:
        return None
    return (f"shard_lora: {len(wide)} PEFT LoRA layers (first: {wide[0]}) run PEFT's own "
            f"forward with adapters wider than the policy's {compute}: FSDP2 does not cast "
            "the replicated adapters, so their LoRA products run in the adapters' dtype "
            "(slower, more memory). Call fusetune.apply(model) before shard_lora, or cast the "
            "adapters.")  # fmt: skip


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers' gradient checkpointing wraps: its decoder layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def average_gradients(params: list[torch.nn.Parameter], group=None) -> None:
    """Replace each of ``params``' gradients by its mean over ``group``'s ranks (default: every
    rank), in place: the tensors stay where a CUDA graph reads them. One flat float32
    all-reduce; a missing gradient counts as zeros (and is set). Every rank must call it with
    the same parameters."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [param.grad for param in params]
    flat = torch.cat([grad.reshape(-1).float() for grad in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    pieces = flat.split([grad.numel() for grad in grads])
    torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(pieces, grads, strict=True)])


class GradientAverage:
    """Averages ``params``' gradients over ``group`` once per backward, after the last of them
    has accumulated: the first accumulation of a backward queues the average as a callback of
    the autograd engine, which runs it when that backward ends (how DDP finishes its buckets).
    One flat float32 all-reduce (sum, then divided by the world size); no host sync."""

    def __init__(self, params: list[torch.nn.Parameter], group=None) -> None:
        self.params, self.group, self.queued = params, group, False
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def _accumulated(self, _param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.average)

    def average(self) -> None:
        self.queued = False
        average_gradients(self.params, self.group)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
