"""fp32 error of the chunk GSA kernels, gradients included, against naive in float64, for one
16-token block whose gates drop by a given amount (the factorised diagonal up to
chunk.FAST_DROP, the exact decay-column loops past it). Prints one row per drop and seed.
Usage (GPU): PYTHONPATH=src:tests python tools/gsa_precision.py [drop ...]"""

from __future__ import annotations

import sys

import torch

import fusetune
from fusetune.gsa import naive
from harness import relative_error
from test_gsa import make_inputs, with_states


def errors(drop: float, seed: int, device: str) -> dict[str, float]:
    torch.manual_seed(seed)
    inputs = make_inputs(batch=1, seq_len=40, q_heads=2, heads=1)
    inputs["g"][:, [18, 27], :, 1::2] = -drop / 2  # the block of tokens 16..31
    inputs["s"] = 1 - inputs["g"].exp()
    rounded = {n: t.float() for n, t in inputs.items()}
    ref = {n: t.double().requires_grad_(True) for n, t in rounded.items()}
    test = {n: t.to(device).requires_grad_(True) for n, t in rounded.items()}
    ref_out = with_states(naive)(**ref)
    test_out = with_states(fusetune.gated_slot_attention, mode="chunk")(**test)
    upstream = [torch.randn_like(o) for o in ref_out]
    torch.autograd.backward(ref_out, upstream)
    torch.autograd.backward(test_out, [u.to(device, torch.float32) for u in upstream])
    result = {
        f"out{i}": relative_error(o.detach().double().cpu(), r.detach())
        for i, (o, r) in enumerate(zip(test_out, ref_out, strict=True))
    }
    result |= {n: relative_error(test[n].grad.double().cpu(), ref[n].grad) for n in ref}
    return result


def main() -> None:
    drops = [float(d) for d in sys.argv[1:]] or [10, 20, 30, 40, 50, 55, 59, 61, 70, 100, 1e4]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for drop in drops:
        for seed in range(3):
            row = errors(drop, seed, device)
            worst = max(row, key=row.get)
            cells = " ".join(f"{n}={e:.1e}" for n, e in row.items())
            print(
                f"drop {drop:>7g} seed {seed}: worst {worst} {row[worst]:.2e} | {cells}", flush=True
            )


if __name__ == "__main__":
    main()
