"""Time variants of the chunked GSA kernels in one GPU process, each checked first.

    PYTHONPATH=src python tools/tune_gsa.py [B T H D M]

A variant is a text substitution on ``fusetune/ops/linear_attention/gsa_chunk.py`` plus the warps
per kernel; each is loaded as its own module and swapped into ``fusetune.ops.linear_attention.gsa``.
For every variant: the error of o and every gradient against ``fusetune.reference.gsa`` in
float64 on a small input (bf16), then the forward and backward ops' median times at the
benchmark shape and a per-kernel profile. The table is printed last.
"""

from __future__ import annotations

import importlib.util
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

from fusetune.ops.linear_attention import gsa as api
from fusetune.ops.linear_attention import gsa_chunk as chunk
from fusetune.reference.gsa import gated_slot_attention as naive

BLOCKS_8 = dict(states=4, dstates=4, fwd=8, bwd_a=8, bwd_b=8)
# Measured 2026-11-23 (H100) and dropped: all 8 warps, blocks of 64 tokens (out of shared
# memory), 32 slots per state program, key and value sides of the state kernels in separate
# programs (two waves instead of one), bwd_b's steep diagonal inline (now its own pass).
VARIANTS = [  # (name, substitutions, warps or None for the library's, slot block or None)
    ("library", [], None, None),
    ("blocks of 32, 8 warps", [("SUB_CHUNK = 16", "SUB_CHUNK = 32")], BLOCKS_8, None),
    # The decay-column loops for every diagonal block (the path of steep blocks).
    ("exact diagonals", [("tl.constexpr(60.0)", "tl.constexpr(-1.0)")], None, None),
]


def load_variant(
    name: str, substitutions: list[tuple[str, str]], warps: dict | None, bms: int | None
):
    source = open(chunk.__file__).read()
    for old, new in substitutions:
        assert old in source, old
        source = source.replace(old, new)
    path = f"/tmp/gsa_variant_{abs(hash(name))}.py"
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"gsa_variant_{abs(hash(name))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.NUM_WARPS = dict(warps or chunk.NUM_WARPS)
    module.SLOT_BLOCK = bms or chunk.SLOT_BLOCK
    return module


def inputs(b, t, h, d, m, dev, dt=torch.bfloat16):
    q, k, v = (torch.randn(b, t, h, d, device=dev).to(dt) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, t, h, m, device=dev)) / 8
    return q, k, v, (1 - g.exp()).to(dt), g.to(dt)


def check(dev, t=300, d=64) -> float:
    """Largest relative error of o and the five gradients against naive in float64."""
    torch.manual_seed(0)
    leaves = [x.requires_grad_() for x in inputs(1, t, 2, d, d, dev)]
    do = torch.randn(1, t, 2, d, device=dev)
    o = api._forward_impl(*leaves, None, None, None, 0.125, "BTHD", False, True)[0]
    grads = api._backward_impl(
        do.to(o.dtype), None, None, *leaves, None, None, None, 0.125, "BTHD", False, True
    )[:5]
    ref = [x.detach().double().requires_grad_() for x in leaves]
    o_ref = naive(*ref, scale=0.125)
    o_ref.backward(do.double())
    worst = 0.0
    for got, want in zip([o, *grads], [o_ref, *(x.grad for x in ref)], strict=True):
        err = (got.double() - want.detach()).norm() / want.detach().norm()
        worst = max(worst, float(err))
    return worst


def main() -> None:
    if not torch.cuda.is_available():  # smoke run: FUSETUNE_INTERPRET=1, the checks only
        for name, subs, warps, bms in VARIANTS:
            api.gsa_chunk = load_variant(name, subs, warps, bms)
            print(name, f"err {check(torch.device('cpu'), t=40, d=16):.1e}")
        return
    shape = tuple(int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (4, 4096, 16, 64, 64)
    dev = torch.device("cuda")
    q, k, v, s, g = inputs(*shape, dev)
    do = torch.randn_like(v)
    args = (None, None, None, shape[3] ** -0.5, "BTHD")
    rows = []
    for name, subs, warps, bms in VARIANTS:
        began = time.time()
        try:
            api.gsa_chunk = load_variant(name, subs, warps, bms)
            err = check(dev)
            fwd = triton.testing.do_bench(
                lambda: api._forward_impl(q, k, v, s, g, *args, False, True), warmup=25, rep=100
            )
            bwd = triton.testing.do_bench(
                lambda: api._backward_impl(do, None, None, q, k, v, s, g, *args, False, True),
                warmup=25,
                rep=100,
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    api._forward_impl(q, k, v, s, g, *args, False, True)
                    api._backward_impl(do, None, None, q, k, v, s, g, *args, False, True)
                torch.cuda.synchronize()
            kernels = {
                e.key: e.device_time_total / 5e3
                for e in prof.key_averages()
                if e.device_time_total > 0 and not e.key.startswith("void")  # Triton's only
            }
            per = " ".join(
                f"{key.replace('_kernel', '')}={ms:.3f}"
                for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:7]
            )
            rows.append(
                f"{name:22s} err {err:.1e}  fwd {fwd:.3f}  bwd {bwd:.3f}  total "
                f"{fwd + bwd:.3f} ms | {per}"
            )
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a result
            rows.append(f"{name:22s} {type(exc).__name__}: {str(exc)[:300]}")
        print(rows[-1], f"({time.time() - began:.0f} s)", flush=True)
    api.gsa_chunk = chunk
    print(f"\nB{shape[0]} T{shape[1]} H{shape[2]} D{shape[3]} M{shape[4]} bf16, ms per op")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
