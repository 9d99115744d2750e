"""Gated DeltaNet chunk kernels: fwd+bwd time under other launch settings (num_stages,
num_warps per kernel), at the bench's Qwen3.5-like shape (B4 T4096 H16 D128, bf16, l2norm, the
default product mode). Each variant overrides the launcher's keywords of the kernels it names
(launch settings or constexpr blocks such as BVA; the launcher looks the kernels up in gdr_chunk
at every call), so no source changes; "env" sets environment variables for a row (those the
launcher reads at every call, such as FUSETUNE_GDR_W).

    PYTHONPATH=src:tests:tools python tools/gdr_launch_sweep.py [--batch 4 --seq-len 4096]

With --profile each row also prints its GPU time per kernel (gdr_kernel_profile's table).

The launcher runs every kernel at num_stages=1 (gdr_chunk's SHARED MEMORY) except states /
dstates with bf16 products, at 2: their loads of the next chunk do not depend on the state, so
the second stage prefetches them while the state products run (2026-11-27 eighteenth).
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import torch
from gdr_kernel_profile import CHUNK, kernel_times, report
from gdr_modes_bench import DIM, HEADS, make_run, ours, timed

from fusetune.bench.cases_gated_delta_rule import _inputs
from fusetune.ops.linear_attention import gdr_chunk

STATE_DTYPE = gdr_chunk.state_dtype  # (the launcher's rules; variants replace them while timed)
OUTPUT_BLOCK = gdr_chunk.output_block
VARIANTS = {  # (dropped, each slower on both bench shapes: bwd_chunk at 4 warps, wy / output
    # at 8; 2026-11-27 eleventh, H100: bwd_chunk BVA 64 8.50 / 22.53 ms vs 7.73 / 21.02; states
    # and dstates at num_stages 2 then 9.17 / 23.25, with fp32 W: bf16 W made 2 stages win)
    "launcher's settings": {},
    # W and every product of states / dstates in bf16 (2026-11-27, gdr-bf16w) against bf16 W
    # with bf16 products only where W is an operand, and the fp32 W / tf32 path before it
    "bf16 W products only": {"env": {"FUSETUNE_GDR_W": "w"}},
    "fp32 W, tf32 (before)": {"env": {"FUSETUNE_GDR_W": "fp32"}},
    # the opt-in precision trades (branch gdr-experiments): every per-chunk product with its fp32
    # operand rounded to bf16 (FLA's precision), and the writes D stored in bf16 on top
    "bf16 products": {"env": {"FUSETUNE_GDR_DOT": "bf16"}},
    "bf16 products, bf16 D": {"env": {"FUSETUNE_GDR_DOT": "bf16", "FUSETUNE_GDR_W": "d"}},
    # (bwd_chunk_kernel's work split along K, split and split-pairs: removed 2026-11-28
    # twenty-second, no win on an H200: docs/bench/session-2026-11-28-twentysecond/call-01)
    "states 8 warps": {"states_kernel": dict(num_warps=8)},
    "states 4 warps": {"states_kernel": dict(num_warps=4)},
    "dstates 4 warps": {"dstates_kernel": dict(num_warps=4)},
    # (the launcher's 2 stages for bf16 since 2026-11-27 eighteenth: H100 B4 T4096 6.43 ->
    # 6.17 ms, B1 T32768 13.67 -> 12.48; 1 stage is what they ran before). The key-block walks
    # at 1 stage faulted on the H200 at both bench shapes, an illegal address (2026-12-02
    # thirty-first call 3); the launcher never takes them at 1 stage.
    "states / dstates 1 stage": {
        **dict.fromkeys(("states_kernel", "states_k64_kernel"), dict(num_stages=1)),
        **dict.fromkeys(("dstates_kernel", "dstates_k64_kernel"), dict(num_stages=1)),
    },
    # the backward's states recompute on a side stream beside dstates (branch gdr-state-t; the
    # launcher's auto: beside where both launches fit the SMs at once, i.e. at B1 T32768)
    "backward states apart": {"env": {"FUSETUNE_GDR_BWD_SEQ": "apart"}},
    "backward states beside": {"env": {"FUSETUNE_GDR_BWD_SEQ": "beside"}},
    # the walks as states_kernel / dstates_kernel (transposed products) where the launcher
    # takes the key-block walks (gdr_chunk.walks_in_key_blocks), and those at 8 warps
    "walks transposed": {"env": {"FUSETUNE_GDR_WALK": "transposed"}},
    "key-block walks, 8 warps": {
        "states_k64_kernel": dict(num_warps=8),
        "dstates_k64_kernel": dict(num_warps=8),
    },
    # the forward's walk in parts beside the per-chunk kernels (gdr_chunk.forward_parts; auto:
    # 2 parts where the walk leaves half the SMs idle, i.e. at B1 T32768)
    "forward in one part": {"env": {"FUSETUNE_GDR_FWD_PARTS": "1"}},
    "forward in 4 parts": {"env": {"FUSETUNE_GDR_FWD_PARTS": "4"}},
    "forward in 8 parts": {"env": {"FUSETUNE_GDR_FWD_PARTS": "8"}},
    "states / dstates 3 stages": {
        **dict.fromkeys(("states_kernel", "states_k64_kernel"), dict(num_stages=3)),
        **dict.fromkeys(("dstates_kernel", "dstates_k64_kernel"), dict(num_stages=3)),
    },
    # the backward's per-chunk gradients in two kernels since 2026-11-28 (nineteenth): each
    # holds fewer tiles than the one kernel did, so its lost settings are timed again
    "bwd_pairs 4 warps": {"bwd_pairs_kernel": dict(num_warps=4)},
    "bwd BVA 64": {"bwd_pairs_kernel": dict(BVA=64), "bwd_chunk_kernel": dict(BVA=64)},
    # bwd_chunk's value loop waited on its loads (8 % of its stall samples at the dO load's
    # barrier, 2026-12-02 twentyninth call-03): the launcher's 3 stages since the thirtieth
    # (sm_90: 81920 bytes shared at 2 stages, 110592 at 3, 147456 at 4)
    "bwd_chunk 2 stages": {"bwd_chunk_kernel": dict(num_stages=2)},
    "bwd_pairs 3 stages": {"bwd_pairs_kernel": dict(num_stages=3)},
    "bwd_chunk 4 stages": {"bwd_chunk_kernel": dict(num_stages=4)},
    "wy 2 stages": {"wy_kernel": dict(num_stages=2)},
    "wy 8 warps": {"wy_kernel": dict(num_warps=8)},
    # the blocked inverse (2026-12-01): one warp keeps the substitution's reductions in a warp
    "inverse 2 warps": {"inverse_kernel": dict(num_warps=2)},
    "inverse 4 warps": {"inverse_kernel": dict(num_warps=4)},
    # one output_kernel program a chunk (V = 128): Q K^T and the decays formed once, not twice;
    # 131072 bytes of shared memory, 147 registers at 8 warps (offline, sm_90, Triton 3.6)
    "output one block, 8 warps": {
        "output_block": lambda value_block: value_block,
        "output_kernel": dict(num_warps=8),
    },
    # the per-chunk S0 / dS copies in fp32, as before 2026-11-27 (eleventh): bf16 now; and dS's
    # alone in fp32 (dstates_kernel's bf16 store spilled more offline: 192 -> 520 B)
    "fp32 state copies": {"state_dtype": lambda dtype, dot, gradient=False: torch.float32},
    "fp32 dS copies": {
        "state_dtype": lambda dtype, dot, gradient=False: (
            torch.float32 if gradient else STATE_DTYPE(dtype, dot)
        )
    },
}


class Override:
    """``kernel[grid](...)`` with some launch keywords replaced."""

    def __init__(self, kernel, **launch) -> None:
        self.kernel, self.launch = kernel, launch

    def __getitem__(self, grid):
        run = self.kernel[grid]
        return lambda *args, **kwargs: run(*args, **{**kwargs, **self.launch})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", action="append", help="a row's name (repeat; default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="also GPU time per kernel under each row's settings")
    args = parser.parse_args()
    rows = args.only or list(VARIANTS)
    torch.manual_seed(0)
    shape = (args.batch, args.seq_len, HEADS, DIM)
    leaves = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    grad_out = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    originals = {name: getattr(gdr_chunk, name) for name in vars(gdr_chunk) if "kernel" in name}
    print(f"B{args.batch} T{args.seq_len} H{HEADS} D{DIM} bf16 l2norm, median of {args.repeats}")
    for label in rows:
        overrides = VARIANTS[label]
        for name, kernel in originals.items():
            setattr(gdr_chunk, name, Override(kernel, **overrides.get(name, {})))
        gdr_chunk.state_dtype = overrides.get("state_dtype", STATE_DTYPE)
        gdr_chunk.output_block = overrides.get("output_block", OUTPUT_BLOCK)
        try:
            # the row's environment only while it runs (the launcher reads it at every call)
            env = overrides.get("env", {})
            with mock.patch.dict(os.environ, env):
                # (``ours`` sets FUSETUNE_GDR_DOT at every call: the row's, else tf32)
                dot = env.get("FUSETUNE_GDR_DOT", "tf32")
                fwd_bwd, fwd_only = make_run(ours(leaves, dot, True), leaves, grad_out)
                both = [timed(fwd_bwd, args.repeats) for _ in range(2)]
                fwd = timed(fwd_only, args.repeats)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as error:  # noqa: BLE001 (out of resources: report, go on)
            print(f"{label:28s} failed: {type(error).__name__}: {str(error)[:120]}", flush=True)
            if "illegal" in str(error) or "launch failure" in str(error):
                # a fault poisons the process's CUDA context: every later row would fail too
                # (thirty-first call 3: "key-block walks, 8 warps" after the 1-stage row's)
                print("the CUDA context is lost: run the rows after this one in a new process")
                break
            continue
        print(f"{label:28s} fwd+bwd {min(both):7.2f} ms  fwd {fwd:6.2f} ms  "
              f"peak +{peak:6.0f} MiB", flush=True)  # fmt: skip
        if args.profile:
            with mock.patch.dict(os.environ, env):
                report(label, kernel_times(fwd_bwd), -(-args.seq_len // CHUNK))
    for name, kernel in originals.items():
        setattr(gdr_chunk, name, kernel)
    gdr_chunk.state_dtype = STATE_DTYPE
    gdr_chunk.output_block = OUTPUT_BLOCK


if __name__ == "__main__":
    main()
