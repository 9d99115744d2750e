"""Gated DeltaNet chunk mode on the GPU: fwd+bwd and forward ms, peak memory, per product mode
(FUSETUNE_GDR_DOT=split3 (the default) | ieee, read at every call) beside transformers' torch chunk
loop, at the issue's Qwen3.5-like shape (B4 T4096 H16 D128, bf16), plus the split modes'
distance to IEEE and split3's time per kernel.

    PYTHONPATH=src:tests python tools/gdr_modes_bench.py [--batch 4 --seq-len 4096]

Inputs as bench/cases_gated_delta_rule.py makes them (raw q, k with use_qk_l2norm_in_kernel,
fp32 g, bf16 beta). Rows "... no-l2norm" pass unit-norm bf16 q, k without the flag. Since the
eighth session of 2026-11-26 the chunk kernels normalise q and k themselves (before, q and k
reached them in fp32, normalised in torch, and their products ran split): the two rows should
now be close.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.cases_gated_delta_rule import _inputs, _transformers_torch

HEADS, DIM = 16, 128


def timed(fn, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` runs after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """Peak memory of one ``fn`` call above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def make_run(forward, leaves, grad_out):
    def fwd_bwd():
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad_out)

    def fwd_only():
        with torch.no_grad():
            forward()

    return fwd_bwd, fwd_only


def ours(leaves, mode: str, l2norm: bool):
    def forward():
        os.environ["FUSETUNE_GDR_DOT"] = mode
        return fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=l2norm)[0]

    return forward


def results(forward, leaves, grad_out) -> list[torch.Tensor]:
    for leaf in leaves:
        leaf.grad = None
    out = forward()
    out.backward(grad_out)
    return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]


def relative_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    gaps = ((x - y).abs().max() / y.abs().max().clamp_min(1e-30) for x, y in zip(a, b, strict=True))
    return "  ".join(f"{n} {g.item():.1e}" for n, g in zip(names, gaps, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--split3-only",
        metavar="SAVE",
        help="time split3 (l2norm) alone and save its output "
        "and gradients to SAVE (a .pt), to compare two source trees run one after the other",
    )
    parser.add_argument(
        "--modes",
        metavar="A,B",
        help="time these FUSETUNE_GDR_DOT modes alone (l2norm), print "
        "each one's gaps to the first and the last one's GPU time per kernel (e.g. split3,tf32)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.seq_len, HEADS, DIM)
    leaves = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    grad_out = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    unit = [
        F.normalize(x.detach().float(), dim=-1).to(x.dtype).requires_grad_() for x in leaves[:2]
    ]
    unit_leaves = unit + leaves[2:]
    if args.split3_only:
        split3_only(ours(leaves, "split3", True), leaves, grad_out, args)
        return
    if args.modes:
        compare_modes(args.modes.split(","), leaves, grad_out, args)
        return
    # The torch loop and the IEEE baseline first: a CUDA fault in split3 ends the process.
    providers = {"fusetune ieee": (ours(leaves, "ieee", True), leaves)}
    torch_loop = _transformers_torch()
    if torch_loop is not None:
        providers["transformers-torch"] = (
            lambda: torch_loop(*leaves, use_qk_l2norm_in_kernel=True)[0],
            leaves,
        )
    providers["fusetune split3"] = (ours(leaves, "split3", True), leaves)
    providers["fusetune split3 no-l2norm"] = (ours(unit_leaves, "split3", False), unit_leaves)
    providers["fusetune ieee no-l2norm"] = (ours(unit_leaves, "ieee", False), unit_leaves)
    print(f"B{args.batch} T{args.seq_len} H{HEADS} D{DIM} bf16, median of {args.repeats}")
    rows = []
    for name, (forward, inputs) in providers.items():
        fwd_bwd, fwd_only = make_run(forward, inputs, grad_out)
        row = (name, timed(fwd_bwd, args.repeats), timed(fwd_only, args.repeats), peak_mib(fwd_bwd))
        print(
            f"done: {name}: {row[1]:.2f} ms fwd+bwd, {row[2]:.2f} ms fwd, {row[3]:.0f} MiB",
            flush=True,
        )
        rows.append(row)
    for ieee, split in (
        ("fusetune ieee", "fusetune split3"),
        ("fusetune ieee no-l2norm", "fusetune split3 no-l2norm"),
    ):
        inputs = providers[ieee][1]
        gap = relative_gap(
            results(providers[split][0], inputs, grad_out),
            results(providers[ieee][0], inputs, grad_out),
        )
        print(f"{split} vs {ieee}, max abs gap / max abs: {gap}")
    base = dict((r[0], r[1]) for r in rows).get("transformers-torch")
    header = ("provider", "fwd+bwd ms", "fwd ms", "peak MiB", "vs torch")
    print("\n{:28s} {:>11s} {:>8s} {:>9s} {:>9s}".format(*header))
    for name, both, fwd, peak in rows:
        speedup = f"{base / both:8.1f}x" if base else "-"
        print(f"{name:28s} {both:11.2f} {fwd:8.2f} {peak:9.0f} {speedup:>9s}")
    print("\nsplit3 (l2norm), one fwd+bwd step, GPU time per kernel:")
    profile(*providers["fusetune split3"], grad_out)


def split3_only(forward, leaves, grad_out, args) -> None:
    fwd_bwd, fwd_only = make_run(forward, leaves, grad_out)
    times = [timed(fwd_bwd, args.repeats) for _ in range(3)]
    print(
        f"split3 l2norm B{args.batch} T{args.seq_len}: fwd+bwd ms min/median/max of 3 medians "
        f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}; "
        f"fwd {timed(fwd_only, args.repeats):.2f} ms; peak {peak_mib(fwd_bwd):.0f} MiB"
    )
    torch.save([t.cpu() for t in results(forward, leaves, grad_out)], args.split3_only)
    profile(forward, leaves, grad_out)


def compare_modes(modes: list[str], leaves, grad_out, args) -> None:
    first = None
    for mode in modes:
        forward = ours(leaves, mode, True)
        fwd_bwd, fwd_only = make_run(forward, leaves, grad_out)
        times = [timed(fwd_bwd, args.repeats) for _ in range(3)]
        got = results(forward, leaves, grad_out)
        first = first or got
        print(
            f"{mode} l2norm B{args.batch} T{args.seq_len}: fwd+bwd ms min/median/max of 3 "
            f"medians {min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}; fwd "
            f"{timed(fwd_only, args.repeats):.2f} ms; peak {peak_mib(fwd_bwd):.0f} MiB; "
            f"gaps to {modes[0]}: {relative_gap(got, first)}",
            flush=True,
        )
    profile(forward, leaves, grad_out)


def profile(forward, leaves, grad_out) -> None:
    """GPU time per kernel of one split3 fwd+bwd step (where the time goes)."""
    fwd_bwd, _ = make_run(forward, leaves, grad_out)
    fwd_bwd()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    for key in ("self_device_time_total", "self_cuda_time_total"):  # newer / older torch
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=14))
            return
        except (AttributeError, KeyError, ValueError):
            continue


if __name__ == "__main__":
    main()
