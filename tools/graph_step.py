"""How much of a LoRA training step is the host's: the same step (forward with labels, backward,
fused AdamW) timed eager, then replayed from one CUDA graph of the whole step, on twin models
built from one seed (issue 18's LoRA step, issue 22's QLoRA step: both host-bound in the forward).

The graph is fusetune.graph_train_step's (three eager warm-up steps on a side stream, then
the whole step captured once and replayed; AdamW with ``capturable=True``). The batch is fixed.
Each step is synchronized, as ``bench e2e`` times it. The twins' losses are printed side by
side: the graph must train as eager does (a capture that silently drops work would show here).
``--profile`` adds each way's CUDA time by kernel (CUPTI sees the kernels inside a replay):
how the 2026-11-27 twelfth session found transformers' explicit mask inside the capture.

Usage (GPU):
    PYTHONPATH=src:tools python tools/graph_step.py --shape llama-3.2-1b --batch 4
    PYTHONPATH=src:tools python tools/graph_step.py --qlora           # NF4 base, bitsandbytes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fusetune.bench import cases_e2e
from fusetune.graphed_step import DEFAULT_WARMUP

GIB = 2**30


def build(shape: cases_e2e.Shape, variant: str, qlora: bool) -> torch.nn.Module:
    if qlora:
        import bench_qlora  # (tools/: run with tools on the path)

        return bench_qlora.build(shape, variant, None)
    name = {"fusetune": "hf+peft+fusetune", "hf": "hf+peft"}[variant]
    return cases_e2e.build(shape, name, torch.device("cuda"), tiny=False)


def _body(model, input_ids, optimizer):
    def body() -> torch.Tensor:
        # (autocast's cast cache is off: cached casts would outlive the captured region)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return body


def eager_step(model, input_ids, warmup: int = DEFAULT_WARMUP):
    """(step, the warm-up steps' losses): as ``graphed_step``, every step eager."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    body = _body(model, input_ids, optimizer)

    def step() -> torch.Tensor:
        loss = body()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, [step() for _ in range(warmup)]


def graphed_step(model, input_ids):
    """(step, the warm-up steps' losses): bench e2e's step through fusetune.graph_train_step,
    its eager steps taken; its next call captures, and every later one replays."""
    step = cases_e2e.make_step(model, input_ids, graph=True)
    return step, [step() for _ in range(DEFAULT_WARMUP)]


def run(args, how: str) -> dict:
    shape = cases_e2e.SHAPES[args.shape]
    model = build(shape, args.variant, args.qlora)
    torch.manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, cases_e2e.SEQ_LEN),
                              device="cuda")  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step, losses = (graphed_step if how == "graph" else eager_step)(model, input_ids)
    setup_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    timed = times[args.untimed :]
    if args.profile:  # (CUPTI traces the kernels inside a replayed graph too)
        profile = cases_e2e.profile_step(step)
        print(f"profile {how}: " + json.dumps(profile), flush=True)
    median = statistics.median(timed)
    result = dict(
        how=how, shape=shape.name, variant=args.variant + ("+qlora" if args.qlora else ""),
        batch=args.batch, min_ms=min(timed), step_ms=median, max_ms=max(timed),
        tokens_per_s=args.batch * cases_e2e.SEQ_LEN / median * 1e3,
        peak_gib=torch.cuda.max_memory_allocated() / GIB, setup_s=setup_s,
        losses=[round(float(loss), 5) for loss in losses],
    )  # fmt: skip
    del step, model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(cases_e2e.SHAPES), default="llama-3.2-1b")
    parser.add_argument("--variant", choices=["fusetune", "hf"], default="fusetune")
    parser.add_argument("--qlora", action="store_true", help="NF4 base (bench_qlora's build)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=23, help="steps after the 3 of setup")
    parser.add_argument("--untimed", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="CUDA time by kernel, each way")
    args = parser.parse_args()
    results = []
    for how in ("eager", "graph"):
        try:
            results.append(run(args, how))
        except Exception as error:  # noqa: BLE001 (a capture that fails: say why, go on)
            print(f"{how} failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
            return
        print("RESULT " + json.dumps(results[-1]), flush=True)
    eager, graph = (r["losses"] for r in results)
    gap = max(abs(a - b) for a, b in zip(eager, graph, strict=True))
    print(f"largest loss gap, step by step (eager vs graph twins): {gap:.2e}", flush=True)


if __name__ == "__main__":
    main()
