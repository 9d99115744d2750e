"""Host cost of one Triton launch, and of its parts, on the GPU machine.

The Llama-3.2-1B LoRA step's forward is host-bound (NOTES, sixth session): each layer takes the
host about as long as the GPU. This measures what a launch costs the host, on a kernel whose GPU
time is a few microseconds (a 64 x 64 4-bit dequantisation): ``kernel[grid](...)`` against
calling the cached compiled kernel directly, and the pieces of Triton's ``JITFunction.run``.

    PYTHONPATH=src:tests python tools/bench_launch.py
"""

from __future__ import annotations

import time

import torch

from fusetune.ops import quant4
from fusetune.ops.quant4 import _dequantize_4bit_kernel
from test_quant4 import quantize  # tests/ on PYTHONPATH


def per_call_us(fn, calls: int = 20000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, compute_cache_key

    gen = torch.Generator().manual_seed(0)
    dense_weight = torch.randn(64, 64, generator=gen).to(torch.bfloat16).cuda()
    weight = quantize(dense_weight)
    tensors = quant4._state_tensors(weight)
    packed, absmax, code = tensors[:3]
    out = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
    args = (packed, absmax, code, absmax, absmax, absmax, out, out.numel())
    constexprs = dict(BLOCKSIZE=64, OUTER_BLOCKSIZE=1, NESTED=False, BLOCK=quant4.BLOCK)
    grid = (2,)
    compiled = _dequantize_4bit_kernel[grid](*args, **constexprs)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    kernel_cache, key_cache, _, _, binder = _dequantize_4bit_kernel.device_caches[device]
    bound, spec, options = binder(*args, **constexprs, debug=False, instrumentation_mode="")
    values = list(bound.values())

    def triton_call():  # Triton's own JITFunction.run, whatever class the kernel is
        JITFunction.run(_dequantize_4bit_kernel, *args, grid=grid, warmup=False, **constexprs)

    def fusetune_call():  # fusetune's cached launch where it applies (fusetune._triton.jit)
        _dequantize_4bit_kernel[grid](*args, **constexprs)

    def direct_run():
        compiled.run(
            2, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values
        )

    def direct_run_stream():
        s = driver.active.get_current_stream(driver.active.get_current_device())
        compiled.run(
            2, 1, 1, s, compiled.function, compiled.packed_metadata, None, None, None, *values
        )

    rows = [
        ("Triton's JITFunction.run", triton_call),
        (f"kernel[grid](...) ({type(_dequantize_4bit_kernel).__name__})", fusetune_call),
        ("compiled.run(...) direct", direct_run),
        ("direct + current device/stream", direct_run_stream),
        (
            "binder(*args)",
            lambda: binder(*args, **constexprs, debug=False, instrumentation_mode=""),
        ),
        ("compute_cache_key", lambda: compute_cache_key(key_cache, spec, options)),
        ("launch_metadata", lambda: compiled.launch_metadata(grid, stream, *values)),
        ("quant4.dense (whole op)", lambda: quant4.dense(weight, torch.bfloat16)),
        ("torch.empty 64x64", lambda: torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")),
        ("torch.add (a launch)", lambda: torch.add(out, out)),
        ("torch.mm 64x64", lambda: torch.mm(out, out)),
    ]
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {__import__('triton').__version__}"
    )
    print("| call | host us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn):.1f} |")
    assert len(kernel_cache) >= 1


if __name__ == "__main__":
    main()
