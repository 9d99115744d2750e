"""Where the host (Python) time of one patched HF + PEFT LoRA training step goes.

Usage:
    PYTHONPATH=src python tools/profile_host.py                  # CUDA: Qwen2.5-0.5B shapes
    PYTHONPATH=src python tools/profile_host.py --launches       # + kernel launches per step
    python tools/profile_host.py --variant hf+peft               # PEFT alone, for comparison
    python tools/profile_host.py --layers 24 --hidden 64 ...     # any Qwen2-family shape

Builds a Qwen2-family causal LM from a config (random weights, no download), puts PEFT LoRA on
it as ``bench e2e`` does (r=16, alpha=32, q/k/v/o/gate/up/down, fp32 adapters, bf16 base and
bf16 autocast on CUDA; fp32 on the CPU) and ``fusetune.apply(model, lora=True)``, then runs
the e2e worker's step (forward with labels, backward, AdamW step): ``--warmup`` steps, ``--steps``
timed steps without a profiler (the step time; on CUDA also the host time to enqueue one step,
synchronized before, not after), then ``--steps`` steps under cProfile. Prints the top functions
by own time and by cumulative time, per step, and the own time per package (fusetune, torch,
peft, transformers, other).

Default shapes: on CUDA Qwen2.5-0.5B (24 layers, hidden 896, batch 8, sequence 2048); on the
CPU (reference path: pure-PyTorch ops, so Python per call dominates) 24 layers of tiny width,
batch 2, sequence 16, one thread (``--timer cpu`` times CPU time: steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fusetune.bench.cases_e2e import (  # noqa: E402
    SHAPES,
    TINY_CONFIG,
    VARIANTS,
    Shape,
    build,
    make_step,
)
from fusetune.bench.harness import synchronize  # noqa: E402

CPU_SHAPE = dict(TINY_CONFIG, num_hidden_layers=24)  # tiny widths, Qwen's depth
OVERRIDES = {  # option -> config key
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
}
PACKAGES = ("fusetune", "torch/distributed", "torch", "peft", "transformers", "triton")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", default="hf+peft+fusetune", choices=VARIANTS)
    for option in OVERRIDES:
        parser.add_argument(f"--{option.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40, help="functions listed per table")
    parser.add_argument(
        "--launches", action="store_true", help="CUDA: count kernel launches (torch.profiler)"
    )
    parser.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (steadier on a shared CPU machine; CPU runs only)",
    )
    return parser.parse_args(argv)


def shape_of(args: argparse.Namespace, cuda: bool) -> tuple[Shape, int, int]:
    """(shape, batch, sequence length): Qwen2.5-0.5B's on CUDA, tiny widths on the CPU, with
    the command line's overrides."""
    qwen = SHAPES["qwen2.5-0.5b"]
    config = dict(qwen.config) if cuda else {**qwen.config, **CPU_SHAPE}
    for option, key in OVERRIDES.items():
        if getattr(args, option) is not None:
            config[key] = getattr(args, option)
    if args.head_dim is None and (args.hidden is not None or args.heads is not None):
        config.pop("head_dim", None)  # transformers' default: hidden / heads
    batch = args.batch or (qwen.batch if cuda else 2)
    seq_len = args.seq_len or (2048 if cuda else 16)
    return Shape("profile", qwen.model_type, config, batch), batch, seq_len


def time_steps(
    step: Callable, device: torch.device, count: int, clock: Callable = time.perf_counter
) -> tuple[list, list]:
    """(step ms, host ms) per step: synchronized before each; the host time ends when step()
    returns (work still queued on the GPU is not in it), the step time after a sync."""
    steps, hosts = [], []
    for _ in range(count):
        synchronize(device)
        start = clock()
        step()
        host = clock()
        synchronize(device)
        end = clock()
        steps.append((end - start) * 1e3)
        hosts.append((host - start) * 1e3)
    return steps, hosts


def package_of(filename: str) -> str:
    for package in PACKAGES:
        if f"/{package}/" in filename:
            return package
    return "other"


def print_profile(profiler: cProfile.Profile, steps: int, top: int) -> None:
    stats = pstats.Stats(profiler)
    by_package: dict[str, float] = defaultdict(float)
    calls_by_package: dict[str, int] = defaultdict(int)
    for (filename, _, _), (_, calls, own, _, _) in stats.stats.items():
        by_package[package_of(filename)] += own
        calls_by_package[package_of(filename)] += calls
    total = sum(by_package.values())
    print(f"\ncProfile: {total / steps * 1e3:.1f} ms of profiled time per step (with overhead)")
    print("own time per step by package:")
    for package, seconds in sorted(by_package.items(), key=lambda kv: -kv[1]):
        calls = calls_by_package[package] / steps
        print(f"  {package:<13} {seconds / steps * 1e3:8.2f} ms  {calls:9.0f} calls")
    for key, title in (("tottime", "own time"), ("cumtime", "cumulative time")):
        print(f"\ntop {top} by {title} (ms per step; calls per step):")
        print_table(stats, key, steps, top)
    print(f"\nfusetune's top {top // 2} by own time (ms per step; calls per step):")
    print_table(stats, "tottime", steps, top // 2, package="fusetune")


def print_table(
    stats: pstats.Stats, key: str, steps: int, top: int, package: str | None = None
) -> None:
    column = {"tottime": 2, "cumtime": 3}[key]
    items = [
        item for item in stats.stats.items() if package is None or package_of(item[0][0]) == package
    ]
    rows = sorted(items, key=lambda item: -item[1][column])[:top]
    print(f"  {'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for (filename, line, name), (_, calls, own, cumulative, _) in rows:
        where = short_path(filename)
        print(
            f"  {own / steps * 1e3:8.2f} {cumulative / steps * 1e3:8.2f} {calls / steps:7.0f}"
            f"  {name} ({where}:{line})"
        )


def short_path(filename: str) -> str:
    for marker in ("/site-packages/", "/src/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def count_launches(step: Callable, device: torch.device) -> None:
    """Kernels and launch calls of one step (torch.profiler, CPU + CUDA activities)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    launches = kernels = 0
    for event in prof.key_averages():
        if "LaunchKernel" in event.key or "cuLaunch" in event.key:
            launches += event.count
        device_us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))
        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += event.count
    print(f"\none step: {launches} kernel launch calls, {kernels} GPU kernels")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.timer == "cpu" and cuda:
        raise SystemExit("--timer cpu is for CPU runs (a GPU step's time is wall time)")
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    if not cuda:
        torch.set_num_threads(1)  # tiny tensors: threads add noise, not speed
    shape, batch, seq_len = shape_of(args, cuda)
    model = build(shape, args.variant, device, tiny=False)
    input_ids = torch.randint(0, shape.config["vocab_size"], (batch, seq_len), device=device)
    step = make_step(model, input_ids)
    config = ", ".join(f"{k}={v}" for k, v in shape.config.items() if k in OVERRIDES.values())
    print(f"{args.variant} on {device} ({torch.cuda.get_device_name(device) if cuda else 'CPU'})")
    print(f"torch {torch.__version__}; qwen2 {config}; batch {batch} x seq {seq_len}")
    time_steps(step, device, args.warmup)
    step_ms, host_ms = time_steps(step, device, args.steps, clock)
    print(
        f"step ({args.timer} time): median {statistics.median(step_ms):.1f} ms (all: "
        f"{', '.join(f'{t:.1f}' for t in step_ms)})"
    )
    if cuda:
        print(f"host time to enqueue a step: median {statistics.median(host_ms):.1f} ms")
    if cuda and args.launches:
        count_launches(step, device)
    profiler = cProfile.Profile(clock)
    profiler.enable()
    time_steps(step, device, args.steps, clock)
    profiler.disable()
    print_profile(profiler, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
