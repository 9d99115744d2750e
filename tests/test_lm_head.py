"""fusetune.selective_log_softmax's extras (return_entropy, return_top1: fusetune.ops.lm_head)
against the float64 reference: log-probs and entropy with the gradients of both, top-1 with its
tie rule, ignored tokens, and the paths where one upstream gradient is missing."""

from __future__ import annotations

import pytest
import torch

import fusetune
from fusetune.reference import grpo as reference
from harness import DEVICE, assert_close, check_op, tolerance, uses_kernels

OPTIONS = dict(temperature=0.7, logit_softcap=3.0, logit_scale=0.8, chunk_size=5)


def inputs(batch=2, time=7, hidden=24, vocab=301):
    token_ids = torch.randint(0, vocab, (batch, time))
    token_ids[0, 2] = -100  # an ignored token
    return {
        "hidden": torch.randn(batch, time, hidden, dtype=torch.float64),
        "weight": torch.randn(vocab, hidden, dtype=torch.float64) * 2 / hidden**0.5,
        "bias": torch.randn(vocab, dtype=torch.float64),
        "token_ids": token_ids,
    }


def with_entropy(fn):
    def run(hidden, weight, token_ids, bias, **options):
        out = fn(hidden, weight, token_ids, bias=bias, return_entropy=True, **options)
        return out.log_probs, out.entropy

    return run


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize(
    "dtype,autocast",
    [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
     (torch.float32, torch.bfloat16)],
    ids=["fp32", "fp16", "bf16", "fp32-amp"],
)  # fmt: skip
def test_log_probs_and_entropy(dtype, autocast, mode):
    """Both outputs in fp32 and both differentiable: random upstream gradients for each."""
    check_op(
        with_entropy(fusetune.selective_log_softmax),
        with_entropy(reference.selective_log_softmax),
        inputs(),
        dtype=dtype,
        cast=["hidden", "weight", "bias"],
        grad=["hidden", "weight", "bias"],
        output_dtypes=[torch.float32, torch.float32],
        kwargs=OPTIONS,
        mode=mode,
        autocast=autocast,
        layout="noncontiguous",
    )


def test_top1_first_maximum_and_ignored_tokens():
    """Tokens 3 and 7 share the largest logit in every row: argmax is 3, so 3 is a top-1
    match and 7 is not; an ignored token never is."""
    vocab, hidden = 40, 8
    weight = torch.randn(vocab, hidden, dtype=torch.float64) * 0.1
    direction = torch.randn(hidden, dtype=torch.float64)
    weight[3] = weight[7] = direction * 3
    rows = direction.expand(6, hidden) + 0.01 * torch.randn(6, hidden, dtype=torch.float64)
    token_ids = torch.tensor([3, 7, 5, -100, 3, 7])
    for dtype in (torch.float32, torch.bfloat16):
        h, w = rows.to(DEVICE, dtype), weight.to(DEVICE, dtype)
        out = fusetune.selective_log_softmax(h, w, token_ids.to(DEVICE), return_top1=True)
        want = reference.selective_log_softmax(h, w, token_ids.to(DEVICE), return_top1=True)
        assert out.entropy is None and out.is_top1.dtype == torch.bool
        assert out.is_top1.tolist() == [True, False, False, False, True, False]
        assert torch.equal(out.is_top1, want.is_top1)
        assert_close("log_probs", out.log_probs, want.log_probs, tolerance(dtype, torch.float32))


def test_one_upstream_gradient_at_a_time():
    """Entropy logged only (GRPO without an entropy bonus): the log-probs' gradient alone; and
    an entropy bonus alone. Each matches the reference's."""
    data = inputs(1, 9, 16, 130)
    for pick in (0, 1):
        grads = []
        runs = ((fusetune.selective_log_softmax, DEVICE, torch.float32),
                (reference.selective_log_softmax, "cpu", torch.float64))  # fmt: skip
        for fn, device, dtype in runs:
            hidden = data["hidden"].to(device, dtype).clone().requires_grad_()
            weight = data["weight"].to(device, dtype).clone().requires_grad_()
            out = fn(hidden, weight, data["token_ids"].to(device), return_entropy=True,
                     temperature=1.3)  # fmt: skip
            out[pick].sum().backward()
            grads.append((hidden.grad, weight.grad))
        for got, want in zip(*grads, strict=True):
            assert_close(f"grad of output {pick}", got, want, tolerance(torch.float32))


def test_no_grad_and_kernels_ran(monkeypatch):
    from fusetune.ops import lm_head

    calls = []
    stats = lm_head._stats
    monkeypatch.setattr(lm_head, "_stats", lambda *a: calls.append(1) or stats(*a))
    data = inputs(1, 5, 16, 70)
    hidden, weight = data["hidden"].float().to(DEVICE), data["weight"].float().to(DEVICE)
    with torch.no_grad():
        out = fusetune.selective_log_softmax(
            hidden, weight, data["token_ids"].to(DEVICE), return_entropy=True, return_top1=True
        )
    assert not out.log_probs.requires_grad and out.entropy.shape == (1, 5)
    assert len(calls) == (1 if uses_kernels(hidden) else 0)


def test_fp32_weight_gradient_is_summed_in_fp32():
    """fp32 weights under bf16 autocast (TRL's GRPO with bf16=True): the weight gradient is
    summed over the row chunks in fp32, so 16 chunks give one chunk's gradient."""
    data = inputs(batch=4, time=16, hidden=32, vocab=200)
    hidden, weight = (data[k].float().to(DEVICE).requires_grad_() for k in ("hidden", "weight"))
    token_ids = data["token_ids"].to(DEVICE)
    upstream = torch.randn(2, 4, 16, device=DEVICE)
    grads = []
    for chunk_size in (64, 4):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            out = fusetune.selective_log_softmax(hidden, weight, token_ids, return_entropy=True,
                                                 chunk_size=chunk_size)  # fmt: skip
        loss = (out.log_probs * upstream[0] + out.entropy * upstream[1]).sum()
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    for one, many in zip(*grads, strict=True):
        assert many.dtype == torch.float32
        assert_close("gradient over 16 chunks", many, one, 1e-5)
