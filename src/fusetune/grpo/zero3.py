"""``python -m fusetune grpo --zero3``: DeepSpeed ZeRO-3 through TRL's GRPOTrainer.

GRPOConfig gets a ZeRO-3 config dict (``deepspeed=``), and accelerate then hands the model to a
DeepSpeed engine that partitions every parameter over the ranks. TRL's fused log-prob head,
served by fusetune, runs inside the head module's own call (fusetune.integrations.trl), so
ZeRO's hooks gather the head's weight for it and reduce its gradient. Generation gathers the
whole model (TRL's ``ds3_gather_for_generation``). At the end every rank takes part in gathering
the parameters one at a time, and rank 0 keeps the whole tensors for the saved adapter or model.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fusetune.finetune.errors import FinetuneError


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def config() -> dict:
    """The ZeRO-3 config the command ships; "auto" values come from GRPOConfig (transformers
    fills them in: batch sizes, clipping, bf16/fp16). No ``optimizer``: the trainer's own
    torch AdamW and scheduler run on ZeRO's partitions, as they would under DDP."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            # ZeRO-3 keeps parameters under this size whole on every rank; 0 partitions them
            # all: a LoRA run's fp32 adapters beside bf16 norms would otherwise make a
            # mixed-dtype persistent set, which DeepSpeed cannot gather (DeepSpeed #8072)
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            # --save-every's checkpoints: the model's weights whole (as save_pretrained writes
            # them), beside DeepSpeed's partitioned optimizer state for --resume
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }


def options(args) -> dict:
    """GRPOConfig's settings for ``--zero3`` ({} without it); on CPU ranks it also sets up
    accelerate's state for the trainer (:func:`_cpu_state`). The command leaves ``use_cpu`` off
    with it: under ``use_cpu`` transformers never turns DeepSpeed on."""
    if not args.zero3:
        return {}
    if args.device.type != "cpu":
        return {"deepspeed": config()}
    _cpu_state()
    return {"deepspeed": config(), "accelerator_config": {"use_configured_state": True}}


def _cpu_state() -> None:
    """CPU ranks (gloo, DeepSpeed's CPU accelerator): accelerate 1.15 finds no backend for a
    DeepSpeed run without a GPU and runs every rank as a world of one (each the whole batch;
    DeepSpeed's batch check then fails), so the command sets accelerate's state up itself, on
    gloo, and the trainer takes it (``use_configured_state``). Each trainer gets a fresh state,
    as transformers gives it otherwise (a second Accelerator refuses the state's plugin: --compare
    builds two trainers)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as transformers does, for this call
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def forget_earlier_config() -> None:
    """Before building a model: transformers builds models under ``deepspeed.zero.Init`` while
    an earlier GRPOConfig's ZeRO-3 config lives (--compare's first trainer), which initialises
    random weights differently; every run builds its model whole, then DeepSpeed partitions it."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def check_precision(name: str, device: torch.device) -> None:
    """ZeRO-3 on CPU ranks trains in fp32: transformers takes bf16 on the CPU only with
    ``use_cpu``, which turns DeepSpeed off."""
    if device.type == "cpu" and name != "fp32":
        raise FinetuneError(f"--zero3 on the CPU trains in fp32 (transformers runs {name} on the "
                            "CPU only without DeepSpeed); pass --precision fp32")  # fmt: skip


def check_enabled(trainer, device: torch.device) -> None:
    """Stop, rather than run replicated or on another device, when accelerate did not hand the
    model to DeepSpeed ZeRO-3 on the device the command chose."""
    if not trainer.is_deepspeed_enabled:
        kind = trainer.accelerator.state.distributed_type
        raise FinetuneError(f"--zero3: accelerate did not enable DeepSpeed ({kind.value})")
    if trainer.accelerator.device.type != device.type:
        raise FinetuneError(f"--zero3: DeepSpeed runs on {trainer.accelerator.device.type}, "
                            f"not on --device {device}")  # fmt: skip


def partitioned_parameters(model: torch.nn.Module) -> int:
    """How many of ``model``'s parameters ZeRO-3 partitions (each rank holding a part): the
    check that ``--zero3`` partitioned the model rather than replicating it."""
    return sum(
        hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in model.parameters()
    )


def gathered_state(model: torch.nn.Module, full: bool) -> dict[str, torch.Tensor] | None:
    """The ZeRO-3 model's state dict, whole, as CPU tensors on rank 0 (None on the others), for
    save_pretrained. A collective: every rank calls it. Parameters are gathered one at a time
    (never the whole model at once); under LoRA only the trained ones (PEFT saves those).
    Buffers are not partitioned: each rank holds them whole."""
    import deepspeed

    rank0 = int(os.environ.get("RANK", "0")) == 0
    state = {}
    for name, param in model.named_parameters():  # a tied head: the embedding's name, kept
        if not (full or param.requires_grad):
            continue
        with deepspeed.zero.GatheredParameters([param]):
            if rank0:
                state[name] = param.detach().cpu().clone()
    if not rank0:
        return None
    persistent = model.state_dict().keys()
    for name, buffer in model.named_buffers():
        if name in persistent:
            state[name] = buffer.detach().cpu().clone()
    return state
