"""Why fusetune's FSDP2 LoRA step is no faster than HF's (issue 16): for each variant, one
Llama-3.2-1B LoRA step under FSDP2 (bench e2e --nproc's model and wrapping) run with
``torch.cuda.set_sync_debug_mode("warn")``, printing the Python stack of every host-device sync
once; then the host time to issue a step (the step call returning, no synchronize) beside its
wall time, and a cProfile of 3 steps (own time per package, top functions).

    torchrun --nproc_per_node 1 tools/fsdp2_sync_debug.py [--variants hf,fusetune]
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
import traceback
import warnings

import torch

from fusetune.bench import distributed_worker as worker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_host import print_profile  # noqa: E402


def user_frames() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/warnings.py" not in f.filename]
    keep = [
        f
        for f in frames
        if any(k in f.filename for k in ("fusetune", "peft", "transformers", "torch/distributed"))
    ]
    return "".join(traceback.format_list(keep[-8:]))


def sync_stacks(step, ids) -> dict[str, int]:
    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        stack = f"{message}\n{user_frames()}"
        seen[stack] = seen.get(stack, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="hf,fusetune")
    parser.add_argument("--shape", default="llama-3.2-1b")
    args = parser.parse_args()
    device = worker.setup()
    for variant in args.variants.split(","):
        job = dict(engine="fsdp2", mode="lora", shape=args.shape, variant=variant, tiny=False,
                   batch=4, seq_len=2048)  # fmt: skip
        model = worker.build(job, device)
        step = worker.fsdp2_step(model, untied_head=False)
        ids = torch.randint(0, model.config.vocab_size, (4, 2048), device=device)
        for _ in range(3):
            step(ids)
        torch.cuda.synchronize()
        stacks = sync_stacks(step, ids)
        torch.cuda.synchronize()
        print(f"== {variant}: {sum(stacks.values())} syncs in one step, {len(stacks)} places")
        for stack, count in sorted(stacks.items(), key=lambda kv: -kv[1]):
            print(f"-- x{count}: {stack}")
        issue, wall = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(ids)
            issue.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - start) * 1e3)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step(ids)
        profiler.disable()
        torch.cuda.synchronize()
        print_profile(profiler, 3, 24)
        print(f"{variant}: host issue ms {sorted(round(t, 1) for t in issue)}; "
              f"wall ms {sorted(round(t, 1) for t in wall)}", flush=True)  # fmt: skip
        del model, step
        torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
