"""Host (Python) time per call of fusetune's LoRA ops on their kernel path, on the CPU.

Usage:
    python tools/host_lora_overhead.py                 # ops table
    python tools/host_lora_overhead.py --model         # + a tiny PEFT Llama step (fusetune.apply)
    python tools/host_lora_overhead.py --repeats 7 --calls 300

Sets FUSETUNE_INTERPRET=1 before importing fusetune, so the ops take the path they take on a
GPU (the Autograd Functions, not the reference); one CPU thread, tiny tensors (N tokens, hidden
64, rank 4), so what is timed is Python: the host cost every call also pays on a GPU, where a
LoRA training step is host-bound.

Rows:
- lora_linear / lora_qkv (fp32, bf16; fp32 adapters as PEFT keeps them): the projections
  Function runs torch matmuls only, so its wall time is host time. Columns: median (over
  ``--repeats``) microseconds per forward and per forward + backward (torch.autograd.grad),
  Tensor.to calls per forward + backward, and fusetune's own cProfile time per forward +
  backward (functions in the fusetune package, Triton-jitted ones excluded).
- lora_mlp: its Triton kernels run in Triton's interpreter (milliseconds), so only the Tensor.to
  count and fusetune's own cProfile time are reported (the jitted kernel bodies, which the
  interpreter runs as Python in fusetune's files, are excluded).
- --model: one training step (forward with labels, backward) of a 2-layer PEFT LoRA Llama
  after ``fusetune.apply(model, lora=True)``: fusetune's own cProfile time and Tensor.to calls
  per step.

Run notes (2026-11-26, 2 shared CPU cores, torch 2.13 CPU, Triton 3.9 interpreter; N=8, 200
calls x 7 repeats; before = commit 9f34749 via --src, after = the host-overhead change; two
alternating runs each, so a range; fwd+bwd in us, .to = Tensor.to calls by fusetune per call):

    op           dtype    fwd+bwd before  after     .to before  after   own us before  after
    lora_linear  float32  206-240         158-160   11          0       105-119        86-88
    lora_qkv     float32  350-361         303-314   25          0       171-174        141-148
    lora_mlp     float32  -               -         31          0       579-582        497-534
    lora_linear  bfloat16 321-322         278-283   11          4       113-125        100-101
    lora_qkv     bfloat16 627-648         589-596   25          8       191-198        167-168
    lora_mlp     bfloat16 -               -         31          14      609-618        542-561
    tiny Llama step (fp32): Tensor.to by fusetune 140 -> 10 per step; fusetune own time
    5.2-5.6 ms either way (mostly the other ops' launchers under the interpreter).
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

os.environ["FUSETUNE_INTERPRET"] = "1"  # before fusetune: the kernel path, not the reference

import torch  # noqa: E402

# --src DIR: import fusetune from another source tree (e.g. the previous commit's, unpacked
# with ``git archive``), to time before and after a change on one machine minutes apart.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

from fusetune.ops import lora  # noqa: E402
from fusetune.reference.lora import Projection  # noqa: E402

HIDDEN, RANK, SCALING = 64, 4, 2.0
QKV_OUT = (64, 32, 32)  # GQA: k and v narrower than q
TO_KEY = "<method 'to' of 'torch._C.TensorBase' objects>"


def projection(out: int, hidden: int, dtype: torch.dtype, generator: torch.Generator):
    def tensor(*shape, dt=dtype, grad=False):
        return (
            torch.randn(*shape, generator=generator, dtype=torch.float32)
            .to(dt)
            .requires_grad_(grad)
        )

    return Projection(
        tensor(out, hidden),
        tensor(RANK, hidden, dt=torch.float32, grad=True),
        tensor(out, RANK, dt=torch.float32, grad=True),
        SCALING,
    )


def cases(tokens: int, dtype: torch.dtype):
    """name -> (forward, forward + backward) closures of one op on fixed inputs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype).requires_grad_()
    single = projection(64, HIDDEN, dtype, generator)
    qkv = [projection(out, HIDDEN, dtype, generator) for out in QKV_OUT]
    mlp = [
        projection(128, HIDDEN, dtype, generator),
        projection(128, HIDDEN, dtype, generator),
        projection(HIDDEN, 128, dtype, generator),
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
            return torch.autograd.grad(outputs, inputs, [torch.ones_like(y) for y in outputs])

        return run

    return {
        "lora_linear": (linear, with_backward(linear, [single])),
        "lora_qkv": (qkv_call, with_backward(qkv_call, qkv)),
        "lora_mlp": (mlp_call, with_backward(mlp_call, mlp)),
    }


def median_us(call, calls: int, repeats: int) -> float:
    for _ in range(min(calls, 20)):
        call()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
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


def profiled(call, calls: int) -> tuple[float, float]:
    """(fusetune's own microseconds, Tensor.to calls made by fusetune) per call, under
    cProfile (the interpreter's own Tensor.to calls are not counted)."""
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

    own, to_calls = 0.0, 0
    for (filename, _, function), (_, _, tottime, _, callers) in stats.items():
        if function == TO_KEY:
            to_calls += sum(c[1] for (f, _, fn), c in callers.items() if host(f, fn))
        elif host(filename, function):
            own += tottime
    return own / calls * 1e6, to_calls / calls


def ops_table(tokens: int, calls: int, repeats: int) -> None:
    print(f"N={tokens} hidden={HIDDEN} rank={RANK}; {calls} calls x {repeats} repeats")
    print(
        f"{'op':<12} {'dtype':<9} {'fwd us':>8} {'fwd+bwd us':>11} {'.to/call':>9} "
        f"{'fusetune own us':>16}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for name, (forward, both) in cases(tokens, dtype).items():
            if name == "lora_mlp":
                fwd = total = float("nan")
                own, to_calls = profiled(both, 3)
            else:
                fwd = median_us(forward, calls, repeats)
                total = median_us(both, calls, repeats)
                own, to_calls = profiled(both, calls)
            print(
                f"{name:<12} {str(dtype)[6:]:<9} {fwd:8.1f} {total:11.1f} {to_calls:9.1f} "
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
    model = transformers.LlamaForCausalLM(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_config = peft.LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, lora_config)
    fusetune.apply(model, lora=True)
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)

    own, to_calls = profiled(step, steps)
    print(
        f"tiny Llama step (2 layers, 1 x 8 tokens, fp32): fusetune own {own:.0f} us/step, "
        f"{to_calls:.0f} Tensor.to calls/step",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", action="store_true", help="also a tiny PEFT Llama step")
    parser.add_argument("--steps", type=int, default=3, help="profiled model steps")
    parser.add_argument("--src", help="the src folder to import fusetune from (read above)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"fusetune from {Path(lora.__file__).parents[2]}")
    ops_table(args.tokens, args.calls, args.repeats)
    if args.model:
        model_row(args.steps)


if __name__ == "__main__":
    main()
