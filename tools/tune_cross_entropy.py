"""Sweep the cross-entropy launch constants on a GPU; prints one line per setting.

python tools/tune_cross_entropy.py  (forward+backward, bf16, 8192 rows, median ms)
"""

from __future__ import annotations

import itertools

import torch
import triton

import fusetune
from fusetune.ops import cross_entropy as ce

ROWS = 8192


def time_ms(vocab: int, softcap: float | None) -> float:
    logits = (torch.randn(ROWS, vocab, device="cuda") * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (ROWS,), device="cuda")

    def step():
        fusetune.cross_entropy(logits, labels, logit_softcap=softcap).backward()
        logits.grad = None

    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")


def sweep(name: str, values: dict, vocabs: list[int]) -> None:
    keys = list(values)
    for combo in itertools.product(*values.values()):
        for key, value in zip(keys, combo, strict=True):
            setattr(ce, key, value)
        cells = []
        for vocab, softcap in itertools.product(vocabs, (None, 30.0)):
            try:
                cells.append(f"{time_ms(vocab, softcap):7.3f}")
            except Exception as exc:  # a setting that does not compile is a result too
                cells.append(f"{type(exc).__name__[:7]:>7}")
        print(f"{name} {dict(zip(keys, combo, strict=True))}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    print("columns: vocab x softcap(None, 30) for each vocab listed")
    sweep(
        "multi",
        {"BLOCK": [2048, 4096, 8192, 16384], "WARPS": [4, 8, 16], "SINGLE_BLOCK_MAX": [0]},
        [128256, 262144],
    )
    sweep("single", {"SINGLE_BLOCK_MAX": [32768], "SINGLE_BLOCK_WARPS": [8, 16, 32]}, [32000])
    sweep(
        "small-multi",
        {"SINGLE_BLOCK_MAX": [0], "BLOCK": [2048, 4096, 8192], "WARPS": [4, 8, 16]},
        [32000],
    )
