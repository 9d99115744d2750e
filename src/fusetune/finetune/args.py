"""Command-line options of ``python -m fusetune finetune``."""

from __future__ import annotations

import argparse
import math

import torch

from fusetune.finetune.errors import FinetuneError
from fusetune.finetune.models import DEFAULT_MODEL, TINY_MODELS
from fusetune.finetune.precision import CHOICES as PRECISIONS
from fusetune.finetune.schedule import CHOICES as SCHEDULES

DEFAULT_OUTPUT = "fusetune-finetune-output"
# Learning rates when --lr is not given: the usual ones for real checkpoints, higher for the
# random-weight tiny models so that a one-minute run visibly learns.
DEFAULT_LR = {(False, False): 2e-4, (False, True): 2e-5, (True, False): 3e-3, (True, True): 1e-3}
# --resume with no PATH: the latest checkpoint under --output.
LATEST = "latest"
# --compile MODE: torch.compile modes, and aot_eager (a backend: tracing without Inductor).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "aot_eager")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune finetune",
        description="Supervised fine-tuning (LoRA by default, or --full) of a causal LM with "
        "fusetune's kernels applied. With no options: a built-in tiny model on a built-in "
        "dataset, a minute on a CPU, nothing downloaded.",
        allow_abbrev=False,
    )
    what = parser.add_argument_group("model and data")
    what.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id, local folder, or a built-in tiny model ({', '.join(TINY_MODELS)}; "
        "random weights, byte tokenizer) (default: %(default)s)",
    )
    what.add_argument(
        "--data",
        default=None,
        metavar="FILE.jsonl",
        help="JSONL, one example a line: {'prompt', 'completion'} or {'messages': [{'role', "
        "'content'}, ...]}; the loss is on the completion / assistant turns only "
        "(default: a small dataset shipped with fusetune)",
    )
    what.add_argument("--output", default=DEFAULT_OUTPUT, help="folder (default: %(default)s)")
    how = parser.add_argument_group("training")
    how.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    how.add_argument("--lora-r", type=_positive_int, default=16, help="(default: %(default)s)")
    how.add_argument(
        "--lora-alpha", type=_positive_float, default=32.0, help="(default: %(default)s)"
    )
    how.add_argument("--steps", type=_positive_int, default=50, help="optimizer steps (50)")
    how.add_argument("--batch-size", type=_positive_int, default=4, help="per micro-batch (4)")
    how.add_argument(
        "--seq-len", type=_positive_int, default=256, help="longest example, in tokens (256)"
    )
    how.add_argument(
        "--grad-accum", type=_positive_int, default=1, help="micro-batches per step (1)"
    )
    how.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="AdamW learning rate, the peak of --lr-schedule (default: 2e-4 LoRA / 2e-5 "
        "full; 3e-3 / 1e-3 on the tiny models)",
    )
    how.add_argument(
        "--lr-schedule", choices=SCHEDULES, default="constant", help="after warmup (constant)"
    )
    how.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        default=0,
        help="linear warmup from lr/N to lr over the first N steps (0)",
    )
    how.add_argument(
        "--max-grad-norm", type=_non_negative_float, default=1.0, help="clip; 0: off (1.0)"
    )
    how.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="on",
        choices=["on", "offload"],
        default=None,
        help="recompute each layer in backward; 'offload' also keeps the layer inputs in "
        "pinned host memory (long context)",
    )
    how.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA: quantise the base's linear layers to NF4 (bitsandbytes' format, double "
        "quantisation) at load; LoRA only; needs bitsandbytes",
    )
    how.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=COMPILE_MODES,
        default=None,
        metavar="MODE",
        help="torch.compile the decoder stack after fusetune (fusetune.compile_layers): MODE "
        "default (Inductor), reduce-overhead (Inductor + CUDA graphs), max-autotune, or "
        "aot_eager (traced, no Inductor: quick, for debugging); the steps that compile are left "
        "out of tokens/s",
    )
    how.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each step from CUDA graphs (the host's launches leave the step; "
        "fusetune.graph_train_step): every batch padded to the longest example; bf16 or "
        "fp32; under torchrun, LoRA with the model replicated (--replicate)",
    )
    how.add_argument(
        "--replicate",
        action="store_true",
        help="under torchrun, LoRA: every rank holds the whole model and the adapters' "
        "gradients are averaged once a step (no FSDP2: for a base that fits one GPU, without "
        "FSDP2's per-layer work); --cuda-graph and --load-in-4bit under torchrun imply it",
    )
    how.add_argument(
        "--pin-cpu",
        action="store_true",
        help="after the first step, pin each rank's main thread to a CPU core of its own (Linux; "
        "the ranks on a host spread over the process's CPU mask): steadier host time for eager "
        "steps. Off by default: two jobs on one host would pin to the same cores",
    )
    how.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    how.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="auto: bf16 on GPUs that have it, fp16 with loss scaling on older GPUs, fp32 on "
        "the CPU (default: %(default)s)",
    )
    how.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto)")
    how.add_argument(
        "--compare",
        action="store_true",
        help="also run the same steps without fusetune and print both side by side",
    )
    _long_run_options(parser)
    return parser


def _long_run_options(parser: argparse.ArgumentParser) -> None:
    runs = parser.add_argument_group("long runs")
    runs.add_argument(
        "--save-every",
        type=_positive_int,
        default=None,
        metavar="N",
        help="write an atomic checkpoint into --output every N steps (SIGINT / SIGTERM write "
        "one too, then stop)",
    )
    runs.add_argument(
        "--keep-checkpoints", type=_positive_int, default=2, metavar="K", help="the last K (2)"
    )
    runs.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        default=None,
        metavar="PATH",
        help="continue from a checkpoint folder (default: the latest under --output; none yet: "
        "start at step 1)",
    )
    runs.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient is not finite (counted) instead of stopping",
    )
    runs.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: also write the base with the adapter merged in, to --output/merged",
    )


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse and complete the options (argparse exits with status 2 on an unknown option or
    a bad value; :class:`FinetuneError` for a device that is not there)."""
    args = build_parser().parse_args(argv)
    if args.seq_len < 2:
        build_parser().error("argument --seq-len: needs at least 2 tokens (one input, one label)")
    if args.load_in_4bit and args.full:
        build_parser().error(
            "argument --load-in-4bit: a 4-bit base is frozen; use LoRA, not --full"
        )
    if args.replicate and args.full:
        build_parser().error("argument --replicate: LoRA only (full fine-tuning shards its "
                             "gradients and optimizer state with FSDP2)")  # fmt: skip
    if args.merge and args.full:
        build_parser().error("argument --merge: merges a LoRA adapter; --full saves the model")
    if args.compare and (args.save_every or args.resume):
        build_parser().error("argument --compare: runs without checkpoints (no --save-every, "
                             "--resume)")  # fmt: skip
    if args.compile and args.gradient_checkpointing == "offload":
        build_parser().error(
            "argument --compile: not with --gradient-checkpointing offload (dynamo does not "
            "trace its saved-tensor hooks: a graph break in every layer); use "
            "--gradient-checkpointing on (with --full)"
        )
    if args.compile and args.gradient_checkpointing and not args.full:
        # measured: fusetune's fused q/k/v LoRA hands k and v from the q_proj call to the k_proj
        # and v_proj calls through its own state, which torch's traced checkpoint (a
        # higher-order op) may not write: the stack would fall back to a graph per layer
        build_parser().error(
            "argument --compile: with LoRA, not with --gradient-checkpointing (the fused q/k/v "
            "LoRA breaks the checkpointed graph in every layer); use one of them, or --full"
        )
    if args.cuda_graph:
        _check_cuda_graph(args)
    args.device = resolve_device(args.device)
    if args.lr is None:
        args.lr = DEFAULT_LR[(args.model in TINY_MODELS, args.full)]
    return args


def _check_cuda_graph(args: argparse.Namespace) -> None:
    """What a graphed step cannot do, refused before anything loads (the device, the process
    count and the precision are checked once known: finetune.command)."""
    why = {
        "--compile": args.compile and "the graphs already remove the host's launches; use one",
        "--gradient-checkpointing offload": args.gradient_checkpointing == "offload"
        and "its copies to host memory run on their own stream, outside the graph",
    }
    for option, reason in why.items():
        if reason:
            build_parser().error(f"argument --cuda-graph: not with {option}: {reason}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FinetuneError(f"--device: not a device: {name!r} (auto, cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise FinetuneError(f"--device: fusetune trains on cpu or cuda, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise FinetuneError(f"--device {name}: no CUDA GPU is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
