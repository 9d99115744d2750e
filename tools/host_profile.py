"""cProfile of the host side of a cross-entropy step on the GPU (launch overhead hunting)."""

import cProfile
import pstats

import torch

import fusetune

logits = (torch.randn(8192, 32000, device="cuda") * 3).bfloat16().requires_grad_()
labels = torch.randint(0, 32000, (8192,), device="cuda")


def step():
    fusetune.cross_entropy(logits, labels).backward()
    logits.grad = None


for _ in range(20):
    step()
torch.cuda.synchronize()
cProfile.run("for _ in range(100): step()", "/tmp/prof.out")
pstats.Stats("/tmp/prof.out").sort_stats("tottime").print_stats(25)
