"""Sweep grpo_loss's rows per chunk on the GPU (B=8, T=1024, H=4096, V=128256, bf16): fwd+bwd
time and peak memory above the inputs, next to linear_cross_entropy at the same chunk size
(the same three matmuls without the GRPO terms: the difference is GRPO's own overhead).

Usage: PYTHONPATH=src python tools/tune_grpo.py [--rows 512 1024 ...]
"""

from __future__ import annotations

import argparse

import torch
from tune_linear_cross_entropy import measure  # tools/ is on sys.path when run as a script

import fusetune
from fusetune.ops import grpo as grpo_module
from fusetune.ops.linear_cross_entropy import chunk_rows

B, T, H, V = 8, 1024, 4096, 128256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[512, 1024, 2048])
    args = parser.parse_args()
    hidden = torch.randn(B, T, H, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda") * 2 / H**0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, T), device="cuda")
    mask = torch.rand(B, T, device="cuda") < 0.9
    advantages = torch.randn(B, device="cuda")
    with torch.no_grad():
        logps = fusetune.selective_log_softmax(hidden, weight, ids)
    old, ref = logps + 0.1 * torch.randn_like(logps), logps + 0.1 * torch.randn_like(logps)
    default = chunk_rows(B * T, weight, weight_fraction=grpo_module.LOGITS_WEIGHT_FRACTION)
    print(f"{'rows':>6} {'grpo ms':>8} {'GiB':>6} {'lce ms':>8} {'GiB':>6}")
    for rows in sorted({default, *args.rows}):

        def grpo(rows: int = rows) -> None:
            loss, _ = fusetune.grpo_loss(
                hidden,
                weight,
                ids,
                mask,
                advantages,
                old_logps=old,
                ref_logps=ref,
                beta=0.04,
                loss_type="dapo",
                chunk_size=rows,
            )
            loss.backward()
            hidden.grad = weight.grad = None

        def lce(rows: int = rows) -> None:
            fusetune.linear_cross_entropy(hidden, weight, ids, chunk_size=rows).backward()
            hidden.grad = weight.grad = None

        (grpo_ms, grpo_gib), (lce_ms, lce_gib) = measure(grpo), measure(lce)
        mark = " (default)" if rows == default else ""
        print(f"{rows:>6} {grpo_ms:8.2f} {grpo_gib:6.3f} {lce_ms:8.2f} {lce_gib:6.3f}{mark}")


if __name__ == "__main__":
    main()
