"""Host (Python) time per call of fusetune's LoRA ops on their kernel path, on the CPU.

Usage:
    python tools/host_lora_overhead.py                 # ops table (CPU)
    python tools/host_lora_overhead.py --device cuda   # on a GPU: the compiled kernels
    python tools/host_lora_overhead.py --src /tmp/old/src   # another source tree's fusetune
    python tools/host_lora_overhead.py --src /tmp/old/src --save old.pt   # gradients, then
    python tools/host_lora_overhead.py --compare old.pt     # ... bit for bit against them
    python tools/host_lora_overhead.py --model         # + a tiny PEFT Llama step (fusetune.apply)
    python tools/host_lora_overhead.py --repeats 7 --calls 300

Sets FUSETUNE_INTERPRET=1 before importing fusetune, so the ops take the path they take on a
GPU (the Autograd Functions, not the reference); one CPU thread, tiny tensors (N tokens, hidden
64, rank 4), so what is timed is Python: the host cost every call also pays on a GPU, where a
LoRA training step is host-bound.

Rows:
- lora_linear / lora_qkv (fp32; bf16 with PEFT's fp32 adapters; bf16 with bf16 adapters, as
  FSDP2's bf16 MixedPrecisionPolicy hands them to the forward): the projections
  Function runs torch matmuls only, so its wall time is host time. Columns: median (over
  ``--repeats``) microseconds per forward and per forward + backward (torch.autograd.grad),
  Tensor.to calls and all dtype casts (.to, .float(), ...) that fusetune makes per forward +
  backward, and fusetune's own cProfile time per forward +
  backward (functions in the fusetune package, Triton-jitted ones excluded).
- lora_mlp: its Triton kernels run in Triton's interpreter (milliseconds), so only the cast
  counts and fusetune's own cProfile time are reported (the jitted kernel bodies, which the
  interpreter runs as Python in fusetune's files, are excluded).
- --model: one training step (forward with labels, backward) of a 2-layer PEFT LoRA Llama
  after ``fusetune.apply(model, lora=True)``: fusetune's own cProfile time and Tensor.to calls
  per step.

Run notes (2026-11-26, 2 CPU cores shared with other jobs (noisy), torch 2.13 CPU, Triton 3.9
interpreter; N=8, 200 calls x 7 repeats; before = 9f34749, after = 640f3f9, each imported with
--src, two alternating runs, so a range; us per call; .to = Tensor.to calls by fusetune per
fwd+bwd, casts = those plus .float() / .bfloat16() / .half()):

    op           base/adapters  fwd before  after  fwd+bwd before  after    .to     casts
    lora_linear  fp32/fp32      54-56       41-57  198-223         158-174  11 -> 0  12 -> 1
    lora_qkv     fp32/fp32      108-114     85-89  348-350         290-317  25 -> 0  28 -> 3
    lora_mlp     fp32/fp32      -           -      -               -        31 -> 0  32 -> 1
    lora_linear  bf16/fp32      109-115     93-94  307-310         265-278  11 -> 0  12 -> 4
    lora_qkv     bf16/fp32      235-238     203-205  628-635       562-574  25 -> 0  28 -> 8
    lora_mlp     bf16/fp32      -           -      -               -        31 -> 0  32 -> 14
    lora_linear  bf16/bf16      102-105     87-88  296-304         262      11 -> 0  12 -> 2
    lora_qkv     bf16/bf16      220-231     189-190  607-632       543-547  25 -> 0  28 -> 6
    lora_mlp     bf16/bf16      -           -      -               -        31 -> 2  32 -> 5

    The casts left change a dtype (the mlp's 2 .to: B's gradients, transposed and cast in one
    copy). fusetune own (cProfile) us per fwd+bwd, before -> after: linear fp32 102-107 -> 84-88,
    qkv fp32 165-168 -> 139-144, linear bf16/bf16 107-109 -> 95-99, qkv bf16/bf16 188-189 ->
    158-161; lora_mlp 515-702 either way (noise: the interpreter's kernel runs between the
    host calls disturb its own time; its changes, 3 zero fills and 2 copies fewer per backward,
    are GPU launches). Tiny Llama step (fp32): Tensor.to by fusetune 140 -> 10 per step (casts
    150 -> 20); fusetune own 5.0-5.8 ms either way (mostly the other ops' launchers under the
    interpreter).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

# --device cuda: the compiled kernels on a GPU (tiny tensors: the step is host-bound, so wall time
# is host time there too); else the CPU, with FUSETUNE_INTERPRET=1 set before fusetune is
# imported: the kernel path, not the reference.
DEVICE = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
if DEVICE == "cpu":
    os.environ["FUSETUNE_INTERPRET"] = "1"

import torch  # noqa: E402

# --src DIR: import fusetune from another source tree (e.g. the previous commit's, unpacked
# with ``git archive``), to time before and after a change on one machine minutes apart.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

from fusetune.ops import lora  # noqa: E402
from fusetune.reference.lora import Projection  # noqa: E402

HIDDEN, RANK, SCALING = 64, 4, 2.0
QKV_OUT = (64, 32, 32)  # GQA: k and v narrower than q
# (base and x dtype, adapter dtype): fp32; bf16 with PEFT's fp32 adapters; all bf16 (FSDP2's
# MixedPrecisionPolicy(param_dtype=bf16), as the GPU benchmark runs it)
CONFIGS = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
)
TO_KEY = "<method 'to' of 'torch._C.TensorBase' objects>"
# dtype casts by their own methods (Tensor.float() and the like): counted beside Tensor.to
CAST_KEYS = {
    f"<method '{name}' of 'torch._C.TensorBase' objects>" for name in ("float", "bfloat16", "half")
}


def projection(out: int, hidden: int, dtype, adapters, generator: torch.Generator):
    def tensor(*shape, dt=dtype, grad=False):
        return (
            torch.randn(*shape, generator=generator, dtype=torch.float32)
            .to(DEVICE, dt)
            .requires_grad_(grad)
        )

    return Projection(
        tensor(out, hidden),
        tensor(RANK, hidden, dt=adapters, grad=True),
        tensor(out, RANK, dt=adapters, grad=True),
        SCALING,
    )


def cases(tokens: int, dtype: torch.dtype, adapters: torch.dtype):
    """name -> (forward, forward + backward) closures of one op on fixed inputs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(DEVICE, dtype).requires_grad_()
    single = projection(64, HIDDEN, dtype, adapters, generator)
    qkv = [projection(out, HIDDEN, dtype, adapters, generator) for out in QKV_OUT]
    mlp = [
        projection(128, HIDDEN, dtype, adapters, generator),
        projection(128, HIDDEN, dtype, adapters, generator),
        projection(HIDDEN, 128, dtype, adapters, generator),
    ]

    def linear():
        return (lora.lora_linear_validated(x, single),)

    def qkv_call():
        return lora.lora_qkv_validated(x, qkv)

    def mlp_call():
        return (lora.lora_mlp_validated(x, mlp, "swiglu"),)

    def with_backward(forward, params):
        inputs = [x, *(t for p in params for t in (p.lora_a, p.lora_b))]

        def run():
            outputs = forward()
            grads = torch.autograd.grad(outputs, inputs, [torch.ones_like(y) for y in outputs])
            return outputs, grads

        return run

    return {
        "lora_linear": (linear, with_backward(linear, [single])),
        "lora_qkv": (qkv_call, with_backward(qkv_call, qkv)),
        "lora_mlp": (mlp_call, with_backward(mlp_call, mlp)),
    }


def synchronize() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def median_us(call, calls: int, repeats: int) -> float:
    for _ in range(min(calls, 20)):
        call()
    runs = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def _jitted_code() -> set[tuple[str, str]]:
    """(file, name) of every Triton-jitted function in fusetune: run as Python by the
    interpreter, they are kernel time, not host time."""
    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fusetune"):
            continue
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            code = getattr(fn, "__code__", None)
            if code is not None and type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                found.add((code.co_filename, code.co_name))
    return found


def profiled(call, calls: int) -> tuple[float, float, float]:
    """(fusetune's own microseconds, Tensor.to calls and dtype casts by any method made by
    fusetune) per call, under cProfile (the interpreter's own calls are not counted)."""
    call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    stats = pstats.Stats(profile).stats
    jitted = _jitted_code()

    def host(filename: str, function: str) -> bool:
        return "/fusetune/" in filename and (filename, function) not in jitted

    own, to_calls, casts = 0.0, 0, 0
    for (filename, _, function), (_, _, tottime, _, callers) in stats.items():
        if function == TO_KEY or function in CAST_KEYS:
            count = sum(c[1] for (f, _, fn), c in callers.items() if host(f, fn))
            casts += count
            to_calls += count if function == TO_KEY else 0
        elif host(filename, function):
            own += tottime
    return own / calls * 1e6, to_calls / calls, casts / calls


def ops_table(tokens: int, calls: int, repeats: int) -> None:
    print(f"N={tokens} hidden={HIDDEN} rank={RANK}; {calls} calls x {repeats} repeats")
    print(
        f"{'op':<12} {'base/adapters':<17} {'fwd us':>8} {'fwd+bwd us':>11} {'.to/call':>9} "
        f"{'casts':>6} {'fusetune own us':>16}"
    )
    for dtype, adapters in CONFIGS:
        label = f"{str(dtype)[6:]}/{str(adapters)[6:]}"
        for name, (forward, both) in cases(tokens, dtype, adapters).items():
            if name == "lora_mlp" and DEVICE == "cpu":  # the interpreter's kernels: no time
                fwd = total = float("nan")
                own, to_calls, casts = profiled(both, 3)
            else:
                fwd = median_us(forward, calls, repeats)
                total = median_us(both, calls, repeats)
                own, to_calls, casts = profiled(both, calls)
            print(
                f"{name:<12} {label:<17} {fwd:8.1f} {total:11.1f} {to_calls:9.1f} {casts:6.1f} "
                f"{own:16.1f}",
                flush=True,
            )


def model_row(steps: int) -> None:
    import peft
    import transformers

    import fusetune

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_config = peft.LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, lora_config)
    fusetune.apply(model, lora=True)
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)

    own, to_calls, casts = profiled(step, steps)
    print(
        f"tiny Llama step (2 layers, 1 x 8 tokens, fp32): fusetune own {own:.0f} us/step, "
        f"{to_calls:.0f} Tensor.to calls/step, {casts:.0f} casts/step",
        flush=True,
    )


def results(tokens: int) -> dict:
    """Outputs and gradients (x, each A and B) of every op and dtype row, with and without
    bf16 autocast, on inputs of ``tokens`` rows (seeded): for --save / --compare."""
    found = {}
    for dtype, adapters in CONFIGS:
        for autocast in (False, True):
            ops = cases(tokens, dtype, adapters)
            for name, (_, both) in ops.items():
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                    outputs, grads = both()
                tensors = [t.detach().cpu() for t in (*outputs, *grads)]
                found[(name, str(dtype), str(adapters), autocast)] = tensors
    return found


def compare(path: str, tokens: int) -> None:
    """Every output and gradient of :func:`results`, bit for bit, against ``path``'s."""
    saved, now = torch.load(path), results(tokens)
    differ = [
        key
        for key, grads in now.items()
        if len(grads) != len(saved[key])
        or not all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads, saved[key], strict=True)
        )
    ]
    print(f"{len(now)} cases against {path}: {len(differ)} differ {differ}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", action="store_true", help="also a tiny PEFT Llama step")
    parser.add_argument("--steps", type=int, default=3, help="profiled model steps")
    parser.add_argument("--src", help="the src folder to import fusetune from (read above)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(read above)")
    parser.add_argument("--save", help="save the ops' gradients to this file, then stop")
    parser.add_argument("--compare", help="compare the gradients with a --save file, then stop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"fusetune from {Path(lora.__file__).parents[2]}, device {DEVICE}")
    if args.save or args.compare:  # (N=64 rows: several row tiles and splits on the GPU)
        if args.save:
            torch.save(results(64), args.save)
            print(f"saved {args.save}")
        else:
            compare(args.compare, 64)
        return
    ops_table(args.tokens, args.calls, args.repeats)
    if args.model:
        model_row(args.steps)


if __name__ == "__main__":
    main()
