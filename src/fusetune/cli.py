"""python -m fusetune COMMAND: the command-line entry point.

Commands: finetune (supervised fine-tuning with fusetune applied), generate (try its result),
grpo (RL through TRL's GRPOTrainer with fusetune applied) and bench (time ops, and 'bench e2e' /
'bench e2e-grpo' whole training steps, next to their peers).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "finetune": "LoRA (or full) fine-tuning of a causal LM with fusetune applied",
    "grpo": "GRPO (RL with verifiable rewards) through TRL's GRPOTrainer with fusetune applied",
    "generate": "complete a prompt with a model and, optionally, a fine-tuned LoRA adapter",
    "bench": "time ops (or 'bench e2e [--nproc N]': whole training steps) next to torch and peers",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m fusetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        choices=list(COMMANDS),
        help="; ".join(f"{name}: {text}" for name, text in COMMANDS.items()),
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    try:
        command = parser.parse_args(argv[:1]).command
    except SystemExit as exc:  # an unknown command: argparse printed why
        return exc.code if isinstance(exc.code, int) else 2
    rest = argv[1:]
    if command == "finetune":
        from fusetune.finetune import main as finetune_main

        return finetune_main(rest)
    if command == "generate":
        from fusetune.finetune.generate import main as generate_main

        return generate_main(rest)
    if command == "grpo":
        from fusetune.grpo import main as grpo_main

        return grpo_main(rest)
    if rest[:1] == ["e2e-grpo"]:  # a GRPOTrainer optimisation step: its own runner
        from fusetune.bench.cases_e2e_grpo import main as e2e_grpo_main

        return e2e_grpo_main(rest[1:])
    if rest[:1] == ["e2e"] and any(a.split("=")[0] == "--nproc" for a in rest[1:]):
        # on N GPUs under FSDP2 / ZeRO-3: a torchrun launch per variant and size
        from fusetune.bench.distributed import main as distributed_main

        return distributed_main(rest[1:])
    if rest[:1] == ["e2e"]:  # whole training steps: its own runner (a subprocess per variant)
        from fusetune.bench.cases_e2e import main as e2e_main

        return e2e_main(rest[1:])
    from fusetune.bench import main as bench_main

    return bench_main(rest)
