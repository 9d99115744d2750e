"""Host time of bench e2e --nproc's eager DDP LoRA step, by function (cProfile, rank 0), to
compare world sizes: the eager fusetune step went 107 -> 144 ms from 1 to 2 ranks on 2x H200
with its CUDA time unchanged (96 ms), under DDP and FSDP2 alike.

    torchrun --nproc_per_node N tools/ddp_host_profile.py [--tiny] [--variant fusetune]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from fusetune.bench import distributed_worker as worker
from fusetune.bench.cases_e2e import SEQ_LEN, TINY_BATCH, TINY_SEQ_LEN
from fusetune.bench.harness import synchronize
from fusetune.finetune.distributed import Ranks, pin_main_thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--variant", default="fusetune")
    parser.add_argument("--engine", default="ddp", choices=("ddp", "fsdp2"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--callers", default="", help="print the callers of these functions")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="after the warm-up steps, pin this rank's main thread to a core of its own "
        "(finetune --pin-cpu's fusetune.finetune.distributed.pin_main_thread)",
    )
    parser.add_argument("--no-cprofile", action="store_true", help="median of plain steps")
    args = parser.parse_args()
    device = worker.setup()
    job = dict(engine=args.engine, mode="lora", shape="llama-3.2-1b", variant=args.variant,
               tiny=args.tiny)  # fmt: skip
    model = worker.build(job, device)
    if args.engine == "ddp":
        step = worker.ddp_step(model, device, graphed=False)
    else:
        step = worker.fsdp2_step(model, untied_head=False, replicate_adapters=True)
    batch, seq = (TINY_BATCH, TINY_SEQ_LEN) if args.tiny else (4, SEQ_LEN)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    for _ in range(4):
        step(ids)
    synchronize(device)
    if args.pin:
        pin_main_thread(Ranks(dist.get_rank(), dist.get_world_size()))
    cores = len(os.sched_getaffinity(0))
    print(f"rank {dist.get_rank()}: {cores} cores in the affinity mask, "
          f"{torch.get_num_threads()} intra-op threads", flush=True)  # fmt: skip
    if args.no_cprofile:
        report_times(step, ids, args.steps)
    else:
        report_profile(step, ids, args.steps, args.callers)
    dist.destroy_process_group()


def report_times(step, ids: torch.Tensor, steps: int) -> None:
    """min / median / max of ``steps`` plain steps (the bench's timing), on rank 0."""
    times, _ = worker.time_steps(step, ids, 0, steps)
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}: min / median / max {min(times):.1f} / "
              f"{statistics.median(times):.1f} / {max(times):.1f} ms")  # fmt: skip


def report_profile(step, ids: torch.Tensor, steps: int, callers: str) -> None:
    """cProfile of ``steps`` steps: rank 0 prints the top functions by own time (and the
    callers of ``callers``)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step(ids)
    profiler.disable()
    synchronize(ids.device)
    wall = (time.perf_counter() - start) * 1e3 / steps
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}: {wall:.1f} ms a step (profiled)")
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(25)
        if callers:
            stats.print_callers(callers)


if __name__ == "__main__":
    main()
