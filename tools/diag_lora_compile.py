"""One-off: torch.compile of lora_linear on the GPU, Inductor vs aot_eager, gradients vs eager."""

import sys
import traceback

import torch

import fusetune

torch.manual_seed(0)
dev = torch.device("cuda")
x = torch.randn(2, 5, 24, device=dev, requires_grad=True)
w = torch.randn(40, 24, device=dev)
a = torch.randn(4, 24, device=dev, requires_grad=True)
b = torch.randn(40, 4, device=dev, requires_grad=True)


def f(x, weight, lora_a, lora_b):
    return fusetune.lora_linear(x, weight, lora_a, lora_b, scaling=0.75)


g = torch.randn(2, 5, 40, device=dev)
f(x, w, a, b).backward(g)
want = [t.grad.clone() for t in (x, a, b)]
for backend in sys.argv[1:]:
    for t in (x, a, b):
        t.grad = None
    torch._dynamo.reset()
    try:
        y = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)(x, w, a, b)
        y.backward(g)
        print(
            backend,
            [
                (n, None if t.grad is None else float((t.grad - ref).abs().max()))
                for n, t, ref in zip("xab", (x, a, b), want, strict=True)
            ],
            flush=True,
        )
    except Exception:
        traceback.print_exc(limit=3)
