"""Where the GPU waits for the host in one LoRA training step (``bench e2e``'s model and step).

Usage (CUDA):
    PYTHONPATH=src python tools/gpu_idle.py --shape llama-3.2-1b --variant hf+peft+fusetune
    PYTHONPATH=src python tools/gpu_idle.py --gap-us 20 --top 25 --trace step.json

Profiles one step (after warm-up) with CPU and CUDA activities, then walks the GPU's kernels in
time order: every gap of at least ``--gap-us`` between one kernel's end and the next kernel's
start is time the GPU sat idle. Each gap is charged to the step's phase (forward, backward,
optimizer: ``cases_e2e.make_step``'s marks) and to the host op that launched the kernel after
it (the innermost ATen / autograd op around its launch). Prints the step's wall time, GPU busy
time, idle time per phase and the top host ops by idle time charged. A step whose idle time is
large is host-bound there: fewer launches or less Python per launch in those ops is the lever.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fusetune.bench.cases_e2e import SHAPES, STEP_PHASES, build, make_step  # noqa: E402


def load_trace(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def analyse(events: list[dict], gap_us: float, top: int) -> str:
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops_by_tid: dict[int, list[dict]] = defaultdict(list)
    phases = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "user_annotation" and e["name"] in STEP_PHASES:
            phases.append(e)
        elif e.get("cat") == "cpu_op":
            ops_by_tid[e["tid"]].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_tid.items()}

    def phase_of(ts: float) -> str:
        for p in phases:
            if p["ts"] <= ts <= p["ts"] + p["dur"]:
                return p["name"]
        return "other"

    def launcher_of(kernel: dict) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        ops, ts = ops_by_tid.get(launch["tid"], []), launch["ts"]
        i = bisect.bisect_right(starts.get(launch["tid"], []), ts)
        enclosing = [op for op in ops[max(0, i - 400) : i] if op["ts"] + op["dur"] >= ts]
        if not enclosing:
            return "?"
        names = [op["name"] for op in enclosing]
        outer = next((n for n in names if "Backward" in n or n.startswith("fusetune")), names[0])
        return f"{outer} > {names[-1]}" if outer != names[-1] else outer

    busy = sum(k["dur"] for k in kernels)
    idle_by_phase: dict[str, float] = defaultdict(float)
    idle_by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap >= gap_us:
            idle_by_phase[phase_of(k["ts"])] += gap
            entry = idle_by_op[launcher_of(k)]
            entry[0] += gap
            entry[1] += 1
        end = max(end, k["ts"] + k["dur"])
    span = end - kernels[0]["ts"]
    step = max((p["ts"] + p["dur"] for p in phases), default=end) - min(
        (p["ts"] for p in phases), default=kernels[0]["ts"]
    )
    lines = [
        f"step (host, first marker to last) {step / 1e3:.1f} ms; GPU first kernel to last "
        f"{span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, kernels {len(kernels)}",
        f"idle (gaps >= {gap_us:g} us) by phase: "
        + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in sorted(idle_by_phase.items())),
        f"{'idle ms':>8} {'gaps':>5}  host op launching the kernel after the gap",
    ]
    ranked = sorted(idle_by_op.items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"{v[0] / 1e3:8.2f} {v[1]:5d}  {k[:150]}" for k, v in ranked]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    parser.add_argument("--variant", default="hf+peft+fusetune")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--gap-us", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", default=None, help="keep the chrome trace here")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    model = build(shape, args.variant, device, tiny=False)
    batch = args.batch or shape.batch
    ids = torch.randint(0, model.config.vocab_size, (batch, 2048), device=device)
    step = make_step(model, ids, mark_phases=True)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    path = args.trace or str(Path(tempfile.mkdtemp()) / "step.json")
    prof.export_chrome_trace(path)
    print(f"{shape.name} b{batch} {args.variant}: unprofiled step {wall:.1f} ms")
    print(analyse(load_trace(path), args.gap_us, args.top))


if __name__ == "__main__":
    main()
