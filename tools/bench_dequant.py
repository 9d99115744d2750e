"""fusetune.dequantize_4bit against bitsandbytes' CUDA dequantisation and the copy floor, at
Llama-3-8B's projection shapes (NF4, blocksize 64, double quantisation, bf16 out); then the
LoRA ops' dense() back to back, replayed from its CUDA graph and launched plainly (host-bound
where the kernel is short: the time a call costs the host), at Llama-3.2-1B's shapes.

Usage (GPU, bitsandbytes installed): python tools/bench_dequant.py
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import triton

import fusetune
from fusetune.ops import quant4

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096),
          "gate/up 14336x4096": (14336, 4096), "down 4096x14336": (4096, 14336)}  # fmt: skip


def _back_to_back_us(call, calls: int = 500) -> float:
    """Microseconds a call, timed over ``calls`` calls issued back to back (no cache flush
    between them, unlike do_bench's): where the kernel is shorter than the host's work per
    call, the GPU waits for the host and this is the host's cost of a call."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    print(f"{'shape':<20} {'fusetune ms':>11} {'bnb ms':>8} {'floor ms':>8} {'fusetune GB/s':>13}")
    for name, shape in SHAPES.items():
        dense = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 64
        weight = bnb.nn.Params4bit(dense, requires_grad=False, quant_type="nf4", blocksize=64,
                                   compress_statistics=True).cuda()  # fmt: skip
        state = weight.quant_state
        want = bnb.functional.dequantize_4bit(weight.data, state)
        assert torch.equal(fusetune.dequantize_4bit(weight), want), name
        ours = triton.testing.do_bench(lambda w=weight: fusetune.dequantize_4bit(w), rep=200)
        theirs = triton.testing.do_bench(
            lambda w=weight, s=state: bnb.functional.dequantize_4bit(w.data, s), rep=200
        )
        moved = dense.numel() * 2.5  # 0.5 byte read + 2 bytes written per element
        floor = moved / 3.0e12 * 1e3
        print(f"{name:<20} {ours:>11.3f} {theirs:>8.3f} {floor:>8.3f} {moved / ours / 1e6:>13.0f}")
    print(f"{'dense() 1B shape':<20} {'replayed us':>11} {'plain us':>8}")
    for shape in ((2048, 2048), (512, 2048), (8192, 2048)):
        weight = bnb.nn.Params4bit(torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 64,
                                   requires_grad=False, quant_type="nf4", blocksize=64,
                                   compress_statistics=True).cuda()  # fmt: skip
        times = []
        for replay in (True, False):
            quant4.REPLAY = replay
            call = lambda w=weight: quant4.dense(w, torch.bfloat16)  # noqa: E731
            assert torch.equal(call(), fusetune.dequantize_4bit(weight))
            times.append(_back_to_back_us(call))
        quant4.REPLAY = True
        print(f"{'x'.join(map(str, shape)):<20} {times[0]:>11.1f} {times[1]:>8.1f}")


if __name__ == "__main__":
    main()
