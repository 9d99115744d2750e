"""(I + A)^-1 of Gated DeltaNet's chunks two ways, alone: wy_kernel's former doubling over whole
64 x 64 tiles (kept here: ten dependent tf32 products) against FLA's structure
(16 x 16 blocks: forward substitution on the four diagonal blocks, then the off-diagonal blocks
from small IEEE fp32 block products). Each program inverts one chunk's [64, 64] A, read from and
written to memory. Prints the error of each against a float64 inverse and the GPU time of each
at the bench shapes' chunk counts (B4 T4096 H16: 4096 chunks; B1 T32768 H16: 8192), to decide
whether a blocked wy_kernel was worth building (issue 20; NOTES, twenty-fourth session: it was,
and gdr_chunk.inverse_kernel is it, with A formed inside).

    PYTHONPATH=src:tools python tools/gdr_inverse_bench.py [--chunks 4096 8192]

On a machine without a GPU it checks both against float64 on a few chunks (interpreter).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("FUSETUNE_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusetune.ops.linear_attention import gdr_chunk  # noqa: E402

BT, BC = 64, 16


@triton.jit
def _doubling_inverse(A, r, BT: tl.constexpr, DOT: tl.constexpr):
    """wy_kernel's former (I + A)^-1 (until 2026-12-01): with X the inverse of I + A's diagonal
    blocks of side s, those of side 2s are X - X L X (L: A's lower-left s x s quarters), ten
    dependent [64, 64, 64] tf32 products for BT = 64."""
    i, j = r[:, None], r[None, :]
    X = tl.where(i == j, 1.0, 0.0) - tl.where((i // 2 == j // 2) & (i > j), A, 0.0)
    for level in tl.static_range(1, 6):  # sides 2, 4, ..., 32 -> 4, 8, ..., 64
        if (2 << level) <= BT:
            in_pair = i // (2 << level) == j // (2 << level)
            L = tl.where(in_pair & (i // (1 << level) > j // (1 << level)), A, 0.0)
            X = X - gdr_chunk.mm_tf32(gdr_chunk.mm_tf32(X, L, DOT), X, DOT)
    return X


@triton.jit
def doubling_kernel(a_ptr, t_ptr, BT: tl.constexpr, DOT: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BT * BT
    r = tl.arange(0, BT)
    tiles = base + r[:, None] * BT + r[None, :]
    A = tl.load(a_ptr + tiles)
    tl.store(t_ptr + tiles, _doubling_inverse(A, r, BT, DOT))


@triton.jit
def _block(ptr, i: tl.constexpr, j: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    return ptr + (i * BC + o)[:, None] * BT + (j * BC + o)[None, :]


@triton.jit
def _diagonal_inverse(L, BC: tl.constexpr):
    """(I + L)^-1 of a strictly lower [BC, BC] block by forward substitution (the op's rows)."""
    o = tl.arange(0, BC)
    X = -L
    for i in range(2, BC):
        X = gdr_chunk._substitute(X, i, o)
    return X + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


_mm = gdr_chunk._ieee


@triton.jit
def blocked_kernel(a_ptr, t_ptr, BT: tl.constexpr, BC: tl.constexpr):
    a_ptr += tl.program_id(0).to(tl.int64) * BT * BT
    t_ptr += tl.program_id(0).to(tl.int64) * BT * BT
    lower = tl.arange(0, BC)[:, None] > tl.arange(0, BC)[None, :]
    X00 = _diagonal_inverse(tl.where(lower, tl.load(_block(a_ptr, 0, 0, BT, BC)), 0.0), BC)
    X11 = _diagonal_inverse(tl.where(lower, tl.load(_block(a_ptr, 1, 1, BT, BC)), 0.0), BC)
    X22 = _diagonal_inverse(tl.where(lower, tl.load(_block(a_ptr, 2, 2, BT, BC)), 0.0), BC)
    X33 = _diagonal_inverse(tl.where(lower, tl.load(_block(a_ptr, 3, 3, BT, BC)), 0.0), BC)
    A10 = tl.load(_block(a_ptr, 1, 0, BT, BC))
    A20 = tl.load(_block(a_ptr, 2, 0, BT, BC))
    A21 = tl.load(_block(a_ptr, 2, 1, BT, BC))
    A30 = tl.load(_block(a_ptr, 3, 0, BT, BC))
    A31 = tl.load(_block(a_ptr, 3, 1, BT, BC))
    A32 = tl.load(_block(a_ptr, 3, 2, BT, BC))
    # X_ij = -X_ii sum_{j <= k < i} A_ik X_kj, by distance from the diagonal
    X10 = -_mm(_mm(X11, A10), X00)
    X21 = -_mm(_mm(X22, A21), X11)
    X32 = -_mm(_mm(X33, A32), X22)
    X20 = -_mm(X22, _mm(A20, X00) + _mm(A21, X10))
    X31 = -_mm(X33, _mm(A31, X11) + _mm(A32, X21))
    X30 = -_mm(X33, _mm(A30, X00) + _mm(A31, X10) + _mm(A32, X20))
    zero = tl.zeros([BC, BC], tl.float32)
    tl.store(_block(t_ptr, 0, 0, BT, BC), X00)
    tl.store(_block(t_ptr, 1, 1, BT, BC), X11)
    tl.store(_block(t_ptr, 2, 2, BT, BC), X22)
    tl.store(_block(t_ptr, 3, 3, BT, BC), X33)
    tl.store(_block(t_ptr, 1, 0, BT, BC), X10)
    tl.store(_block(t_ptr, 2, 1, BT, BC), X21)
    tl.store(_block(t_ptr, 3, 2, BT, BC), X32)
    tl.store(_block(t_ptr, 2, 0, BT, BC), X20)
    tl.store(_block(t_ptr, 3, 1, BT, BC), X31)
    tl.store(_block(t_ptr, 3, 0, BT, BC), X30)
    tl.store(_block(t_ptr, 0, 1, BT, BC), zero)
    tl.store(_block(t_ptr, 0, 2, BT, BC), zero)
    tl.store(_block(t_ptr, 0, 3, BT, BC), zero)
    tl.store(_block(t_ptr, 1, 2, BT, BC), zero)
    tl.store(_block(t_ptr, 1, 3, BT, BC), zero)
    tl.store(_block(t_ptr, 2, 3, BT, BC), zero)


def chunk_matrices(chunks: int, device: torch.device) -> torch.Tensor:
    """[chunks, 64, 64] strictly lower A = beta_t <k_t, k_s> exp(g_{s+1} + ... + g_t), t > s,
    as wy_kernel forms it: unit keys (the models' l2norm), beta in (0, 1), log-sigmoid gates."""
    k = F.normalize(torch.randn(chunks, BT, 128, device=device, dtype=torch.float64), dim=-1)
    beta = torch.rand(chunks, BT, 1, device=device, dtype=torch.float64)
    gates = F.logsigmoid(torch.randn(chunks, BT, device=device, dtype=torch.float64) + 2)
    cum = gates.cumsum(-1)
    decay = torch.exp(cum[:, :, None] - cum[:, None, :]).tril(-1)
    return beta * (k @ k.transpose(1, 2)) * decay


def invert(kernel: str, a: torch.Tensor, warps: int) -> torch.Tensor:
    t = torch.empty_like(a)
    grid = (a.shape[0],)
    if kernel == "doubling":  # wy_kernel's default for bf16 inputs: tf32 products (DOT 4)
        doubling_kernel[grid](a, t, BT=BT, DOT=gdr_chunk.DOT_MODES["tf32"], num_warps=warps)
    else:
        blocked_kernel[grid](a, t, BT=BT, BC=BC, num_warps=warps)
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, nargs="*", default=[4096, 8192])
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    a64 = chunk_matrices(64 if cuda else 4, device)
    eye = torch.eye(BT, device=device, dtype=torch.float64)
    exact = torch.linalg.inv(eye + a64)
    a32 = a64.float().contiguous()
    rows = [("doubling", 4), ("blocked", 1), ("blocked", 2), ("blocked", 4)]
    for kernel, warps in rows:
        got = invert(kernel, a32, warps).double()
        error = ((got - exact).abs().amax() / exact.abs().amax()).item()
        print(f"{kernel:9s} {warps} warps: max |T - T64| / max |T64| = {error:.2e}", flush=True)
    if not cuda:
        return
    for chunks in args.chunks:
        a = chunk_matrices(chunks, device).float().contiguous()
        for kernel, warps in rows:
            ms = triton.testing.do_bench(lambda: invert(kernel, a, warps), rep=200)  # noqa: B023
            print(f"{chunks} chunks  {kernel:9s} {warps} warps: {ms * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
