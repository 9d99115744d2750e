"""fusetune's LoRA ops against PEFT's own LoRA layers on the same weights, and the PEFT
integration (fusetune.integrations.peft) on a tiny random-init Llama."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusetune.integrations import peft as integration
from harness import DEVICE, assert_close, relative_error, tolerance

peft = pytest.importorskip("peft")
# transformers 5.2x renames gradient checkpointing; the old names still work on every version.
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
transformers = pytest.importorskip("transformers")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MIXED = [(BF16, FP32), (BF16, BF16), (FP16, FP32), (FP16, FP16), (FP32, FP32)]
MIXED_IDS = ["bf16-fp32", "bf16", "fp16-fp32", "fp16", "fp32"]
RANK, ALPHA = 4, 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class MLP(torch.nn.Module):
    """transformers' LlamaMLP, without a config."""

    def __init__(self, hidden=24, intermediate=40, act_fn=F.silu):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Attention(torch.nn.Module):
    def __init__(self, hidden=24, kv=8):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=True)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=True)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=True)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q * torch.cat([k] * 3, -1) + torch.cat([v] * 3, -1))


def with_lora(module, base_dtype, adapter_dtype, targets, **config):
    """``module`` with PEFT LoRA layers injected: frozen base in base_dtype, adapters in
    adapter_dtype with a random (non-zero) B."""
    module = module.to(DEVICE, base_dtype).requires_grad_(False)
    settings = dict(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    lora_config = peft.LoraConfig(**{**settings, **config})
    model = peft.inject_adapter_in_model(lora_config, module)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = (torch.randn_like(param, dtype=FP32) * 0.3).to(adapter_dtype)
            param.requires_grad_(True)
    return model


def adapter_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def step(model, x, autocast):
    """Output and the gradients of x and every adapter for one forward + backward."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast(DEVICE.type, dtype=BF16, enabled=autocast):
        out = model(x)
    upstream = torch.linspace(-1, 1, out.numel(), device=DEVICE).view(out.shape)
    out.backward(upstream.to(out.dtype))
    grads = {"x": x.grad}
    for name, param in adapter_params(model).items():
        grads[name], param.grad = param.grad, None
    return out, grads


def compare_with_peft(model, x, autocast, compute):
    """Patched (fusetune) vs PEFT's own forward on the same module and weights: outputs and
    gradients agree within two single-pass tolerances of the compute dtype (each is within one
    of the exact result), and every gradient has PEFT's dtype."""
    want, want_grads = step(model, x, autocast)
    integration.apply(model)
    assert integration.patched(model), "nothing was patched"
    got, got_grads = step(model, x, autocast)
    integration.unpatch(model)
    tol = 2 * tolerance(compute)
    assert got.dtype == want.dtype
    assert_close("output", got, want, tol)
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == grad.dtype, name
        assert_close(f"grad {name}", got_grads[name], grad, tol)


@pytest.mark.parametrize("autocast", [False, True], ids=["noamp", "amp"])
@pytest.mark.parametrize("base,adapter", MIXED, ids=MIXED_IDS)
@pytest.mark.parametrize("block", ["attention", "mlp"])
def test_against_peft_lora_layers(block, base, adapter, autocast):
    """Every base x adapter dtype, with and without autocast: the attention block covers
    lora_qkv (with biases) and lora_linear (o_proj), the MLP block lora_mlp."""
    module = Attention() if block == "attention" else MLP()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if block == "attention" else ALL_TARGETS[4:]
    model = with_lora(module, base, adapter, targets)
    x = torch.randn(2, 7, 24, device=DEVICE).to(base)
    compare_with_peft(model, x, autocast, BF16 if autocast else base)


def tiny_llama(dtype=FP32, **lora_config):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, dtype)
    settings = dict(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ALL_TARGETS)
    settings.update(lora_config)
    model = peft.get_peft_model(model, peft.LoraConfig(**settings))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would leave A without gradient
            torch.nn.init.normal_(param, std=0.2)
    return model


def llama_step(model, tokens, autocast=False):
    with torch.autocast(DEVICE.type, dtype=BF16, enabled=autocast):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {}
    for name, param in adapter_params(model).items():
        grads[name], param.grad = param.grad, None
    return loss.detach(), grads


@pytest.mark.parametrize(
    "dtype,autocast,checkpointing",
    [(FP32, False, False), (BF16, True, False), (FP32, False, True)],
    ids=["fp32", "bf16-amp", "fp32-checkpointing"],
)
def test_tiny_llama_patched_and_unpatched(dtype, autocast, checkpointing):
    """Same loss and adapter gradients through fusetune as through PEFT; unpatch restores
    PEFT's forwards exactly (same loss bit for bit, every module's class back, no instance
    forward left behind)."""
    model = tiny_llama(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    tokens = torch.randint(0, 96, (2, 11), device=DEVICE)
    want_loss, want_grads = llama_step(model, tokens, autocast)
    before = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    classes = {n: type(m) for n, m in model.named_modules()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything qualifies: no warning
        integration.apply(model)
    names = integration.patched(model)
    assert sum(n.endswith(".mlp") for n in names) == 2, names
    assert sum(n.endswith("self_attn.k_proj") for n in names) == 2, names
    assert sum(n.endswith("o_proj") for n in names) == 2, names
    got_loss, got_grads = llama_step(model, tokens, autocast)

    assert set(got_grads) == set(want_grads)
    if dtype == FP32:
        assert_close("loss", got_loss, want_loss, 1e-5)
        for name, grad in want_grads.items():
            assert_close(name, got_grads[name], grad, 1e-5)
    else:  # bf16 all through the model: about as close to the float64 result as PEFT is
        exact_loss, exact_grads = llama_step(copy.deepcopy(model).double(), tokens)
        assert_close("loss", got_loss, exact_loss, 1e-2)
        ours, theirs = [], []
        for name, grad in want_grads.items():
            assert got_grads[name].dtype == grad.dtype
            ours.append(relative_error(got_grads[name], exact_grads[name]))
            theirs.append(relative_error(grad, exact_grads[name]))
            assert ours[-1] <= 3 * theirs[-1] + 5e-3, f"{name}: {ours[-1]:.3g} vs {theirs[-1]:.3g}"
        # 28 gradients of a 2-layer model: single ones scatter (0.5x - 2x of PEFT's error)
        assert sum(ours) <= 1.3 * sum(theirs), f"{sum(ours):.3g} vs PEFT {sum(theirs):.3g}"

    integration.unpatch(model)
    assert {n for n, m in model.named_modules() if "forward" in m.__dict__} == before
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert integration.patched(model) == []
    again, _ = llama_step(model, tokens, autocast)
    assert torch.equal(again, want_loss)


def test_patched_forwards_are_shared_and_survive_copies_and_pickles():
    """Every patched module of a kind runs one forward, through its class (no per-module
    object for Dynamo to guard by identity: compiled layer by layer, the layers share a graph,
    see test_compile_layers); names and isinstance are PEFT's; a deepcopy and a pickled copy
    stay patched and compute the same loss; the state dict's keys are unchanged."""
    model = tiny_llama()
    keys = list(model.state_dict())
    integration.apply(model)
    layers = model.get_base_model().model.layers
    for kind in ("mlp", "self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj"):
        first, second = (layer.get_submodule(kind) for layer in layers)
        assert "forward" not in first.__dict__ and type(first) is type(second), kind
        assert type(first).__name__ == type(first).__mro__[1].__name__, kind
    assert isinstance(layers[0].mlp.down_proj, peft.tuners.lora.layer.Linear)
    assert list(model.state_dict()) == keys
    tokens = torch.randint(0, 96, (2, 11), device=DEVICE)
    want, _ = llama_step(model, tokens)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert integration.patched(copied) == integration.patched(model)
        assert torch.equal(llama_step(copied, tokens)[0], want)
        integration.unpatch(copied)
        assert type(copied.get_base_model().model.layers[0].mlp) is type(layers[0].mlp).__base__
    integration.unpatch(model)


@pytest.mark.parametrize(
    "config,reason",
    [
        (dict(lora_dropout=0.1), "lora_dropout"),
        (dict(use_dora=True), "DoRA"),
        (dict(lora_bias=True), "LoRA bias"),
    ],
    ids=["dropout", "dora", "lora-bias"],
)
def test_unsupported_layers_stay_on_peft_with_one_warning(config, reason):
    model = with_lora(MLP(), FP32, FP32, ALL_TARGETS[4:], **config)
    with pytest.warns(UserWarning, match=reason) as record:
        integration.apply(model)
    assert integration.patched(model) == []
    messages = [str(w.message) for w in record]
    assert len(messages) == 3 and all("stays on PEFT's path" in m for m in messages)
    assert any("gate_proj" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.apply(model)  # said once
        model(torch.randn(3, 24, device=DEVICE))
    integration.unpatch(model)


def test_partial_targets_and_unknown_activation():
    """Only q and v adapted (PEFT's Llama default): each through lora_linear. An MLP with an
    activation lora_mlp does not have: its layers one by one, with a warning for the MLP."""
    attention = with_lora(Attention(), FP32, FP32, ["q_proj", "v_proj"])
    integration.apply(attention)
    assert integration.patched(attention) == ["q_proj", "v_proj"]
    mlp = with_lora(MLP(act_fn=F.relu), FP32, FP32, ALL_TARGETS[4:])
    with pytest.warns(UserWarning, match="act_fn"):
        integration.apply(mlp)
    assert integration.patched(mlp) == ["gate_proj", "up_proj", "down_proj"]
    x = torch.randn(2, 24, device=DEVICE)
    for model in (attention, mlp):
        got = model(x)
        integration.unpatch(model)
        assert_close("output", got, model(x), 1e-5)


def test_disabled_and_merged_adapters_fall_back_to_peft():
    model = tiny_llama()
    tokens = torch.randint(0, 96, (1, 9), device=DEVICE)
    integration.apply(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), model.disable_adapter():
            disabled = model(input_ids=tokens).logits
    integration.unpatch(model)
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(disabled, model(input_ids=tokens).logits)


def test_qkv_results_are_handed_out_only_for_the_same_input():
    model = with_lora(Attention(), FP32, FP32, ["q_proj", "k_proj", "v_proj"])
    x, other = torch.randn(2, 24, device=DEVICE), torch.randn(2, 24, device=DEVICE)
    want = {name: getattr(model, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
    want_other = model.k_proj(other)
    integration.apply(model)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert_close(name, getattr(model, name)(x), want[name], 1e-5)
    model.q_proj(x)
    assert_close("k", model.k_proj(other), want_other, 1e-5)  # another input: its own result
    integration.unpatch(model)


def test_qkv_other_input_compiles_in_one_graph():
    """k_proj on another input than q_proj's, compiled whole: the input check stays traceable
    (no data_ptr under Dynamo) and k_proj computes its own result."""
    model = with_lora(Attention(), FP32, FP32, ["q_proj", "k_proj", "v_proj"])
    x, other = torch.randn(2, 24, device=DEVICE), torch.randn(2, 24, device=DEVICE)
    want = model.k_proj(other)
    integration.apply(model)

    def q_then_k(x, other):
        model.q_proj(x)
        return model.k_proj(other)

    backend = "inductor" if DEVICE.type == "cuda" else "aot_eager"
    got = torch.compile(q_then_k, fullgraph=True, backend=backend)(x, other)
    assert_close("k", got, want, 1e-5)
    integration.unpatch(model)


class PostBackwardFunctionModule(torch.autograd.Function):
    """An identity as DeepSpeed ZeRO-3's forward pre-hook applies to every module's inputs."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_qkv_input_recognised_through_zero3_hooks_only():
    """k_proj gets q_proj's results for the input ZeRO-3's hooks re-wrap per module, and not
    for a detached copy (whose gradient must stop) nor an equal tensor elsewhere."""
    x = torch.randn(2, 24, device=DEVICE, requires_grad=True) * 1.0
    wrapped_q, wrapped_k = PostBackwardFunctionModule.apply(x), PostBackwardFunctionModule.apply(x)
    assert integration._same_input(wrapped_q, wrapped_k)
    assert integration._same_input(x, x)
    assert not integration._same_input(x, x.detach())
    assert not integration._same_input(wrapped_q, PostBackwardFunctionModule.apply(x.clone()))
    unrelated = torch.randn(2, 24, device=DEVICE, requires_grad=True) * 1.0
    assert not integration._same_input(wrapped_q, PostBackwardFunctionModule.apply(unrelated))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.mlp = Attention(), MLP()

    def forward(self, x):
        return self.mlp(self.attention(x))


def lora_layers(model):
    return [m for m in model.modules() if integration.is_lora_layer(m)]


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")
def test_routing_follows_adapter_state_changes_after_the_first_forward(monkeypatch):
    """The qualification is cached per layer: switching the active adapter, disabling,
    merging, a new scaling, a replaced adapter tensor or an unfrozen base after the first
    forward route each call (fused op or PEFT) and compute it exactly as PEFT does."""
    model = with_lora(Block(), FP32, FP32, ALL_TARGETS)
    other = peft.LoraConfig(r=2, lora_alpha=3, target_modules=ALL_TARGETS, lora_dropout=0.0)
    model = peft.inject_adapter_in_model(other, model, adapter_name="other")
    for name, param in model.named_parameters():
        if "lora_" in name and ".other." in name:
            param.data = torch.randn_like(param) * 0.3
    for layer in lora_layers(model):
        layer.set_adapter("default")
    reference = copy.deepcopy(model)  # never patched: PEFT's own forwards
    fused = {"linear": 0, "qkv": 0, "mlp": 0}
    for kind in fused:
        op = getattr(integration, f"lora_{kind}_validated")

        def spy(*args, _op=op, _kind=kind):
            fused[_kind] += 1
            return _op(*args)

        monkeypatch.setattr(integration, f"lora_{kind}_validated", spy)
    integration.apply(model)
    x = torch.randn(3, 24, device=DEVICE)

    def check(change, routed):
        for each in (model, reference):
            change(each)
        fused.update(linear=0, qkv=0, mlp=0)
        assert_close("output", model(x), reference(x), 1e-5)
        want = routed if isinstance(routed, dict) else dict(linear=routed, qkv=routed, mlp=routed)
        assert fused == want, fused

    def for_layers(method, *args):
        return lambda each: [getattr(layer, method)(*args) for layer in lora_layers(each)]

    check(lambda each: None, 1)  # fills the cache
    check(lambda each: None, 1)  # from the cache
    check(for_layers("set_adapter", "other"), 1)
    check(for_layers("enable_adapters", False), 0)
    check(for_layers("enable_adapters", True), 1)
    check(for_layers("merge"), 0)
    check(for_layers("unmerge"), 1)
    check(for_layers("set_scale", "other", 0.5), 1)

    def new_b(each):
        torch.manual_seed(1)
        b = each.mlp.down_proj.lora_B["other"]
        b.weight = torch.nn.Parameter(torch.randn_like(b.weight))

    check(new_b, 1)
    with pytest.warns(UserWarning, match="trainable"):
        unfreeze = lambda each: each.attention.o_proj.base_layer.weight.requires_grad_(True)
        check(unfreeze, dict(linear=0, qkv=1, mlp=1))
