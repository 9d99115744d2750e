"""Sweep the LM head's rows per chunk on the GPU, at every head shape people train: fwd+bwd time
and peak memory above the inputs of linear_cross_entropy, grpo_loss and selective_log_softmax
(grads for hidden and weight, bf16, 8192 tokens), next to TRL's fused head (log-probs, and
log-probs + entropy) when trl is importable, and the floor: three matmuls at the measured rate.

Usage: PYTHONPATH=src python tools/tune_head.py [--rows 512 1024 ...] [--shapes 896x151936 ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

import fusetune
from fusetune.bench.cases_grpo import trl_head
from fusetune.ops import grpo as grpo_module
from fusetune.ops.linear_cross_entropy import chunk_rows

TOKENS = 8192
# (hidden, vocab): Qwen2.5-0.5B, Gemma 3 1B, Llama-3.2-1B, Gemma 2 2B, Qwen2.5-7B, Llama-3-8B, 70B
SHAPES = ["896x151936", "1152x262144", "2048x128256", "2304x256000", "3584x152064",
          "4096x128256", "8192x128256", "512x32000"]  # fmt: skip


def measure(step) -> tuple[float, float, float, float]:
    """(min, median, max ms, peak GiB above what was allocated before)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    times = triton.testing.do_bench(step, warmup=100, rep=400, return_mode="all")
    times = sorted(times)
    return times[0], times[len(times) // 2], times[-1], peak


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=300)
    return 2 * 8192**3 / ms / 1e9


def trl_head_step(outputs: tuple[str, ...]):
    head = trl_head()
    if head is None:
        return None

    def run(hidden, weight, ids):
        return head(hidden, weight, None, ids, 1.0, 32768, None, 1.0, outputs)[0]

    return run


def steps_for(hidden, weight, ids, rows: int):
    flat, flat_ids = hidden.view(-1, hidden.shape[-1]), ids.view(-1)
    mask = torch.rand(ids.shape, device="cuda") < 0.9
    advantages = torch.randn(ids.shape[0], device="cuda")
    with torch.no_grad():
        logps = fusetune.selective_log_softmax(hidden, weight, ids)
    old, ref = logps + 0.1 * torch.randn_like(logps), logps + 0.1 * torch.randn_like(logps)
    upstream = torch.randn(TOKENS, device="cuda")

    def clear():
        hidden.grad = weight.grad = None

    def lce():
        fusetune.linear_cross_entropy(flat, weight, flat_ids, chunk_size=rows).backward()
        clear()

    def grpo():
        options = dict(old_logps=old, ref_logps=ref, beta=0.04, loss_type="dapo", chunk_size=rows)
        loss, _ = fusetune.grpo_loss(hidden, weight, ids, mask, advantages, **options)
        loss.backward()
        clear()

    def logps_step():
        out = fusetune.selective_log_softmax(flat, weight, flat_ids, chunk_size=rows)
        out.backward(upstream)
        clear()

    return {"linear_ce": lce, "grpo": grpo, "log_probs": logps_step}


def trl_steps(hidden, weight, ids):
    flat, flat_ids = hidden.view(-1, hidden.shape[-1]), ids.view(-1)
    upstream = torch.randn(TOKENS, device="cuda")
    steps = {}
    for name, outputs in (("trl log_probs", ("log_probs",)),
                          ("trl log_probs+entropy", ("log_probs", "entropy"))):  # fmt: skip
        head = trl_head_step(outputs)
        if head is None:
            continue

        def step(head=head):
            head(flat, weight, flat_ids).backward(upstream)
            hidden.grad = weight.grad = None

        steps[name] = step
    return steps


def report(results: list, shape: tuple, name: str, rows: int, step) -> None:
    h, v, floor = shape
    try:
        lo, med, hi, gib = measure(step)
    except Exception as exc:  # noqa: BLE001 (a tool: print and go on)
        print(f"{name:<24} {rows:>6} error: {type(exc).__name__}: {str(exc)[:120]}")
        return
    row = dict(h=h, v=v, provider=name, rows=rows, min=lo, median=med, max=hi, gib=gib)
    results.append({**row, "floor": floor})
    times = f"{lo:8.2f} {med:8.2f} {hi:8.2f}"
    print(f"{name:<24} {rows:>6} {times} {gib:6.3f} {100 * floor / med:5.0f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tflops = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; bf16 matmul {tflops:.0f} TFLOP/s", flush=True)  # fmt: skip
    results = []
    for shape in args.shapes:
        h, v = map(int, shape.split("x"))
        torch.manual_seed(0)
        hidden = torch.randn(8, TOKENS // 8, h, device="cuda").to(torch.bfloat16).requires_grad_()
        weight = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(torch.bfloat16)
        weight.requires_grad_()
        ids = torch.randint(0, v, (8, TOKENS // 8), device="cuda")
        floor = 3 * 2.0 * TOKENS * h * v / tflops / 1e9
        default = chunk_rows(TOKENS, weight)
        grpo_default = chunk_rows(
            TOKENS, weight, weight_fraction=grpo_module.LOGITS_WEIGHT_FRACTION
        )
        print(f"\nH={h} V={v}: floor {floor:.2f} ms; default rows {default} (grpo {grpo_default})")
        print(f"{'provider':<24} {'rows':>6} {'min':>8} {'median':>8} {'max':>8} {'GiB':>6} floor%")

        for name, step in trl_steps(hidden, weight, ids).items():
            report(results, (h, v, floor), name, 0, step)
        for rows in sorted({default, grpo_default, *args.rows}):
            for name, step in steps_for(hidden, weight, ids, rows).items():
                report(results, (h, v, floor), name, rows, step)
        del hidden, weight
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
