"""Benchmark cases for fusetune.gated_slot_attention: bf16, forward + backward.

Providers: fusetune (chunk mode), fusetune-recurrent (the token-by-token kernels; off by
default, slow at these lengths: set with_recurrent), FLA's chunk_gsa (fla-core) when importable
(on the varlen case only with GSA_BENCH_FLA_VARLEN=1), and for scale torch's causal
scaled_dot_product_attention (flash) on the same B, T, H, D.
Inputs as a GSA layer makes them: g = logsigmoid(f) / 8, s = 1 - exp(g).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, backward_step, register

HEAD_DIM, SLOTS, HEADS = 64, 64, 16
CASES = [  # (name, batch, sequence lengths of each batch row's packed sequences or None, T)
    ("B4 T4096", 4, None, 4096),
    ("B1 T16384", 1, None, 16384),
    ("varlen 16384 (8 seqs)", 1, [512, 3000, 1024, 4096, 900, 2500, 2048, 2304], 16384),
]
CPU_SHAPE = (1, 40, 2, 16, 16)  # B, T, H, D, M for the smoke run
BF16_BYTES = 2


def _fla_chunk_gsa() -> Callable | None:
    try:
        from fla.ops.gsa import chunk_gsa
    except Exception as exc:  # noqa: BLE001 - a missing peer (or its dependency) is a result
        print(f"note: fla not importable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return chunk_gsa


def _inputs(batch, seq_len, heads, dim, slots, dtype, device):
    def leaf(*shape):
        return torch.randn(*shape, device=device).to(dtype).requires_grad_()

    q, k, v = (leaf(batch, seq_len, heads, dim) for _ in range(3))
    g = F.logsigmoid(torch.randn(batch, seq_len, heads, slots, device=device)) / 8
    s = (1 - g.exp()).to(dtype).requires_grad_()
    g = g.to(dtype).requires_grad_()
    return [q, k, v, s, g]


def _make(batch: int, lengths: list[int] | None, seq_len: int, with_recurrent: bool):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        b, t, h, d, m = (batch, seq_len, HEADS, HEAD_DIM, SLOTS)
        if device.type != "cuda":
            b, t, h, d, m = CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        leaves = _inputs(b, t, h, d, m, dtype, device)
        cu = None
        if lengths is not None:
            scaled = lengths if device.type == "cuda" else [t // 2, t - t // 2]
            offsets = torch.tensor([0, *scaled], device=device).cumsum(0)
            cu = offsets.to(torch.int32 if device.type == "cuda" else torch.int64)
        grad_out = torch.randn(b, t, h, d, device=device, dtype=dtype)
        providers = {
            "fusetune": backward_step(
                lambda: fusetune.gated_slot_attention(*leaves, cu_seqlens=cu), [grad_out], leaves
            ),
        }
        if with_recurrent:
            providers["fusetune-recurrent"] = backward_step(
                lambda: fusetune.gated_slot_attention(*leaves, cu_seqlens=cu, mode="recurrent"),
                [grad_out],
                leaves,
            )
        if device.type == "cuda":
            # FLA's varlen kernels autotune for minutes on a fresh machine (past a GPU pass's
            # limit): its varlen row is opt-in, GSA_BENCH_FLA_VARLEN=1.
            fla_wanted = lengths is None or os.environ.get("GSA_BENCH_FLA_VARLEN") == "1"
            chunk_gsa = _fla_chunk_gsa() if fla_wanted else None
            if chunk_gsa is not None:
                fla_cu = None if cu is None else cu.long()
                providers["fla"] = backward_step(
                    lambda: chunk_gsa(*leaves, cu_seqlens=fla_cu)[0], [grad_out], leaves
                )
            if lengths is None:
                qkv = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in leaves[:3]]
                sdpa_grad = grad_out.transpose(1, 2).contiguous()
                providers["sdpa-causal"] = backward_step(
                    lambda: F.scaled_dot_product_attention(*qkv, is_causal=True), [sdpa_grad], qkv
                )
        return providers

    return make


def _floor_bytes(batch: int, seq_len: int) -> Callable[[bool], float]:
    # Read q, k, v, s, g and the output gradient, write o and five input gradients.
    return lambda quick: 12.0 * batch * seq_len * HEADS * HEAD_DIM * BF16_BYTES


for _index, (_name, _batch, _lengths, _seq_len) in enumerate(CASES):
    register(
        Case(
            op="gated_slot_attention",
            name=f"{_name} H{HEADS} D{HEAD_DIM} M{SLOTS} bf16",
            make=_make(_batch, _lengths, _seq_len, with_recurrent=False),
            floor_bytes=_floor_bytes(_batch, _seq_len),
        )
    )
