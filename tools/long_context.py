"""The longest sequence that trains at batch 1 on this GPU: one LoRA step (forward, backward,
AdamW) of a random-weight model with gradient checkpointing, for HF + PEFT, + Liger-Kernel, +
fusetune, + fusetune with the checkpointed layer inputs offloaded to host memory, and Unsloth
(its own checkpointing, which offloads the layer inputs; run under tools/unsloth_env.sh).

Each variant runs in its own process (Liger patches transformers for the whole process): the
sequence doubles from --start until a step runs out of memory, then a bisection to --step.

Usage: PYTHONPATH=src python tools/long_context.py [--shapes llama-3.2-1b llama-8b] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from bench_qlora import LLAMA_8B  # tools/ is on sys.path when run as a script

from fusetune.bench import cases_e2e

SHAPES = {**cases_e2e.SHAPES, "llama-8b": LLAMA_8B}
VARIANTS = ("hf+peft", "hf+peft+liger", "hf+peft+fusetune", "hf+peft+fusetune+offload", "unsloth")


def fits(model, seq_len: int, device: torch.device) -> tuple[float, float] | None:
    """(seconds, peak GiB) of one step at ``seq_len``, or None when it runs out of memory. The
    peak says how far the next length is from the GPU's memory when the time bound stops first."""
    ids = None
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
        step = cases_e2e.make_step(model, ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        del ids
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def build(shape, variant: str, device: torch.device, limit: int) -> torch.nn.Module:
    """The variant's LoRA model with its gradient checkpointing on."""
    if variant == "unsloth":  # (its checkpointing is chosen at load)
        return cases_e2e.build_unsloth(shape, False, limit, gradient_checkpointing=True)
    model = cases_e2e.build(shape, variant.removesuffix("+offload"), device, False)
    if variant.endswith("+offload"):
        from fusetune.integrations.checkpointing import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def cap_memory(cap_gib: float) -> None:
    """Every variant gets the same memory budget, a smaller GPU's, where the GPU at hand is so
    large that the step's time ends the search first. The caching allocator refuses past the
    cap as it would past the card's memory (pinned host memory, where offloading puts the
    checkpoints, is not counted on either side)."""
    index = torch.cuda.current_device()  # (the fraction wants an index, not a bare "cuda")
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), index)


def worker(
    shape_key: str, variant: str, start: int, step: int, limit: int, max_step_s: float,
    known_fit: int = 0, cap_gib: float = 0.0,
) -> dict:
    device = torch.device("cuda")
    if cap_gib:
        cap_memory(cap_gib)
    cases_e2e.SHAPES[shape_key] = SHAPES[shape_key]
    model = build(SHAPES[shape_key], variant, device, limit)
    fits(model, 2048, device)  # warm-up: compilation and autotuning are not a step's time
    good, bad, seconds, peak = known_fit, None, None, None
    length = start
    # double until out of memory, or until the next step would take longer than max_step_s
    # (attention's time grows as the square of the length: 4x a doubling)
    while length <= limit and bad is None and 4 * (seconds or 0) <= max_step_s:
        took = fits(model, length, device)
        if took is None:
            bad = length
            print(f"OOM {length}", flush=True)
        else:
            good, (seconds, peak), length = length, took, length * 2
            # (what a timed-out run still reports)
            print(f"FIT {good} {seconds:.2f} s {peak:.2f} GiB", flush=True)
    high = bad or good + step  # (no failure: the limit or the time bound stopped the doubling)
    while high - good > step:  # bisect between the last fit and the first failure
        middle = (good + high) // 2 // step * step
        took = fits(model, middle, device)
        if took is None:
            high = middle
            print(f"OOM {middle}", flush=True)
        else:
            good, (seconds, peak) = middle, took
            print(f"FIT {good} {seconds:.2f} s {peak:.2f} GiB", flush=True)
    return dict(shape=SHAPES[shape_key].name, variant=variant, max_seq_len=good,
                step_s=seconds, peak_gib=peak, memory_cap_gib=cap_gib or None,
                bound="memory" if bad else "time or limit")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["llama-3.2-1b", "llama-8b"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--step", type=int, default=8192)
    parser.add_argument("--limit", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=280)
    parser.add_argument("--max-step-s", type=float, default=20.0)
    # a length an earlier run trained: the bisection stays above it
    parser.add_argument("--known-fit", type=int, default=0)
    # train as if the GPU had this many GiB (0: all of it); every variant gets the same cap
    parser.add_argument("--memory-cap-gib", type=float, default=0.0)
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(*args.worker, args.start, args.step, args.limit, args.max_step_s,
                        args.known_fit, args.memory_cap_gib)  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    for shape in args.shapes:
        for variant in args.variants:
            sizes = [
                "--start",
                str(args.start),
                "--step",
                str(args.step),
                "--limit",
                str(args.limit),
                "--max-step-s",
                str(args.max_step_s),
                "--known-fit",
                str(args.known_fit),
                "--memory-cap-gib",
                str(args.memory_cap_gib),
            ]
            command = [sys.executable, __file__, "--worker", shape, variant, *sizes]
            try:  # the worker's FIT / OOM lines go straight to stdout: a killed run keeps them
                done = subprocess.run(command, stdout=None, stderr=subprocess.PIPE, text=True,
                                      timeout=args.timeout, check=False)  # fmt: skip
                if done.returncode:
                    tail = done.stderr.strip().splitlines()[-1:] or ["?"]
                    print(f"{shape} {variant}: error {tail[0][:200]}")
            except subprocess.TimeoutExpired:
                print(f"{shape} {variant}: timed out after {args.timeout:.0f} s")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
