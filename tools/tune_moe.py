"""GPU sweep of fusetune.moe_mlp's tile configs (ops/moe.py's TILES_16BIT), fwd+bwd, bf16.

Shapes: the bench's Qwen3-30B-A3B and gpt-oss-20b layers (fusetune/bench/cases_moe.py: 8192
tokens, frozen bf16 experts, PEFT LoRA r16 on gate_up and down). For each shape: the
transformers+PEFT grouped_mm time once (reference), then one line per config with fwd ms,
fwd+bwd ms and % of the bf16 matmul floor (forward gate_up and down plus their dx GEMMs:
2 x (2 S H 2I + 2 S I H) FLOPs, S = tokens x top-k) against the measured bf16 mm ceiling
and the H100 SXM spec (989 TFLOP/s). Then, for the best config of each shape, the CUDA time
per kernel (torch.profiler) and the frozen (no LoRA) time.

Usage (H100, < 5 minutes):  python tools/tune_moe.py [--quick] [--shapes gpt_oss,qwen3_moe]
    --tma: no sweep; the shipped tiles with FUSETUNE_MOE_TMA=0, 1 and 2 alternated, frozen and
    LoRA, and the CUDA time per kernel of each (issue 21's TMA path).
A config is (BM, BN, BK, warps, stages, group: row tiles per L2 group), set for both kernel
kinds ("glu": gate/up forward and down-gradient backward, BN = gu columns per program; "mm":
down forward, dx, LoRA GEMMs).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import triton.testing

from fusetune.bench import cases_moe
from fusetune.ops import moe

CONFIGS = [  # (BM, BN, BK, warps, stages, group)
    (64, 128, 64, 8, 3, 1),  # the first version's tiles and program order
    (64, 128, 64, 8, 3, 8),  # the default before the first sweep
    (64, 128, 64, 4, 4, 8),
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),  # the shipped default (best in both sweeps)
    (128, 128, 64, 4, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (64, 256, 64, 8, 3, 8),
    (128, 128, 64, 8, 3, 4),
    (128, 128, 64, 8, 3, 16),
]
SPEC_TFLOPS = 989.0
SHAPE_BUDGET_S = 125.0  # per shape: compiles dominate (~10 s per config); stay < 5 min


def _ceiling_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a, warmup=25, rep=100)
    return 2 * 8192**3 / ms / 1e9


def _providers(family: str, lora: bool) -> dict:
    return cases_moe._make(family, lora)(torch.device("cuda"), False)


def _set_tiles(config) -> None:
    moe.TILES_16BIT["glu"] = config
    moe.TILES_16BIT["mm"] = config


def _forward_of(step):
    """The forward alone of a bench closure (backward_step's ``step`` holds it as ``run``)."""
    names = step.__code__.co_freevars
    return step.__closure__[names.index("run")].cell_contents


def _kernel_times(step) -> str:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0)
        if total > 0:
            rows.append((total / 3 / 1e3, event.key[:60], event.count // 3))
    rows.sort(reverse=True)
    return "\n".join(f"    {ms:8.3f} ms  x{n:<3d} {name}" for ms, name, n in rows[:14])


def _sweep(family: str, ceiling: float, quick: bool) -> None:
    start = time.time()
    floor = cases_moe._floor(family)(False)
    title = cases_moe.TITLES[family]
    providers = _providers(family, True)
    label = "transformers+peft grouped_mm"
    ref = triton.testing.do_bench(providers[label], warmup=10, rep=50)
    print(
        f"\n== {title} {cases_moe.SHAPES[family]} LoRA r16, floor {floor / 1e12:.2f} TFLOP "
        f"= {floor / ceiling / 1e9:.2f} ms at {ceiling:.0f} TFLOP/s"
    )
    print(f"   {label}: {ref:.3f} ms ({100 * floor / ceiling / 1e9 / ref:.1f}% floor)")
    step = providers["fusetune"]
    forward = _forward_of(step)
    best = None
    for config in CONFIGS[:2] if quick else CONFIGS:
        if time.time() - start > SHAPE_BUDGET_S:
            print("   (time budget spent: remaining configs skipped)")
            break
        _set_tiles(config)
        try:
            with torch.no_grad():
                fwd = triton.testing.do_bench(forward, warmup=10, rep=50)
            ms = triton.testing.do_bench(step, warmup=10, rep=60)
        except Exception as error:  # noqa: BLE001 (out of resources: report and go on)
            print(f"   {config}: failed: {type(error).__name__}: {str(error)[:100]}")
            continue
        pct = 100 * floor / ceiling / 1e9 / ms
        pct_spec = 100 * floor / SPEC_TFLOPS / 1e9 / ms
        print(
            f"   {config}: fwd {fwd:7.3f} ms  fwd+bwd {ms:7.3f} ms  {pct:5.1f}% floor "
            f"({pct_spec:4.1f}% of spec)  vs grouped_mm {ref / ms:.2f}x",
            flush=True,
        )
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return
    _set_tiles(best[1])
    print(f"   best {best[1]}: {best[0]:.3f} ms; CUDA time per kernel (fwd+bwd):")
    print(_kernel_times(step))
    frozen = _providers(family, False)
    ours = triton.testing.do_bench(frozen["fusetune"], warmup=10, rep=50)
    theirs = triton.testing.do_bench(frozen["transformers grouped_mm"], warmup=10, rep=50)
    print(f"   frozen, no LoRA: fusetune {ours:.3f} ms, transformers grouped_mm {theirs:.3f} ms")


MODES = ("0", "1", "2")  # FUSETUNE_MOE_TMA: off, weights (+ sorted rows), + x / dout copied


def _tma(family: str, ceiling: float) -> None:
    """The shipped tiles with each FUSETUNE_MOE_TMA mode on the same inputs, alternated twice
    (the second round shows the machine's jitter), then CUDA time per kernel for each."""
    floor_ms = cases_moe._floor(family)(False) / ceiling / 1e9
    print(
        f"\n== {cases_moe.TITLES[family]} {cases_moe.SHAPES[family]}, tiles "
        f"{moe.TILES_16BIT['glu']}, floor {floor_ms:.2f} ms at {ceiling:.0f} TFLOP/s"
    )
    for lora in (True, False):
        step = _providers(family, lora).get("fusetune")
        if step is None:
            print(f"   {'LoRA r16' if lora else 'frozen'}: no provider (peft missing?)")
            continue
        forward = _forward_of(step)
        for _round in range(2):
            for value in MODES:
                os.environ[moe.TMA_VARIABLE] = value
                with torch.no_grad():
                    fwd = triton.testing.do_bench(forward, warmup=10, rep=50)
                ms = triton.testing.do_bench(step, warmup=10, rep=60)
                print(
                    f"   {'LoRA r16' if lora else 'frozen  '} FUSETUNE_MOE_TMA={value}: fwd "
                    f"{fwd:7.3f} ms  fwd+bwd {ms:7.3f} ms  {100 * floor_ms / ms:5.1f}% floor",
                    flush=True,
                )
        if lora:
            for value in MODES:
                os.environ[moe.TMA_VARIABLE] = value
                print(f"   CUDA time per kernel, LoRA, FUSETUNE_MOE_TMA={value}:")
                print(_kernel_times(step), flush=True)
    os.environ[moe.TMA_VARIABLE] = "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configs per shape")
    parser.add_argument("--shapes", default="gpt_oss,qwen3_moe")
    parser.add_argument(
        "--tma",
        action="store_true",
        help="no sweep: the shipped tiles under each FUSETUNE_MOE_TMA mode",
    )
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    ceiling = _ceiling_tflops()
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} triton "
        f"{triton.__version__} | bf16 mm ceiling {ceiling:.0f} TFLOP/s"
    )
    default = dict(moe.TILES_16BIT)
    for family in args.shapes.split(","):
        if args.tma:
            _tma(family, ceiling)
            continue
        _sweep(family, ceiling, args.quick)
        moe.TILES_16BIT.update(default)
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
