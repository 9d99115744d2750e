"""4-bit base weights (QLoRA): fusetune.dequantize_4bit against the float64 formula and
bitsandbytes itself, the LoRA ops on a 4-bit base against its dense twin, and PEFT's 4-bit LoRA
layers routed through fusetune against PEFT's own path.

The op tests quantise with a small PyTorch quantiser of bitsandbytes' format (below), so they run
where bitsandbytes is not installed; the tests that compare with bitsandbytes itself (and double
quantisation, which only it produces here) import it."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch

import fusetune
from fusetune.integrations import peft as integration
from fusetune.ops import quant4 as quant4_ops
from fusetune.reference import lora as lora_reference
from fusetune.reference import quant4 as reference
from harness import DEVICE, assert_close, assert_raises, tolerance

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])  # fmt: skip


def quantize(weight: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """``weight`` in bitsandbytes' NF4 format (no double quantisation): packed uint8 codes with a
    ``quant_state``, each element the nearest code of its block's absmax-scaled value."""
    flat = weight.float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % blocksize))
    blocks = padded.view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1).clamp(min=1e-12)
    scaled = (blocks / absmax[:, None]).reshape(-1)[: flat.numel()]
    codes = (scaled[:, None] - NF4.to(scaled.device)).abs().argmin(dim=1).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, codes.numel() % 2))
    packed = (codes[0::2] << 4 | codes[1::2]).reshape(-1, 1)
    packed.quant_state = SimpleNamespace(
        absmax=absmax, code=NF4.to(weight.device), blocksize=blocksize, shape=weight.shape,
        dtype=weight.dtype, nested=False, offset=None, state2=None, quant_type="nf4",
    )  # fmt: skip
    return packed


def projection(out_features: int, in_features: int, dtype, adapter_dtype, rank: int = 4):
    weight = (torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5).to(dtype)
    a = torch.randn(rank, in_features, device=DEVICE).to(adapter_dtype) / in_features**0.5
    b = torch.randn(out_features, rank, device=DEVICE).to(adapter_dtype) / rank**0.5
    return quantize(weight), a.requires_grad_(), b.requires_grad_(), 0.5


def dense_twin(projections):
    return [(reference.dequantize_4bit(p[0]),) + tuple(p[1:]) for p in projections]


def run_op(op: str, x, projections):
    if op == "linear":
        weight, a, b, scaling = projections[0]
        return (fusetune.lora_linear(x, weight, a, b, scaling),)
    if op == "qkv":
        return fusetune.lora_qkv(x, *projections)
    return (fusetune.lora_mlp(x, *projections, "swiglu"),)


SHAPES = {"linear": [(40, 64)], "qkv": [(64, 64), (32, 64), (32, 64)],
          "mlp": [(96, 64), (96, 64), (64, 96)]}  # fmt: skip


def step(op, x, projections, autocast):
    x = x.detach().requires_grad_()
    leaves = [x] + [t for p in projections for t in p[1:3]]
    with torch.autocast(DEVICE.type, dtype=BF16, enabled=autocast):
        outputs = run_op(op, x, projections)
    upstream = [torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y) for y in outputs]
    grads = torch.autograd.grad(outputs, leaves, upstream)
    return [y.detach() for y in outputs], grads


@pytest.mark.parametrize("autocast", [False, True], ids=["noamp", "amp"])
@pytest.mark.parametrize("dtype,adapter", [(BF16, FP32), (FP16, FP16), (FP32, FP32)],
                         ids=["bf16-fp32", "fp16", "fp32"])  # fmt: skip
@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_lora_ops_on_a_4bit_base_equal_its_dense_twin(op, dtype, adapter, autocast, monkeypatch):
    """The 4-bit base stands for its dequantised weight exactly: same outputs and gradients,
    bit for bit, as the op on that dense weight; and within the compute dtype's tolerance of
    the float64 reference. The Triton dequantisation ran (forward and backward)."""
    projections = [projection(o, i, dtype, adapter) for o, i in SHAPES[op]]
    x = torch.randn(3, 5, 64, device=DEVICE).to(dtype)
    backends = []  # of each dequantisation (on CUDA most are graph replays: test below)
    dequantize = quant4_ops._dequantize

    def counted(weight, *args, **kwargs):
        backends.append(quant4_ops._utils.backend(weight.quant_state.code))
        return dequantize(weight, *args, **kwargs)

    monkeypatch.setattr(quant4_ops, "_dequantize", counted)
    got, got_grads = step(op, x, projections, autocast)
    assert backends == [fusetune.backend(x)] * (2 * len(projections)), backends
    want, want_grads = step(op, x, dense_twin(projections), autocast)
    for g, w in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    exact = [(w.double(), a.double(), b.double(), s) for w, a, b, s in dense_twin(projections)]
    with torch.no_grad():
        x64 = x.double().cpu()
        exact = [tuple(t.cpu() if torch.is_tensor(t) else t for t in p) for p in exact]
        if op == "linear":
            ref = [lora_reference.lora_linear(x64, *exact[0])]
        elif op == "qkv":
            ref = list(lora_reference.lora_qkv(x64, *exact))
        else:
            ref = [lora_reference.lora_mlp(x64, *exact, "swiglu")]
    compute = BF16 if autocast else dtype
    for g, r in zip(got, ref, strict=True):
        assert_close("output", g, r, 1.5 * tolerance(compute))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: runs in the GPU pass")
def test_dense_replays_each_weights_graph_into_one_shared_buffer():
    """On CUDA, dense() captures a weight's dequantisation once and replays it into one buffer
    per device and dtype (grown for a larger weight: graphs captured again). A weight whose
    storage moves is captured again, and after MAX_RECAPTURES moves launched plainly; a dead
    weight's graph is forgotten. Every result equals a fresh dequantisation bit for bit."""
    small, large = (quantize(torch.randn(o, 128, device=DEVICE).to(BF16)) for o in (64, 256))
    for weight in (small, large, small, large, small):
        got = quant4_ops.dense(weight, BF16)
        assert torch.equal(got, fusetune.dequantize_4bit(weight))
    replays = [quant4_ops._replays[(id(w), BF16)] for w in (small, large)]
    assert all(isinstance(replay, quant4_ops._Replay) for replay in replays)
    assert got.data_ptr() == replays[0].out.data_ptr() == replays[1].out.data_ptr()
    assert replays[0].recaptures == 0  # captured again after the buffer grew: not a move
    for moves in range(1, quant4_ops.MAX_RECAPTURES + 2):
        small.data = small.data.clone()
        got = quant4_ops.dense(small, BF16)
        assert torch.equal(got, fusetune.dequantize_4bit(small))
        replay = quant4_ops._replays[(id(small), BF16)]
        assert (replay.graph is None) == (moves > quant4_ops.MAX_RECAPTURES), moves
    assert got.data_ptr() != replays[1].out.data_ptr()  # a plain launch's own tensor
    keys = [(id(large), BF16), (id(small), BF16)]
    del large, small, weight, replays, replay
    assert not any(key in quant4_ops._replays for key in keys)


def test_no_dense_copy_of_the_4bit_weight_is_saved():
    """Backward dequantises again: autograd keeps the packed codes, never a dense [out, in]."""
    weight, a, b, scaling = projection(96, 64, BF16, FP32)
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    x = torch.randn(4, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fusetune.lora_linear(x, weight, a, b, scaling).sum().backward()
    assert ((96, 64), BF16) not in saved, saved
    assert any(dtype == torch.uint8 for _, dtype in saved), saved


def test_compiled_backward_dequantises_again():
    """Under torch.compile the backward's dequantisation stays its own call: the compiled
    forward saves the packed codes for the backward, never a dense [out, in] weight (merged
    with the forward's call, it kept a whole dense model alive: QLoRA's memory)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def forward_compiler(graph, inputs):
        output = next(node for node in graph.graph.nodes if node.op == "output")
        saved.extend((tuple(arg.meta["val"].shape), arg.meta["val"].dtype)
                     for arg in output.args[0] if "val" in getattr(arg, "meta", {}))  # fmt: skip
        return graph

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda graph, inputs: graph,
                           partition_fn=min_cut_rematerialization_partition)  # fmt: skip
    weight, a, b, scaling = projection(96, 64, FP32, FP32)
    torch._dynamo.reset()
    step = torch.compile(lambda x: fusetune.lora_linear(x, weight, a, b, scaling),
                         backend=backend, fullgraph=True)  # fmt: skip
    x = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    step(x).sum().backward()
    assert saved and ((96, 64), FP32) not in saved, saved
    assert x.grad is not None and a.grad is not None


def test_4bit_errors_name_the_argument():
    weight, a, b, scaling = projection(40, 64, BF16, FP32)
    x = torch.randn(3, 64, device=DEVICE, dtype=BF16)
    assert_raises(TypeError, "bitsandbytes 4-bit weight", fusetune.dequantize_4bit, a)
    weight.quant_state.code = weight.quant_state.code[:8]
    assert_raises(ValueError, "weight is a 4-bit weight|code table of 8", fusetune.lora_linear,
                  x, weight, a, b, scaling)  # fmt: skip
    weight, a, b, scaling = projection(40, 64, BF16, FP32)
    assert_raises(ValueError, "lora_a must be [r, in]|64", fusetune.lora_linear, x, weight,
                  a[:, :32], b, scaling)  # fmt: skip
    assert_raises(ValueError, "x must be [..., in]|64", fusetune.lora_linear, x[:, :32], weight,
                  a, b, scaling)  # fmt: skip


# ----------------------------------------------------------------------------- bitsandbytes


def bnb_weight(shape, dtype, quant_type, blocksize, nested):
    bnb = pytest.importorskip("bitsandbytes")
    dense = torch.randn(*shape, dtype=dtype) / 8
    weight = bnb.nn.Params4bit(dense, requires_grad=False, quant_type=quant_type,
                               blocksize=blocksize, compress_statistics=nested)  # fmt: skip
    return weight._quantize("cpu").to(DEVICE) if DEVICE.type == "cpu" else weight.to(DEVICE)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_matches_the_formula_and_bitsandbytes(quant_type, blocksize, nested):
    """Rows of 256: whole blocks per row (bitsandbytes 0.50's CPU kernel blocks each row on its
    own; its CUDA kernel and fusetune block the flat weight: the same where rows are whole
    blocks; see the partial-block test)."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    for dtype in (BF16, FP16, FP32):
        weight = bnb_weight((48, 256), dtype, quant_type, blocksize, nested)
        got = fusetune.dequantize_4bit(weight)
        exact = reference.dequantize_4bit(weight, torch.float64)
        assert got.dtype == dtype and got.shape == (48, 256)
        assert_close("dequantised", got, exact, tolerance(dtype))
        want = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
        mine = reference.dequantize_4bit(weight)
        if nested and dtype == FP32 and DEVICE.type == "cuda":
            # the compiled kernel fuses the nested scale's multiply-add (one rounding), torch
            # and bitsandbytes' CUDA kernel round twice: 1 ulp apart in fp32
            assert_close("against bitsandbytes", got, want, 2e-7)
            assert_close("against the reference", got, mine, 2e-7)
        else:
            assert torch.equal(got, want), (got - want).abs().max()
            assert torch.equal(got, mine)
        assert fusetune.dequantize_4bit(weight, FP32).dtype == FP32


def test_partial_last_block_follows_the_blockwise_formula():
    """33 x 64 elements in blocks of 128 end on half a block: fusetune reads it as
    bitsandbytes' generic (and CUDA) dequantisation does. (bitsandbytes 0.50's AVX-512 CPU
    kernel reads such a block differently; fusetune does not follow it.)"""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    weight = bnb_weight((33, 64), BF16, "nf4", 128, False)
    state = weight.quant_state
    want = _dequantize_4bit_compute(weight.data.reshape(-1), state.absmax, state.code, 128,
                                    state.shape, BF16)  # fmt: skip
    assert torch.equal(fusetune.dequantize_4bit(weight), want)


@pytest.mark.parametrize("shape", [(3, 21), (5, 64), (1, 2049)])
def test_dequantize_kernel_on_odd_and_partial_sizes(shape):
    """The kernel reads a byte (two elements) per lane: an odd element count ends on half a
    byte, and the last program on a partial block of lanes; every element equals the formula."""
    weight = quantize(torch.randn(shape, device=DEVICE) / 8, blocksize=64)
    for dtype in (BF16, FP32):
        got = quant4_ops.dequantize_4bit(weight, dtype)
        assert got.shape == shape and torch.equal(got, reference.dequantize_4bit(weight, dtype))


def test_peft_qlora_layers_route_through_fusetune(monkeypatch):
    """PEFT's LoRA on bitsandbytes Linear4bit bases (an attention block and an MLP): patched
    outputs and gradients match PEFT's own 4-bit path, and the fused ops ran."""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from test_lora_peft import MLP, Attention, step

    calls = {"qkv": 0, "mlp": 0}

    def counting(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(integration, "lora_qkv_validated",
                        counting("qkv", integration.lora_qkv_validated))  # fmt: skip
    monkeypatch.setattr(integration, "lora_mlp_validated",
                        counting("mlp", integration.lora_mlp_validated))  # fmt: skip
    for module, targets in ((Attention(), ["q_proj", "k_proj", "v_proj", "o_proj"]),
                            (MLP(), ["gate_proj", "up_proj", "down_proj"])):  # fmt: skip
        module = module.to(BF16)
        for name in targets:
            dense = getattr(module, name)
            layer = bnb.nn.Linear4bit(dense.in_features, dense.out_features,
                                      bias=dense.bias is not None, compute_dtype=BF16,
                                      quant_type="nf4")  # fmt: skip
            layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False,
                                             quant_type="nf4")  # fmt: skip
            if dense.bias is not None:
                layer.bias = torch.nn.Parameter(dense.bias.data, requires_grad=False)
            setattr(module, name, layer)
        module = module.to(DEVICE) if DEVICE.type == "cuda" else module
        for layer in module.modules():
            if isinstance(layer, bnb.nn.Linear4bit) and DEVICE.type == "cpu":
                layer.weight = layer.weight._quantize("cpu")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        model = peft.inject_adapter_in_model(config, module)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = torch.randn_like(param, dtype=FP32) * 0.3
                param.requires_grad_(True)
        x = torch.randn(2, 7, 24, device=DEVICE, dtype=BF16)
        want, want_grads = step(model, x, autocast=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no layer may stay on PEFT's path
            integration.apply(model)
        assert integration.patched(model)
        got, got_grads = step(model, x, autocast=False)
        integration.unpatch(model)
        assert_close("output", got, want, 2 * tolerance(BF16))
        for name, grad in want_grads.items():
            assert got_grads[name].dtype == grad.dtype, name
            assert_close(f"grad {name}", got_grads[name], grad, 2 * tolerance(BF16))
    assert calls == {"qkv": 1, "mlp": 1}, calls


def test_finetune_load_in_4bit_trains_and_saves_a_peft_adapter(tmp_path, monkeypatch, capsys):
    """finetune --load-in-4bit: the base's linear layers become NF4 Linear4bit, every LoRA layer
    goes through fusetune's ops (none stays on PEFT's path), and the adapter loads onto the
    16-bit base with PEFT."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from fusetune.finetune import main, models

    calls = []
    mlp = integration.lora_mlp_validated
    monkeypatch.setattr(integration, "lora_mlp_validated",
                        lambda *a: calls.append(1) or mlp(*a))  # fmt: skip
    output = tmp_path / "qlora"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*stays on PEFT's path.*")
        argv = ["--load-in-4bit", "--steps", "2", "--batch-size", "2", "--seq-len", "32"]
        code = main([*argv, "--output", str(output)])
    out = capsys.readouterr().out
    assert code == 0 and "NF4 4-bit base (QLoRA)" in out
    assert len(calls) == 2 * 2  # one fused LoRA MLP per layer and step
    base = models.build(models.resolve("tiny-llama"), torch.float32, torch.device("cpu"), seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(output))
    assert sum("lora_B" in n for n, _ in loaded.named_parameters()) == 2 * 7
