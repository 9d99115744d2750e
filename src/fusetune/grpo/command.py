"""``python -m fusetune grpo``: GRPO (and DAPO, Dr. GRPO, GSPO, ...) with TRL's GRPOTrainer and
fusetune applied to it (``fusetune.apply(trainer)``: the model's backbone and TRL's LM head).

With no options: the built-in tiny Llama (random weights, byte tokenizer) on a small shipped
arithmetic prompt set, rewarded for an exact answer and for answering in digits; about a minute
on a CPU, nothing downloaded. The output folder (adapter or model, tokenizer, a run record) is
written all at once at the end; bad input exits with status 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import fusetune
from fusetune.finetune import models
from fusetune.finetune.args import (
    _non_negative_float,
    _positive_float,
    _positive_int,
    resolve_device,
)
from fusetune.finetune.command import _add_lora, _release
from fusetune.finetune.distributed import Ranks, finish, full_state_dict
from fusetune.finetune.errors import FinetuneError
from fusetune.finetune.output import MARKER, check_output, checkpoint_folders, staged_output
from fusetune.finetune.precision import CHOICES as PRECISIONS
from fusetune.finetune.precision import bf16_supported, choose_precision
from fusetune.finetune.progress import format_duration, format_memory, peak_memory
from fusetune.grpo import data, rewards, zero3
from fusetune.integrations.trl import FusedHead

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
DEFAULT_OUTPUT = "fusetune-grpo-output"
SUMMARY_STEPS = 5  # steps averaged for the first / last mean reward


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune grpo",
        description="GRPO with TRL's GRPOTrainer and fusetune applied. With no options: a "
        "built-in tiny model on built-in arithmetic prompts, a minute on a CPU.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model", default=models.DEFAULT_MODEL, help="hub id, local folder or tiny model"
    )
    parser.add_argument(
        "--data", metavar="FILE.jsonl", help="{'prompt', 'answer'} lines (default: arithmetic)"
    )
    parser.add_argument("--reward", action="append", default=None, metavar="NAME",
                        help=f"built-in ({', '.join(rewards.BUILTIN)}) or module:function; "
                        f"repeatable (default: {' + '.join(rewards.DEFAULT)})")  # fmt: skip
    parser.add_argument("--loss-type", choices=LOSS_TYPES, default="dapo")
    parser.add_argument("--num-generations", type=_positive_int, default=4)
    parser.add_argument("--max-completion-length", type=_positive_int, default=8)
    parser.add_argument("--beta", type=_non_negative_float, default=0.0, help="KL coefficient")
    parser.add_argument("--temperature", type=_positive_float, default=1.0)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--lora-r", type=_positive_int, default=16)
    parser.add_argument("--lora-alpha", type=_positive_float, default=32.0)
    parser.add_argument("--steps", type=_positive_int, default=30)
    parser.add_argument(
        "--batch-size", type=_positive_int, default=16, help="completions a step (16)"
    )
    parser.add_argument(
        "--lr", type=_positive_float, help="default 1e-5; tiny models 2e-2 LoRA, 3e-3 full"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--save-every", type=_positive_int, default=None, metavar="N",
                        help="a checkpoint (TRL's: adapter or model, optimizer, scheduler, RNG "
                             "states, step) in OUTPUT/checkpoint-<step> every N steps")  # fmt: skip
    parser.add_argument("--keep-checkpoints", type=_positive_int, default=2, metavar="K")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                        help="continue from PATH, or from OUTPUT's latest checkpoint")  # fmt: skip
    parser.add_argument(
        "--compare", action="store_true", help="first the same run without fusetune"
    )
    sharding = parser.add_mutually_exclusive_group()
    sharding.add_argument("--fsdp", action="store_true",
                          help="under torchrun / accelerate launch: shard the model with FSDP2 "
                               "(accelerate's plugin: each decoder layer, then the root) instead "
                               "of replicating it on every rank")  # fmt: skip
    sharding.add_argument("--zero3", action="store_true",
                          help="under torchrun / accelerate launch: partition the model with "
                               "DeepSpeed ZeRO-3 (needs deepspeed) instead of replicating it "
                               "on every rank")  # fmt: skip
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size % args.num_generations:
        parser.error(
            f"argument --batch-size: {args.batch_size} is not a multiple of --num-generations "
            f"{args.num_generations}"
        )
    if args.num_generations < 2:
        parser.error("argument --num-generations: GRPO compares at least 2 completions a prompt")
    if args.fsdp and world_size() == 1:
        parser.error("argument --fsdp: shards over ranks; run under torchrun --nproc-per-node N "
                     "or accelerate launch")  # fmt: skip
    if args.zero3 and world_size() == 1:
        parser.error("argument --zero3: partitions over ranks; run under torchrun "
                     "--nproc-per-node N or accelerate launch")  # fmt: skip
    if args.zero3 and not zero3.available():
        parser.error("argument --zero3: needs DeepSpeed, which is not installed (pip install "
                     "deepspeed)")  # fmt: skip
    if args.batch_size % world_size():
        parser.error(f"argument --batch-size: {args.batch_size} (the global batch) does not "
                     f"split over {world_size()} ranks")  # fmt: skip
    args.device = resolve_device(one_visible_gpu(args.device))
    if args.device.type == "cuda" and "LOCAL_RANK" in os.environ:  # torchrun: a GPU a rank
        args.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if args.lr is None:
        tiny = args.model in models.TINY_MODELS
        args.lr = (3e-3 if args.full else 2e-2) if tiny else 1e-5
    return args


def one_visible_gpu(device: str) -> str:
    """Without torchrun the run trains on one GPU: transformers' Trainer wraps the model in
    nn.DataParallel when one process sees several GPUs, and TRL's GRPOTrainer refuses that. So
    the process is shown only the GPU ``--device`` names (the first for auto / cuda), set before
    CUDA starts; returns the device to use then. Left alone: torchrun, a CUDA_VISIBLE_DEVICES
    already set, the CPU, CUDA already started (TRL's own error then says what to do)."""
    if (
        world_size() > 1
        or "CUDA_VISIBLE_DEVICES" in os.environ
        or torch.cuda.is_initialized()
        or not device.startswith(("auto", "cuda"))
    ):
        return device
    name, _, index = device.partition(":")
    if index and not index.isdigit():
        return device  # resolve_device names the bad argument
    os.environ["CUDA_VISIBLE_DEVICES"] = index or "0"
    return name


def world_size() -> int:
    """Ranks under torchrun / accelerate launch (1 otherwise): TRL's GRPOTrainer runs on
    each through accelerate (DDP), each rank on its share of every step's prompts."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_rank() -> bool:
    """Rank 0 (or no torchrun): the one that prints and writes the output."""
    return int(os.environ.get("RANK", "0")) == 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*")
            return run(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    check_output(Path(args.output), resuming=args.resume is not None)
    if isinstance(args.resume, str) and not (Path(args.resume) / "trainer_state.json").is_file():
        raise FinetuneError(f"--resume {args.resume}: not a checkpoint (no trainer_state.json)")
    prompts, data_name = data.load_prompts(args.data)
    reward_functions = [rewards.resolve(name) for name in (args.reward or rewards.DEFAULT)]
    spec = models.resolve(args.model)
    precision = choose_precision(args.precision, args.device.type, bf16_supported(args.device))
    if args.zero3:
        zero3.check_precision(precision.name, args.device)
    tokenizer = tiny_tokenizer() if spec.tiny else _hf_tokenizer(spec)
    mode = "full" if args.full else f"LoRA r={args.lora_r} alpha={args.lora_alpha:g}"
    ranks = f"; {world_size()} ranks" if world_size() > 1 else ""
    ranks += " (FSDP2)" if args.fsdp else " (DeepSpeed ZeRO-3)" if args.zero3 else ""
    if main_rank():
        print(f"model: {spec.name} ({spec.family}), {mode}; data: {data_name}, {len(prompts)} "
              f"prompts; rewards: {', '.join(args.reward or rewards.DEFAULT)}; {args.loss_type}, "
              f"{args.num_generations} generations, beta {args.beta:g}; {precision.describe()}"
              f"{ranks}",
              file=sys.stderr)  # fmt: skip
    runs = []
    if args.compare:
        runs.append(train_once(args, spec, precision, tokenizer, prompts, reward_functions, False))
    fused = train_once(args, spec, precision, tokenizer, prompts, reward_functions, True)
    runs.append(fused)
    trainer = fused.pop("trainer")
    state = None  # every rank takes part in gathering a sharded model's state
    if args.fsdp:
        state = gathered_state(trainer.model)
    elif args.zero3:
        state = zero3.gathered_state(trainer.model, args.full)
    try:
        if main_rank():
            report(args, spec, trainer, tokenizer, runs, state)
    finally:  # every rank waits for rank 0's output, then leaves the process group
        finish(Ranks(int(os.environ.get("RANK", "0")), world_size()))
    return 0


def report(args, spec, trainer, tokenizer, runs, state: dict | None) -> None:
    """Rank 0: the output folder, then a summary line a run."""
    saved = save(args, spec, trainer, tokenizer, runs, state)
    for result in runs:
        result.pop("trainer", None)
        print(format_run(result))
    print(f"saved: {saved}")


def train_once(args, spec, precision, tokenizer, prompts, reward_functions, fused: bool) -> dict:
    import datasets
    import transformers
    import trl

    _release(args.device)
    if args.zero3:
        zero3.forget_earlier_config()
    model = models.build(spec, precision.weight_dtype(args.full), args.device, args.seed)
    model = model.requires_grad_(True) if args.full else _add_lora(model, args)
    label = ("TRL + fusetune" if fused else "TRL") + (" (full)" if args.full else " + PEFT")
    saving = fused and args.save_every is not None  # checkpoints: the fusetune run's only
    output_dir = args.output if saving else tempfile.mkdtemp(prefix="fusetune-grpo-")
    config = trl.GRPOConfig(
        output_dir=output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size // world_size(),
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, beta=args.beta,
        temperature=args.temperature, loss_type=args.loss_type, seed=args.seed,
        bf16=precision.name == "bf16", fp16=precision.name == "fp16",
        use_cpu=args.device.type == "cpu" and not args.zero3,  # zero3.options says why
        logging_steps=1,
        save_strategy="steps" if saving else "no", save_steps=args.save_every or 500,
        save_total_limit=args.keep_checkpoints,
        report_to="none", disable_tqdm=True, **fsdp_options(args), **zero3.options(args),
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward_functions, args=config,
        train_dataset=datasets.Dataset.from_list(prompts), processing_class=tokenizer,
    )  # fmt: skip
    if args.fsdp and not trainer.is_fsdp_enabled:
        raise FinetuneError(unsharded_reason(trainer))
    if args.zero3:
        zero3.check_enabled(trainer, args.device)
    if fused:
        fusetune.apply(trainer)
    progress = Progress(args.steps, label, args.device)
    trainer.remove_callback(transformers.PrinterCallback)  # our progress line instead
    trainer.add_callback(progress)
    start, head_calls = time.perf_counter(), FusedHead.calls
    try:
        trainer.train(resume_from_checkpoint=_resume_point(args) if fused else None)
    finally:
        progress.close()
        if fused:
            fusetune.revert(trainer)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    memory, kind = peak_memory(args.device)
    return dict(
        label=label,
        seconds=time.perf_counter() - start,
        rewards=[e["reward"] for e in logs],
        kl=[e.get("kl", 0.0) for e in logs],
        losses=[e["loss"] for e in logs],
        entropy=[e.get("entropy", 0.0) for e in logs],
        grad_norms=[e.get("grad_norm", 0.0) for e in logs],
        tokens=progress.tokens,
        fused_head_calls=FusedHead.calls - head_calls,  # TRL head calls fusetune served
        sharded_parameters=sharded_parameters(trainer.model),  # FSDP2's DTensors (0: none)
        partitioned_parameters=zero3.partitioned_parameters(trainer.model),  # ZeRO-3's
        peak_memory=format_memory(memory, kind),
        trainer=trainer,
    )


def sharded_parameters(model: torch.nn.Module) -> int:
    """How many of ``model``'s parameters FSDP2 shards (DTensors): the check that ``--fsdp``
    sharded the model rather than replicating it."""
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in model.parameters())


def unsharded_reason(trainer) -> str:
    """Why ``--fsdp`` cannot shard here: accelerate turns its FSDP plugin on for multi-device
    accelerator runs only (1.15: GPUs, NPUs, XPUs, ...); on CPU ranks (gloo) it would run DDP,
    every rank a full replica, so the command stops rather than replicate silently."""
    import accelerate

    kind = trainer.accelerator.state.distributed_type
    return (f"--fsdp: accelerate {accelerate.__version__} does not shard on this device "
            f"({kind.value}: its FSDP plugin is enabled for multi-GPU runs only); without "
            "--fsdp the ranks run data parallel (DDP)")  # fmt: skip


def fsdp_options(args) -> dict:
    """GRPOConfig's FSDP2 settings for ``--fsdp``: accelerate's plugin wraps every decoder layer
    (the model's ``_no_split_modules``), then the root, where the lm_head stays: the root's
    forward gathers it and TRL's head, served by fusetune, reads the unsharded weight."""
    if not args.fsdp:
        return {}
    # activation checkpointing through FSDP's own wrapper (the trainer's argument would gather
    # each layer's shards once more in the backward, transformers warns)
    settings = {"version": 2, "reshard_after_forward": True, "activation_checkpointing": True}
    return {"fsdp": True, "fsdp_config": settings, "gradient_checkpointing": False}


def _resume_point(args) -> str | None:
    """``--resume``'s checkpoint: its PATH, or the output's latest (None: none yet, step 1)."""
    if args.resume is None or isinstance(args.resume, str):
        return args.resume
    latest = checkpoint_folders(Path(args.output))
    return str(max(latest, key=lambda p: int(p.name.rsplit("-", 1)[-1]))) if latest else None


class Progress:
    """A TRL/transformers callback printing one line a step (about ten over a run when not a
    terminal): reward, kl, clip ratio, tokens/s, peak memory, time."""

    def __init__(self, total: int, label: str, device: torch.device):
        self.total, self.label, self.device = total, label, device
        self.start = time.perf_counter()
        self.tokens = 0
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 10)

    def __getattr__(self, name: str):  # the other TrainerCallback events: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs or not state.is_world_process_zero:
            return
        self.tokens = int(logs.get("num_tokens", self.tokens))
        step, elapsed = state.global_step, time.perf_counter() - self.start
        memory = format_memory(*peak_memory(self.device))
        clip = logs.get("clip_ratio/region_mean", logs.get("cispo_clip_ratio", 0.0))
        line = (f"{self.label} {step}/{self.total} reward {logs['reward']:.3f} kl "
                f"{logs.get('kl', 0.0):.4f} clip {clip:.3f} | {self.tokens / elapsed:,.0f} tok/s "
                f"| peak {memory} | {format_duration(elapsed)}")  # fmt: skip
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        elif step == 1 or step % self.every == 0 or step == self.total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def format_run(result: dict) -> str:
    rewards_seen = result["rewards"] or [float("nan")]
    first = statistics.fmean(rewards_seen[:SUMMARY_STEPS])
    last = statistics.fmean(rewards_seen[-SUMMARY_STEPS:])
    speed = result["tokens"] / result["seconds"]
    return (f"{result['label']}: mean reward {first:.3f} over the first {SUMMARY_STEPS} steps -> "
            f"{last:.3f} over the last {SUMMARY_STEPS}; {speed:,.0f} tokens/s; peak "
            f"{result['peak_memory']}; {format_duration(result['seconds'])}")  # fmt: skip


def gathered_state(model: torch.nn.Module) -> dict | None:
    """The FSDP2-sharded model's full state dict on rank 0 (CPU tensors; a collective: every
    rank calls it), for a consolidated adapter or model. None on one process."""
    ranks = Ranks(int(os.environ.get("RANK", "0")), world_size())
    return full_state_dict(model, ranks)


# torch's checkpoint_wrapper (FSDP2's activation checkpointing) holds each layer under this
# name: module paths keep it, state_dict keys drop it
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def save_pretrained(model: torch.nn.Module, folder: Path, state: dict | None) -> None:
    """``model.save_pretrained``, with ``state`` (a gathered full state dict) for a sharded model.

    PEFT (0.21) picks a state dict's adapter entries by module path, and under FSDP2's
    activation checkpointing a path holds ``_checkpoint_wrapped_module.`` where the state key
    does not: it found none and saved an empty adapter. So PEFT gets the state keyed by module
    path, and the segment leaves the saved names (those of an unwrapped model) afterwards."""
    paths = {}  # state key -> module path, where they differ
    if state is not None and hasattr(model, "peft_config"):
        wrapped = [name for name, _ in model.named_parameters() if _CHECKPOINT_WRAPPED in name]
        paths = {name.replace(_CHECKPOINT_WRAPPED, ""): name for name in wrapped}
    if not paths:
        model.save_pretrained(str(folder), state_dict=state)
        return
    from safetensors.torch import load_file, save_file

    model.save_pretrained(str(folder), state_dict={paths.get(k, k): v for k, v in state.items()})
    for file in folder.glob("adapter_model*.safetensors"):
        adapter = load_file(str(file))
        save_file({k.replace(_CHECKPOINT_WRAPPED, ""): v for k, v in adapter.items()}, str(file),
                  metadata={"format": "pt"})  # fmt: skip


def save(args, spec, trainer, tokenizer, runs, state: dict | None = None) -> str:
    """Rank 0 writes the output; ``state``: the gathered state dict of a sharded model."""
    output = Path(args.output)
    with staged_output(output) as staging:
        save_pretrained(trainer.model, staging, state)
        tokenizer.save_pretrained(str(staging))
        options = {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items()}
        record = {
            "fusetune_version": fusetune.__version__, "command": "grpo", "model": spec.name,
            "args": options, "runs": [{k: v for k, v in r.items() if k != "trainer"} for r in runs],
        }  # fmt: skip
        (staging / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        files = sorted(p.name for p in staging.iterdir())
    return f"{output}/ ({', '.join(files)})"


def tiny_tokenizer():
    """The byte tokenizer of the built-in tiny models as a transformers tokenizer (TRL needs
    one): ids 0-255 are the bytes, 256/257/258 pad, BOS and EOS, as in
    :class:`fusetune.finetune.tokenizers.ByteTokenizer`."""
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte map

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab.update({"<pad>": 256, "<s>": 257, "</s>": 258})
    backend = Tokenizer(tokenizer_models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def _hf_tokenizer(spec):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(spec.name)
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"--model {spec.name!r}: no usable tokenizer: {exc}") from None
