"""``python -m fusetune finetune``: check the input, train (twice with --compare), save, report."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fusetune
from fusetune.finetune import checkpoint, data, distributed, models, results, schedule
from fusetune.finetune.args import LATEST, parse
from fusetune.finetune.errors import FinetuneError, Interrupted
from fusetune.finetune.output import MARKER, check_output, check_space, staged_output
from fusetune.finetune.precision import Precision, bf16_supported, choose_precision
from fusetune.finetune.progress import ProgressBar
from fusetune.finetune.summary import format_comparison, format_summary
from fusetune.finetune.train import RunResult, TrainSettings, train


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0, or 2 for bad input: nothing is written)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        with warnings.catch_warnings():
            # PEFT calls a transformers property that 5.2x deprecates: noise for our users.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            return run(args)
    except SystemExit as exc:  # argparse: --help (0), unknown option or bad value (2)
        return exc.code if isinstance(exc.code, int) else 2
    except Interrupted as exc:
        print(f"fusetune finetune: stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first model is built."""

    args: argparse.Namespace
    spec: models.ModelSpec
    precision: Precision
    encoder: Any
    steps: list[list[data.Batch]]
    data_name: str
    examples: int
    dropped: int
    identity: dict[str, Any]  # what a checkpoint of this run records and must match
    resume: checkpoint.Checkpoint | None


def prepare(args: argparse.Namespace) -> Plan:
    """All checks that can fail on bad input, in the order a user would fix them."""
    check_output(Path(args.output), resuming=args.resume is not None)
    examples, data_name = data.load_examples(args.data)
    spec = models.resolve(args.model)
    device = args.device
    precision = choose_precision(args.precision, device.type, bf16_supported(device))
    encoder = models.tokenizer(spec)
    encoded, dropped = data.encode_all(examples, encoder, args.seq_len)
    length = None
    if args.cuda_graph:  # one shape for every batch: the longest example's
        _check_graphable(device, precision, spec)
        length = max(len(ids) for ids, _ in encoded)
    size, rank = args.batch_size, args.ranks.rank
    micro = data.make_batches(  # every rank draws the same global batches, then keeps its rows
        encoded, size * args.ranks.world, args.steps * args.grad_accum, encoder.pad_id, args.seed,
        length,
    )  # fmt: skip
    if args.ranks.world > 1:
        micro = [data.rows(batch, rank * size, (rank + 1) * size) for batch in micro]
    steps = [micro[i : i + args.grad_accum] for i in range(0, len(micro), args.grad_accum)]
    identity = checkpoint.identity(
        spec.name, spec.config, _adapter_identity(args), checkpoint.data_hash(encoded),
        {"batch_size": size, "grad_accum": args.grad_accum, "seed": args.seed,
         "ranks": args.ranks.world, "precision": precision.name},
    )  # fmt: skip
    resume = _find_resume(args, identity)
    return Plan(args, spec, precision, encoder, steps, data_name, len(examples), dropped,
                identity, resume)  # fmt: skip


def _check_graphable(device: torch.device, precision: Precision, spec: models.ModelSpec) -> None:
    if device.type != "cuda":
        raise FinetuneError(f"--cuda-graph needs a CUDA device; this run's is {device}")
    if precision.grad_scaler:
        raise FinetuneError(
            "--cuda-graph: not with fp16 loss scaling (the scaler's overflow check reads the "
            "gradients on the host between backward and update); use --precision bf16 or fp32"
        )
    if getattr(spec.config, "output_router_logits", False):
        raise FinetuneError(
            f"--cuda-graph: not with {spec.name}'s router load-balancing loss "
            "(output_router_logits): the graph's batches are padded and passed without a "
            "mask, and the pads would count in it"
        )


def _adapter_identity(args: argparse.Namespace) -> dict[str, Any]:
    if args.full:
        return {"mode": "full"}
    return {"mode": "lora", "r": args.lora_r, "alpha": args.lora_alpha,
            "targets": "all-linear", "4bit": bool(args.load_in_4bit)}  # fmt: skip


def _find_resume(args: argparse.Namespace, identity: dict) -> checkpoint.Checkpoint | None:
    """The checkpoint --resume names (checked against this run), or None: no --resume, or
    --resume alone and no checkpoint under --output yet (a first run of a restartable job)."""
    if args.resume is None:
        return None
    path = Path(args.output) if args.resume == LATEST else Path(args.resume)
    if args.resume == LATEST or not (path / checkpoint.META).exists():
        found = checkpoint.latest(path)  # an output folder: its newest checkpoint
        if found is None and args.resume == LATEST:
            return None
        path = found or path  # else read() says what the folder lacks
    found = checkpoint.read(path)
    checkpoint.check_matches(found, identity)
    if found.step > args.steps:
        raise FinetuneError(
            f"--resume {path}: the checkpoint is at step {found.step}, past --steps {args.steps}"
        )
    return found


def _refuse_accelerate_engines() -> None:
    """finetune shards with FSDP2 itself; accelerate's DeepSpeed and FSDP plugins (set by
    ``accelerate launch --use_deepspeed`` / a config) would otherwise be silently ignored."""
    for variable, engine in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                             ("ACCELERATE_USE_FSDP", "accelerate's FSDP plugin")):  # fmt: skip
        if os.environ.get(variable, "").lower() in ("1", "true"):
            raise FinetuneError(
                f"finetune shards the model with FSDP2 itself and does not run under {engine} "
                f"({variable} is set): launch with torchrun, or accelerate launch without a "
                "DeepSpeed / FSDP config; for ZeRO-3, call fusetune.apply(model) in your own "
                "DeepSpeed loop"
            )


def run(args: argparse.Namespace) -> int:
    args.ranks, args.device = distributed.setup(args.device)
    try:
        if args.ranks.world > 1 and args.cuda_graph:
            if args.full:
                raise FinetuneError(
                    "--cuda-graph under torchrun: LoRA only (the base replicated on every rank, "
                    "the adapters' gradients averaged in the graph); full fine-tuning shards "
                    "with FSDP2, which gathers each layer's weights at new addresses every step"
                )
            args.replicate = True
        if args.ranks.world > 1 and args.load_in_4bit:
            args.replicate = True  # (FSDP2 does not shard bitsandbytes' 4-bit weights here)
        if args.ranks.world > 1:
            _refuse_accelerate_engines()
        if args.ranks.world > 1 and args.compile == "reduce-overhead":
            # FSDP2's hooks split the stack at every layer (the layers share their graphs:
            # tests/test_compile_fsdp.py), and a CUDA graph replays fixed addresses where
            # FSDP2 frees and gathers each layer's weights anew
            raise FinetuneError(
                "--compile reduce-overhead runs on one process: its CUDA graphs need fixed "
                "addresses, and FSDP2 gathers each layer's weights anew every step; use "
                "--compile (default) or max-autotune with torchrun"
            )
        plan = prepare(args)
        lines = describe(plan)
        main_rank = args.ranks.main
        for key, value in lines.items():
            if main_rank:
                print(f"{key}: {value}", file=sys.stderr)
        baseline = None
        if args.compare:
            baseline, model = train_once(plan, fused=False)
            del model
        result, model = train_once(plan, fused=True, checkpoints=_checkpointing(plan))
        saved = save(plan, model, [r for r in (baseline, result) if r is not None])
        lines["saved"] = saved
        if result.skipped:
            lines["skipped"] = _describe_skipped(result.skipped)
        if main_rank:
            print(format_summary(result, lines))
            if baseline is not None:
                print()
                print(format_comparison(baseline, result))
        return 0
    finally:
        distributed.finish(args.ranks)


def _describe_skipped(skipped: list[int]) -> str:
    steps = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
    return f"{len(skipped)} steps with a non-finite loss or gradient, not applied (steps {steps})"


def _checkpointing(plan: Plan) -> checkpoint.Checkpointing:
    args = plan.args
    meta = {"identity": plan.identity, "steps": args.steps, "lr": args.lr,
            "lr_schedule": args.lr_schedule, "warmup_steps": args.warmup_steps}  # fmt: skip
    return checkpoint.Checkpointing(
        Path(args.output), args.save_every, args.keep_checkpoints, meta, args.ranks, plan.resume
    )


def describe(plan: Plan) -> dict[str, str]:
    args, spec = plan.args, plan.spec
    origin = "built-in, random weights, byte tokenizer" if spec.tiny else "checkpoint"
    mode = (
        "full fine-tuning"
        if args.full
        else (f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on all linear layers")
    )
    if args.load_in_4bit:
        mode += ", NF4 4-bit base (QLoRA)"
    dropped = f", {plan.dropped} dropped (no completion within --seq-len)" if plan.dropped else ""
    where = str(args.device)
    if args.device.type == "cpu":
        where += " (fusetune's CPU path is its PyTorch reference; the kernels run on CUDA)"
    return {
        "model": f"{spec.name} ({spec.family}, {origin}), {mode}",
        "data": f"{plan.data_name}: {plan.examples} examples{dropped}",
        "device": where,
        "precision": plan.precision.describe(),
        "steps": f"{args.steps} x {args.batch_size} sequences x {args.grad_accum} accumulated, "
        f"seq-len <= {args.seq_len}, lr {args.lr:g} "
        f"({schedule.describe(args.lr_schedule, args.warmup_steps)})"
        + (
            f", gradient checkpointing ({args.gradient_checkpointing})"
            if args.gradient_checkpointing
            else ""
        ),
        **_describe_compile(args),
        **_describe_checkpoints(plan),
    }


def _describe_compile(args: argparse.Namespace) -> dict[str, str]:
    if not args.compile:
        return {}
    how = "aot_eager backend" if args.compile == "aot_eager" else f"mode {args.compile}"
    graphs = "one torch.compile graph"
    if args.ranks.world > 1:
        graphs = "compiled, split at FSDP2's hooks into graphs its layers share"
    return {
        "compile": f"on: the decoder stack is {graphs} ({how}); the steps that compile are "
        "left out of tokens/s"
    }


def _describe_checkpoints(plan: Plan) -> dict[str, str]:
    args = plan.args
    lines = {}
    if args.save_every:
        lines["checkpoints"] = (
            f"every {args.save_every} steps and on SIGINT / SIGTERM, into "
            f"{args.output}/checkpoint-<step> (the last {args.keep_checkpoints} kept)"
        )
    else:
        lines["checkpoints"] = f"on SIGINT / SIGTERM only, into {args.output}/checkpoint-<step>"
    if plan.resume is not None:
        lines["resumed"] = f"from {plan.resume.path} (step {plan.resume.step} of {args.steps})"
    elif args.resume is not None:
        lines["resumed"] = f"no checkpoint under {args.output} yet: starting at step 1"
    return lines


def train_once(
    plan: Plan, fused: bool, checkpoints: checkpoint.Checkpointing | None = None
) -> tuple[RunResult, torch.nn.Module]:
    """Build the model afresh (same seed, same weights), optionally apply fusetune, train."""
    args = plan.args
    _release(args.device)
    model = models.build(plan.spec, plan.precision.weight_dtype(args.full), args.device, args.seed)
    if args.load_in_4bit:
        models.quantize_4bit(model)
    if args.gradient_checkpointing == "offload":
        from fusetune.integrations.checkpointing import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
    elif args.gradient_checkpointing:
        _enable_checkpointing(model)
    model = _add_lora(model, args) if not args.full else model.requires_grad_(True)
    base = "HF" if args.full else "HF + PEFT"
    if fused:
        from fusetune.integrations import transformers as hf_integration

        hf_integration.apply(model)
    label = f"{base} + fusetune" if fused else base
    label += " + CUDA graphs" if args.cuda_graph else ""  # (both runs of --compare: as --compile)
    if args.compile:
        # after everything that changes the layers' forwards (checkpointing, LoRA, apply) and
        # on the baseline too, so that --compare measures fusetune's kernels, not the compiler
        _compile(model, args.compile)
        label += " + compile" + ("" if args.compile == "default" else f" ({args.compile})")
    if checkpoints is not None:
        check_space(Path(args.output), checkpoint.estimate_bytes(model), "a checkpoint")
    replicated = args.ranks.world > 1 and args.replicate
    if replicated:
        label += f" on {args.ranks.world} ranks (replicated)"
    elif args.ranks.world > 1:
        distributed.shard(model)
        layout = ", adapters replicated" if distributed.is_lora(model) else ""
        label += f" on {args.ranks.world} ranks (FSDP2{layout})"
    settings = TrainSettings(
        args.lr, args.max_grad_norm, plan.precision, args.device, args.ranks,
        args.lr_schedule, args.warmup_steps, args.skip_nonfinite, bool(args.compile),
        args.cuda_graph, replicated, args.pin_cpu,
    )  # fmt: skip
    progress = ProgressBar(args.steps, label) if args.ranks.main else None
    return train(model, plan.steps, settings, label, progress, checkpoints), model


def _compile(model: torch.nn.Module, mode: str) -> None:
    """``fusetune.compile_layers`` with the --compile MODE (aot_eager names a backend)."""
    from fusetune.integrations.transformers import compile_layers

    options = {"backend": "aot_eager"} if mode == "aot_eager" else {"mode": mode}
    try:
        compile_layers(model, **options)
    except ValueError as exc:
        raise FinetuneError(f"--compile: {exc}") from None


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing (needs no input that requires grad, so it works under LoRA);
    transformers 5.2x renames the method, 5.17 has the old name only."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _add_lora(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    import peft

    torch.manual_seed(args.seed + 1)  # the same adapters in both --compare runs
    config = peft.LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def save(plan: Plan, model: torch.nn.Module, runs: list[RunResult]) -> str:
    """Adapter (or model), tokenizer and a run record into --output, all or nothing."""
    args = plan.args
    output = Path(args.output)
    from fusetune.integrations import transformers as hf_integration

    hf_integration.revert(model)  # save transformers' own modules, as any checkpoint
    state = distributed.full_state_dict(model, args.ranks)  # every rank takes part
    if not args.ranks.main:
        return ""
    with staged_output(output) as staging:
        model.save_pretrained(str(staging), state_dict=state)
        plan.encoder.save(staging)
        record = {
            "fusetune_version": fusetune.__version__,
            "model": plan.spec.name,
            "model_type": plan.spec.family,
            "mode": "full" if args.full else "lora",
            "precision": plan.precision.name,
            "data": plan.data_name,
            "args": {
                k: str(v) if isinstance(v, torch.device | distributed.Ranks) else v
                for k, v in vars(args).items()
            },
            "runs": [r.as_dict() for r in runs],
        }
        (staging / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        results.write_loss_curve(staging / results.LOSS_CURVE, runs)
        if args.merge:
            results.merge_adapter(plan, staging, staging / results.MERGED)
        files = sorted(p.name for p in staging.iterdir())
    what = "model" if args.full else "LoRA adapter"
    return f"{output}/ ({what}: {', '.join(files)})"
