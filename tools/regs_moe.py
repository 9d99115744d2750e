"""The MoE grouped GEMMs compiled for sm_90 on the CPU (no GPU): FUSETUNE_MOE_TMA=0, 1 and 2.

    PYTHONPATH=/tmp/t36:src python tools/regs_moe.py [qwen3_moe|gpt_oss ...]

Runs ops/moe.py's forward / backward host code on small CPU tensors with the bench shapes'
widths (E = 8 experts, 256 tokens: the kernels' specialisation does not depend on those), the
LoRA r16 of the bench, bf16, catches every kernel launch instead of running it, and compiles
the gate/up forward and the grouped mm launches the way a launch on the GPU would: the
JITFunction's own binder specialises the arguments (ints equal to 1 become constants,
multiples of 16 and 16-byte aligned pointers get ``tt.divisibility``), so this sees what the
GPU compiles (hand-written signatures missed those and got scalar loads: NOTES.md, issue 21).
Per kernel: ptxas registers, spill stack, shared memory, and PTX counts of TMA loads
(cp.async.bulk.tensor), cp.async (pointer loads into shared memory), wgmma shapes and scalar
16-bit global loads. Triton: whatever is first on PYTHONPATH (3.6 is the GPU image's).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("FUSETUNE_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from fusetune.ops import moe  # noqa: E402
from fusetune.reference.moe import Layout  # noqa: E402

SHAPES = {  # experts, top_k, hidden, intermediate, transposed, interleaved (bench widths)
    "qwen3_moe": (8, 8, 2048, 768, False, False),
    "gpt_oss": (8, 4, 2880, 2880, True, True),
}
KERNELS = ("_glu_forward_kernel", "_glu_backward_kernel", "_grouped_mm_kernel")
CAUGHT = (*KERNELS, "_expert_outer_kernel")
TARGET = GPUTarget("cuda", 90, 32)


class _Catch:
    """Stands in for a kernel: records each launch's (args, kwargs) instead of running it."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, args, kwargs))


def launches(shape: str, tma: int) -> list:
    experts, top_k, hidden, inter, transposed, interleaved = SHAPES[shape]
    os.environ["FUSETUNE_MOE_TMA"] = str(int(tma))  # (main has no TMA_VARIABLE)
    n, rank, bf16 = 256, 16, torch.bfloat16
    gate_up = torch.randn(experts, 2 * inter, hidden, dtype=bf16)
    down = torch.randn(experts, hidden, inter, dtype=bf16)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    x = torch.randn(n, hidden, dtype=bf16)
    ids = torch.rand(n, experts).argsort(-1)[:, :top_k]
    weights = torch.rand(n, top_k).softmax(-1)
    a_gu, b_gu = (
        torch.randn(experts, rank, hidden, dtype=bf16),
        torch.randn(experts, 2 * inter, rank, dtype=bf16),
    )
    a_d, b_d = (
        torch.randn(experts, rank, inter, dtype=bf16),
        torch.randn(experts, hidden, rank, dtype=bf16),
    )
    layout = Layout(experts, top_k, hidden, inter, bf16, transposed, interleaved)
    caught: list = []
    saved = {name: getattr(moe, name) for name in CAUGHT}
    try:
        for name in CAUGHT:
            setattr(moe, name, _Catch(name, caught))
        bias = (
            torch.randn(experts, 2 * inter, dtype=bf16),
            torch.randn(experts, hidden, dtype=bf16),
        )
        biases = bias if interleaved else (None, None)
        act = 1 if interleaved else 0
        out = moe._forward(
            x,
            ids,
            weights,
            gate_up,
            down,
            *biases,
            a_gu,
            b_gu,
            a_d,
            b_d,
            0.5,
            2.0,
            layout,
            act,
            1.702,
            7.0,
        )
        _, tokens, slots, offsets, gu, xa_gu, xa_d = out
        needs = [True, True, False, False, False, False, True, True, True, True]
        moe._backward(
            torch.randn_like(x),
            x,
            ids,
            weights,
            gate_up,
            down,
            *biases,
            a_gu,
            b_gu,
            a_d,
            b_d,
            0.5,
            2.0,
            tokens,
            slots,
            offsets,
            gu,
            xa_gu,
            xa_d,
            layout,
            act,
            1.702,
            7.0,
            needs,
            inplace=True,
        )
    finally:
        for name, fn in saved.items():
            setattr(moe, name, fn)
    return [launch for launch in caught if launch[0] in KERNELS]


def compile_launch(name, args, kwargs):
    fn = getattr(moe, name)
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def resources(compiled) -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
        ).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    ptx = compiled.asm["ptx"]
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    cp_async = len(re.findall(r"cp\.async\.c[ag]", ptx))
    scalar = len(re.findall(r"ld\.global[.\w]*\.b16 ", ptx))
    regs, stack = regs.group(1) if regs else "?", stack.group(1) if stack else "?"
    return (
        f"regs {regs:>3s}  stack {stack:>4s} B  "
        f"shared {compiled.metadata.shared:6d} B  tma {tma:2d}  cp.async {cp_async:3d}  "
        f"ld.b16 {scalar:3d}  wgmma {dict(wgmma)}"
    )


def describe(name, kwargs, args) -> str:
    keys = (
        "LORA",
        "BIAS",
        "GATHER",
        "SCATTER",
        "W_TMA",
        "K_MAJOR",
        "HALVES",
        "A_TMA",
        "BM",
        "BN",
        "BK",
    )
    flags = " ".join(
        f"{k}={int(kwargs[k]) if isinstance(kwargs[k], bool) else kwargs[k]}"
        for k in keys
        if k in kwargs
    )
    w = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)  # [E, n, k]
    return f"{name.strip('_').replace('_kernel', '')} n={w.shape[1]} k={w.shape[2]}: {flags}"


def main() -> None:
    shapes = [a for a in sys.argv[1:] if a in SHAPES] or list(SHAPES)
    print(f"triton {triton.__version__}, sm_90, bf16, tiles {moe.TILES_16BIT}")
    for shape in shapes:
        for tma in (0, 1, 2):
            print(f"== {shape}, FUSETUNE_MOE_TMA={int(tma)}", flush=True)
            seen = set()
            for name, args, kwargs in launches(shape, tma):
                label = describe(name, kwargs, args)
                if label in seen:
                    continue
                seen.add(label)
                print(f"  {label:75s} {resources(compile_launch(name, args, kwargs))}", flush=True)


if __name__ == "__main__":
    main()
