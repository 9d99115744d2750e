"""``finetune`` on N processes: ``torchrun --nproc_per_node N -m fusetune finetune ...``.

Each rank trains on its own rows of every micro-batch (``--batch-size`` is per rank), the model
sharded with FSDP2 (every decoder layer, then the root: the lm_head stays in the root group, where
the fused loss reads it directly). The loss of each micro-batch is its sum over the rank's tokens
divided by the step's token count over all ranks (HF's ``num_items_in_batch``, all-reduced), and
FSDP2 averages gradients over ranks, so the loss is scaled by the world size for the backward:
the step's gradient is that of the mean over every token of every rank, as on one process.
Rank 0 prints and saves (a full state dict gathered from the shards).

``--replicate`` (LoRA; implied by ``--cuda-graph`` and ``--load-in-4bit`` under torchrun: FSDP2
does not shard bitsandbytes' 4-bit weights here) shards nothing: every rank holds the whole
model, as DDP does, and the adapters' gradients are averaged once a step by
:func:`fusetune.integrations.fsdp.average_gradients` (one flat all-reduce; under --cuda-graph
inside the step's CUDA graph, where FSDP2's gathers could not be replayed)."""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free now on this host, for one process group's rendezvous (a fixed port
    collides with another launch: two xdist workers, or two bench jobs at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def setup(device: torch.device) -> tuple[Ranks, torch.device]:
    """Join the process group torchrun / accelerate describe in the environment (NCCL on CUDA,
    gloo on the CPU); (ranks, this rank's device). One process: no group, the device as is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(), device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        torch.cuda.set_device(device)
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def pin_main_thread(ranks: Ranks) -> set[int] | None:
    """Pin the calling (main) thread to one core, the ranks on this host spread over the
    process's CPU mask (core ``share // 2`` of each rank's share: never the mask's first core,
    which on many hosts also takes interrupts). Returns the mask to restore, or None (and one
    warning) where it cannot pin: not Linux, or fewer than two cores a rank on this host.

    Why: an eager step issues ~270k host calls, and two busy ranks on one host slow each
    other's (two 1-GPU runs without a process group too); a main thread pinned to a core of its
    own gets most of it back (2x H200, the eager LoRA step at 2 ranks: 126-130 ms unpinned,
    114-119 pinned). Threads and processes started later inherit the one
    core, so call it after the first step (compilation, NCCL's communicator started)."""
    if not hasattr(os, "sched_setaffinity"):
        warnings.warn("--pin-cpu: only Linux can pin threads; not pinned", stacklevel=2)
        return None
    mask = os.sched_getaffinity(0)
    local_rank = int(os.environ.get("LOCAL_RANK", ranks.rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    if len(mask) < 2 * local_world:
        warnings.warn(
            f"--pin-cpu: {len(mask)} cores in this process's mask for {local_world} ranks on "
            "this host (two a rank needed); not pinned",
            stacklevel=2,
        )
        return None
    share = len(mask) // local_world
    os.sched_setaffinity(0, {sorted(mask)[local_rank * share + share // 2]})
    return mask


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over every layer transformers checkpoints (the decoder layers), then the root. A
    LoRA model's adapters stay whole on every rank (:func:`fusetune.integrations.fsdp.shard_lora`:
    FSDP2's per-parameter work is what a LoRA step waits on); their gradients are averaged as
    FSDP2 averages the rest."""
    from torch.distributed.fsdp import fully_shard

    from fusetune.integrations.fsdp import decoder_layers, shard_lora

    if is_lora(model):
        return shard_lora(model)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """Some parameters train and some are frozen (the base under its adapters)."""
    trains = {p.requires_grad for p in model.parameters()}
    return trains == {True, False}


def all_sum(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    if ranks.world > 1:
        dist.all_reduce(value)
    return value


def full_state_dict(model: torch.nn.Module, ranks: Ranks) -> dict | None:
    """The whole model's state dict on the CPU (a collective: every rank calls it); None on a
    single process (save_pretrained reads the model itself)."""
    if ranks.world == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def finish(ranks: Ranks) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
