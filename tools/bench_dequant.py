"""fusetune.dequantize_4bit against bitsandbytes' CUDA dequantisation and the copy floor, at
Llama-3-8B's projection shapes (NF4, blocksize 64, double quantisation, bf16 out).

Usage (GPU, bitsandbytes installed): python tools/bench_dequant.py
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import triton

import fusetune

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096),
          "gate/up 14336x4096": (14336, 4096), "down 4096x14336": (4096, 14336)}  # fmt: skip


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


if __name__ == "__main__":
    main()
