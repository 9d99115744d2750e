"""Packed-sequence (varlen) helpers shared by the linear-attention tests (gated slot attention,
the gated delta rule)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from harness import assert_raises


def per_sequence(fn: Callable, offsets: Sequence[int], state_names: Sequence[str]) -> Callable:
    """``fn`` (called with keyword tensors, returning (o, *states)) run on each packed sequence
    alone, results concatenated: the varlen oracle. Tensors named in ``state_names`` are per
    sequence ([N, ...]: row n goes with sequence n); every other tensor is [1, T, ...] and is cut
    along time; other arguments pass through."""

    def run(**kwargs):
        results = []
        for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            part = {
                name: x[n : n + 1]
                if name in state_names
                else x[:, start:end]
                if isinstance(x, torch.Tensor)
                else x
                for name, x in kwargs.items()
            }
            results.append(fn(**part))
        o = torch.cat([r[0] for r in results], dim=1)
        states = (torch.cat([r[i] for r in results]) for i in range(1, len(results[0])))
        return (o, *states)

    return run


def check_bad_cu_seqlens_values(call: Callable, args: Sequence[torch.Tensor]) -> None:
    """``call(*args, cu_seqlens=...)`` (args of 8 tokens) must refuse offsets that do not start at
    0, decrease, or do not end at T (value checks of CPU tensors)."""
    for offsets, words in [
        ([1, 3, 8], "start at 0"),
        ([0, 5, 3, 8], "non-decreasing"),
        ([0, 3, 7], "end at T = 8"),
    ]:
        assert_raises(
            ValueError, f"cu_seqlens|{words}", call, *args, cu_seqlens=torch.tensor(offsets)
        )
