"""fusetune.apply (fusetune.integrations.transformers) on tiny random-init models of every
supported family: trained patched and unpatched on the same data, the per-step losses and the
parameter updates match (tight in fp32, "as close to fp32 as transformers is" in bf16); with
PEFT LoRA, gradient accumulation, gradient checkpointing and torch.compile; the logits path,
class-level patching, revert and the errors.

CPU (CI, Triton interpreter, ~1 s per fused training step): 2-layer models (1 layer where a
test is not about training), 2 x 8 tokens, 2 steps. GPU: 4 x 64 tokens, 30 steps, every
family in bf16 and with LoRA as well."""

from __future__ import annotations

import copy
import inspect
import types
import warnings

import pytest
import torch

import fusetune
from fusetune.integrations import _transformers_forwards as forwards
from fusetune.integrations import peft as peft_integration
from fusetune.integrations import transformers as integration
from harness import DEVICE, ON_GPU, assert_close, relative_error

# peft first: importing it swaps sys.modules["transformers"] for a new module object (same
# submodules and classes), and the version test patches the one fusetune will read.
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

FAMILIES = integration.SUPPORTED_FAMILIES
VOCAB, LAYERS = 128, 2
# CPU: 2 steps, each family's second AdamW update reads the first step's moments (3 cost a
# third more interpreter time: the Gated DeltaNet families take ~12 s a step)
BATCH, SEQ, STEPS = (4, 64, 30) if ON_GPU else (2, 8, 2)
# AdamW. At lr 1e-2 tiny models train chaotically and rounding differences grow fast. eps:
# an element whose gradient is ~0 moves by lr * g / (|g| + eps), so with the default 1e-8 a
# 1e-7 relative gradient difference can turn its step around (measured: 2e-3 update error
# from one such element); 1e-5 keeps the comparison about the gradients.
LR, ADAM_EPS = 1e-3, 1e-5
FP32_LOSS_TOL = 1e-5  # relative error of the per-step loss vector (measured ~1e-7)
FP32_UPDATE_TOL = 1e-3  # per parameter tensor, relative error of (final - initial) (~1e-5)
# Gemma 4's per-layer embeddings amplify fp32 rounding: one step's gradients agree within
# 1e-5 relative (every parameter, fused norms / GLU vs transformers'), its updates after 3
# AdamW steps within 2.5e-3 to 1.2e-2 from run to run (measured on the CPU).
# Over the GPU pass's 30 steps its per-step losses drift to 6.3e-5 and its updates to 2.5e-2
# (H100). Qwen3.5-MoE's routing (top-k of router logits that differ by rounding) moved its
# losses by 1.25e-4 there.
LOSS_TOL = {"gemma4": 2e-4, "qwen3_5_moe": 5e-4}
# The Gated DeltaNet layers likewise: gradients within 5e-6 (dt_bias, A_log), updates 1.5e-3.
# Qwen3.5-MoE's updates after the GPU's 30 steps: 1.7e-2, then 3.2e-2 (H100, router weight) once
# the gated norm and the short convolution were fused too: the same routing flips.
UPDATE_TOL = {"gemma4": 5e-2, "qwen3_5": 5e-3, "qwen3_next": 5e-3, "qwen3_5_moe": 5e-2}

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,  # hidden / heads (some configs default it to None)
    max_position_embeddings=128,
    initializer_range=0.1,  # logits of order 1, so that Gemma's softcap matters
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_SLIDING = dict(sliding_window=16)
_LINEAR_ATTENTION = dict(  # Qwen3.5 / Qwen3-Next: one Gated DeltaNet layer, one attention layer
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
# output_router_logits: the loss includes the router's load-balancing loss
_EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True
)
_LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
FAMILY_CONFIG = {
    "gemma2": dict(
        final_logit_softcapping=2.0,
        attn_logit_softcapping=50.0,
        query_pre_attn_scalar=8,
        **_SLIDING,
    ),
    "gemma3": dict(head_dim=8, final_logit_softcapping=2.0, query_pre_attn_scalar=8, **_SLIDING),
    # its per-layer embeddings tiny too (by default 262144 x 256 per layer: 134M parameters,
    # 48 s of the CPU pass's AdamW steps) and the global layers' head_dim (by default 512)
    "gemma4": dict(
        head_dim=8,
        global_head_dim=16,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=2.0,
        **_SLIDING,
    ),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(logit_scale=0.5),
    "granite": dict(
        logits_scaling=4.0,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
    ),
    # no router logits: transformers 5.17's GraniteMoe adds an int aux loss and fails with them
    "granitemoe": dict(logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_5": dict(**_LINEAR_ATTENTION),
    "qwen3_next": dict(**_LINEAR_ATTENTION, **_EXPERTS, shared_expert_intermediate_size=16),
    "qwen3_5_moe": dict(**_LINEAR_ATTENTION, **_EXPERTS, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(**_EXPERTS, mlp_only_layers=[0]),
    "qwen2_moe": dict(**_EXPERTS, shared_expert_intermediate_size=16, mlp_only_layers=[0]),
    "mixtral": _LOCAL_EXPERTS,
    "gpt_oss": dict(
        **_LOCAL_EXPERTS,
        layer_types=["sliding_attention", "full_attention"],
        **_SLIDING,
    ),
    "olmo3": _SLIDING,
}
# Fused calls per forward of the LAYERS-layer tiny model, where they differ from 2 RMSNorms,
# one rope and one gated MLP per layer plus the final norm and the loss: q/k norms (Qwen3,
# OLMo 2, Gemma 3 / 4), sandwich norms (Gemma 2-4, GLM-4), one attention layer of two (Qwen3.5
# / Qwen3-Next), experts that stay transformers' own (no dense MLP), LayerNorm (Cohere).
CALLS = {
    "qwen3": dict(rms_norm=9),
    "exaone4": dict(rms_norm=9),
    "hunyuan_v1_dense": dict(rms_norm=9),
    "olmo2": dict(rms_norm=9),
    "olmo3": dict(rms_norm=9),
    "glm4": dict(rms_norm=9),
    "gemma2": dict(rms_norm=9),
    "gemma3": dict(rms_norm=13),
    "gemma4": dict(rms_norm=16, rope=4),  # q and k rotated in separate calls
    "qwen3_5": dict(rms_norm=7, rope=1, rms_norm_gated=1),  # the linear layer's gated norm
    "qwen3_next": dict(rms_norm=7, rope=1, rms_norm_gated=1),
    "qwen3_5_moe": dict(rms_norm=7, rope=1, rms_norm_gated=1),
    "qwen3_moe": dict(rms_norm=9, glu=1),  # layer 0 dense, layer 1 experts
    "mixtral": dict(glu=0),
    "granitemoe": dict(glu=0),
    "gpt_oss": dict(glu=0),
    "cohere": dict(rms_norm=0),
    "cohere2": dict(rms_norm=0),
}


# Layers routed to fusetune.gated_delta_rule / moe_mlp in the tiny models.
ROUTED = {
    "qwen3_5": dict(gated_delta=1),
    "qwen3_next": dict(gated_delta=1, experts=2),
    "qwen3_5_moe": dict(gated_delta=1, experts=2),
    "qwen3_moe": dict(experts=1),
    "qwen2_moe": dict(experts=1),
    "mixtral": dict(experts=2),
    "granitemoe": dict(experts=2),
    "gpt_oss": dict(experts=2),
}


# Llama-like decoder layers: the attention's residual add fuses into the post-attention norm
# (one add_rms_norm instead of an rms_norm per layer).
FUSED_RESIDUAL = {
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "smollm3", "helium",
    "hunyuan_v1_dense", "glm", "gemma", "qwen2_moe", "qwen3_moe",
}  # fmt: skip


def expected_calls(family: str, layers: int = LAYERS) -> dict[str, int]:
    calls = {"rms_norm": 2 * layers + 1, "rope": layers, "glu": layers, "linear_cross_entropy": 1,
             "rms_norm_gated": 0}  # fmt: skip
    calls = {**calls, **(CALLS.get(family, {}) if layers == LAYERS else {}), "add_rms_norm": 0}
    # full fine-tuning: every gated MLP's product and down projection are one glu_linear
    calls["glu_linear"] = calls["glu"]
    if family in FUSED_RESIDUAL:
        calls["rms_norm"] -= layers
        calls["add_rms_norm"] = layers
    return calls


# eager attention: what Gemma trains with; gpt-oss's sinks
EAGER = ("gemma2", "gemma3", "gemma4", "gpt_oss")


def tiny_model(family: str, dtype: torch.dtype = torch.float32, **overrides):
    settings = {**CONFIG, **FAMILY_CONFIG.get(family, {}), **overrides}
    model_type = forwards.FAMILIES[family].text_model_type or family
    config = transformers.AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    attention = "eager" if family in EAGER else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(DEVICE, dtype)


def make_batches(count: int, batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> list:
    """Random token batches whose labels mask a prompt of random length per row (-100)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (batch, seq), generator=generator)
        prompt = torch.randint(1, seq // 2, (batch, 1), generator=generator)
        labels = ids.masked_fill(torch.arange(seq) < prompt, -100)
        batches.append((ids.to(DEVICE), labels.to(DEVICE)))
    return batches


def train(model, batches, *, autocast=None, accumulate=1, compiled=None):
    """AdamW steps over ``batches``; each batch split into ``accumulate`` micro-batches whose
    losses are scaled by HF's num_items_in_batch. Returns (per-step losses, updates by name)."""
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=LR, eps=ADAM_EPS)
    forward = model if compiled is None else compiled
    losses = []
    for ids, labels in batches:
        step_loss = torch.zeros((), device=DEVICE)
        items = (labels[:, 1:] != -100).sum() if accumulate > 1 else None
        micro_batches = zip(ids.chunk(accumulate), labels.chunk(accumulate), strict=True)
        for micro_ids, micro_labels in micro_batches:
            extra = {} if items is None else {"num_items_in_batch": items}
            with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
                loss = forward(input_ids=micro_ids, labels=micro_labels, **extra).loss
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    updates = {n: (p.detach() - start[n]).float() for n, p in trainable.items()}
    return torch.stack(losses).cpu(), updates


def counting(counts: dict[str, int], name: str, function):
    """``function``, adding each of its calls to ``counts[name]`` (which starts at 0)."""
    counts.setdefault(name, 0)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return function(*args, **kwargs)

    return wrapper


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused ops the patched forwards call (they look them up at call time). "glu":
    a gated MLP's fused product, alone (GLU_OPS) or with its down projection ("glu_linear",
    counted under both names)."""
    names = ["rms_norm", "add_rms_norm", "rms_norm_gated", "rope", "linear_cross_entropy"]
    counts = dict.fromkeys([*names, "glu", "glu_linear"], 0)
    for name in names:
        monkeypatch.setattr(forwards, name, counting(counts, name, getattr(forwards, name)))
    glu_ops = {kind: counting(counts, "glu", op) for kind, op in forwards.GLU_OPS.items()}
    monkeypatch.setattr(forwards, "GLU_OPS", glu_ops)
    glu_linear = counting(counts, "glu_linear", counting(counts, "glu", forwards.glu_linear))
    monkeypatch.setattr(forwards, "glu_linear", glu_linear)
    return counts


@pytest.fixture(autouse=True)
def _nothing_left_patched():
    """Transformers as it was after every test (a failed test may leave patches behind)."""
    yield
    for family in FAMILIES:
        integration.revert(family)  # class-level patches
        slot = integration._ROPE.get(family)
        if slot is not None and slot.original is not None:  # instances never reverted
            forwards.FAMILIES[family].modeling.apply_rotary_pos_emb = slot.original
            slot.original, slot.class_level = None, False
            slot.holders.clear()


def assert_same_training(got, want, loss_tol=FP32_LOSS_TOL, update_tol=FP32_UPDATE_TOL):
    (got_losses, got_updates), (want_losses, want_updates) = got, want
    assert_close("per-step losses", got_losses, want_losses, loss_tol)
    assert set(got_updates) == set(want_updates)
    for name, update in want_updates.items():
        assert_close(f"update of {name}", got_updates[name], update, update_tol)


# ----------------------------------------------------------------------------- convergence


@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_transformers_fp32(family, fused_calls):
    """Every family, fp32: the same losses and parameter updates as transformers, step by
    step; every fused part ran on every forward (Cohere: its LayerNorms stay HF's)."""
    model = tiny_model(family)
    batches = make_batches(STEPS)
    want = train(copy.deepcopy(model), batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about on a supported model
        fusetune.apply(model)
    routed = model.__dict__[integration._STATE].routed
    assert routed == {"gated_delta": 0, "experts": 0, **ROUTED.get(family, {})}
    got = train(model, batches)
    loss_tol = LOSS_TOL.get(family, FP32_LOSS_TOL)
    assert_same_training(got, want, loss_tol, UPDATE_TOL.get(family, FP32_UPDATE_TOL))
    assert fused_calls == {k: STEPS * n for k, n in expected_calls(family).items()}
    fusetune.revert(model)


BF16_FAMILIES = FAMILIES if ON_GPU else ("llama", "gemma2")


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_training_bf16_autocast_as_close_as_transformers(family):
    """bf16 autocast over fp32 weights (HF Trainer's bf16=True): patched and unpatched runs
    are each compared with the fp32 run; fusetune's distance is within 1.5x transformers'
    (losses: plus 1e-3; parameter updates: summed over tensors, and 2x for the worst)."""
    model = tiny_model(family)
    batches = make_batches(STEPS)
    exact = train(copy.deepcopy(model), batches)
    want = train(copy.deepcopy(model), batches, autocast=torch.bfloat16)
    got = train(fusetune.apply(model), batches, autocast=torch.bfloat16)
    fusetune.revert(model)
    assert_as_close_as_transformers(got, want, exact)


def assert_as_close_as_transformers(got, want, exact) -> None:
    """fusetune's (losses, updates) ``got`` are within 1.5x (2x for the worst tensor) of
    transformers' own ``want`` distance from the fp32 run ``exact``, plus a small floor."""
    ours, theirs = relative_error(got[0], exact[0]), relative_error(want[0], exact[0])
    assert ours <= 1.5 * theirs + 1e-3, f"losses: {ours:.3g} vs transformers {theirs:.3g}"
    # Each tensor's distance counts up to 1: past 100 % an update is noise in both runs, and
    # noise amplitudes are not comparable (glm4's k_proj bias, whose gradient sums rotated
    # per-token terms that nearly cancel: transformers 0.65, fusetune 1.30 in one GPU run).
    ours = {n: min(relative_error(u, exact[1][n]), 1.0) for n, u in got[1].items()}
    theirs = {n: min(relative_error(u, exact[1][n]), 1.0) for n, u in want[1].items()}
    assert sum(ours.values()) <= 1.5 * sum(theirs.values()) + 0.01, (ours, theirs)
    assert max(ours.values()) <= 2 * max(theirs.values()) + 0.01, (ours, theirs)


def lora_model(family: str, **overrides):
    model = peft.get_peft_model(
        tiny_model(family, **overrides),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )
    generator = torch.Generator().manual_seed(2)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would leave A without gradient
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


LORA_FAMILIES = FAMILIES if ON_GPU else ("llama", "gemma2", "phi3", "mixtral", "qwen3_next")


@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_peft_lora_training_matches(family):
    """A PeftModel: apply finds the transformers model inside and routes the LoRA layers
    through fusetune's LoRA ops (lora=True); adapter updates match PEFT's own."""
    model = lora_model(family)
    batches = make_batches(STEPS)
    want = train(copy.deepcopy(model), batches)
    fusetune.apply(model)
    routed = [n for n in integration.patched(model) if n]
    lora_layers = [n for n, m in model.named_modules() if peft_integration.is_lora_layer(m)]
    # every LoRA layer on fusetune's path: its own forward, or its MLP's fused one
    missed = [n for n in lora_layers if not any(n == r or n.startswith(f"{r}.") for r in routed)]
    assert lora_layers and not missed, missed
    got = train(model, batches)
    assert_same_training(got, want)
    fusetune.revert(model)
    assert integration.patched(model) == []


def test_gradient_accumulation_matches_transformers_and_the_full_batch():
    """Micro-batches with HF's num_items_in_batch (what Trainer passes with gradient
    accumulation): the same as transformers, and the summed loss equals the full batch's."""
    model = tiny_model("llama")
    batches = make_batches(1, batch=4)
    want = train(copy.deepcopy(model), batches, accumulate=2)
    fusetune.apply(model)
    got = train(copy.deepcopy(model), batches, accumulate=2)
    assert_same_training(got, want)
    full = train(model, batches)  # the whole batch at once, no accumulation
    assert_close("accumulated vs full-batch loss", got[0], full[0], FP32_LOSS_TOL)
    fusetune.revert(model)


def test_gradient_checkpointing():
    model = tiny_model("qwen3", num_hidden_layers=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = make_batches(2)
    want = train(copy.deepcopy(model), batches)
    got = train(fusetune.apply(model), batches)
    assert_same_training(got, want)
    fusetune.revert(model)


def test_torch_compile_of_the_patched_model(fused_calls):
    """torch.compile(fullgraph=True) of the patched model (no graph break; aot_eager on the
    CPU: traces the fake kernels and the autograd registrations; Inductor on the GPU) trains
    as the eager one does, its MLP through glu_linear."""
    model = fusetune.apply(tiny_model("llama", num_hidden_layers=1))
    batches = make_batches(2)
    want = train(copy.deepcopy(model), batches)
    assert fused_calls["glu_linear"] == len(batches)  # (eager)
    backend = "inductor" if ON_GPU else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = train(model, batches, compiled=compiled)
    assert fused_calls["glu_linear"] > len(batches)  # traced (at least once)
    assert_same_training(got, want)
    fusetune.revert(model)


# ----------------------------------------------------------------------------- forward paths


@pytest.mark.parametrize("family", ["gemma2", "cohere"])
def test_logits_without_labels_and_in_eval(family):
    """No labels: transformers' logits (softcap / scale applied), logits_to_keep honoured.
    Eval mode with labels: logits and the same loss as transformers; skip_logits=True gives
    the fused loss and no logits."""
    model = tiny_model(family, num_hidden_layers=1)
    reference = copy.deepcopy(model)
    fusetune.apply(model)
    ids, labels = make_batches(1)[0]
    model.eval(), reference.eval()
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels)
        got = model(input_ids=ids, labels=labels)
        assert_close("eval logits", got.logits, want.logits, 1e-5)
        assert_close("eval loss", got.loss, want.loss, 1e-5)
        fused = model(input_ids=ids, labels=labels, skip_logits=True)
        assert fused.logits is None
        assert_close("skip_logits loss", fused.loss, want.loss, 1e-5)
        last = model(input_ids=ids, logits_to_keep=1).logits
        assert_close("logits_to_keep=1", last, want.logits[:, -1:], 1e-5)
    model.train()
    out = model(input_ids=ids)
    assert out.loss is None and out.logits.shape == (*ids.shape, VOCAB)
    assert model(input_ids=ids, labels=labels).logits is None  # training: no logits
    tuple_out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tuple_out, tuple) and tuple_out[0].dim() == 0
    fusetune.revert(model)


def test_generate_matches_transformers():
    model = tiny_model("qwen2", num_hidden_layers=1)
    reference = copy.deepcopy(model).eval()
    fusetune.apply(model).eval()
    ids = make_batches(1, batch=1, seq=4)[0][0]
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **settings)
    got = model.generate(ids, **settings)
    assert torch.equal(got, want)
    fusetune.revert(model)


def test_loss_kwargs_shift_labels_and_ignore_index():
    """HF passes shift_labels (labels already shifted) and num_items_in_batch through
    **kwargs to the loss; the fused loss takes them the same way."""
    model = tiny_model("mistral", num_hidden_layers=1)
    reference = copy.deepcopy(model)
    fusetune.apply(model, rope=False, mlp=False, rms_norm=False)
    ids, labels = make_batches(1)[0]
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    kwargs = dict(input_ids=ids, labels=labels, shift_labels=shifted, num_items_in_batch=7)
    assert_close("loss", model(**kwargs).loss, reference(**kwargs).loss, 1e-5)
    fusetune.revert(model)


# ----------------------------------------------------------------------------- apply / revert


def instance_forwards(model) -> dict[str, object]:
    return {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}


def test_revert_restores_exactly_and_apply_is_idempotent():
    model = tiny_model("llama", num_hidden_layers=1)
    own = model.model.norm.forward  # an instance forward of the user's: kept through revert
    model.model.norm.forward = own
    modeling = transformers.models.llama.modeling_llama
    rope_before = modeling.apply_rotary_pos_emb
    ids, labels = make_batches(1)[0]
    before = model(input_ids=ids, labels=labels).loss
    forwards_before = instance_forwards(model)

    fusetune.apply(model, rope=False)
    parameters = inspect.signature(model.forward).parameters  # what Trainer and generate see
    assert {"input_ids", "labels", "logits_to_keep", "kwargs"} <= set(parameters)
    names = integration.patched(model)
    fusetune.apply(model, rope=False)
    assert integration.patched(model) == names
    once = model(input_ids=ids, labels=labels).loss
    assert_close("patched loss", once, before, FP32_LOSS_TOL)
    fusetune.apply(model)  # a second call may add parts: rope
    assert integration.patched(model) == [*names, "apply_rotary_pos_emb"]
    assert modeling.apply_rotary_pos_emb is not rope_before

    assert fusetune.revert(model) is model
    assert instance_forwards(model) == forwards_before
    assert modeling.apply_rotary_pos_emb is rope_before
    assert integration.patched(model) == []
    assert torch.equal(model(input_ids=ids, labels=labels).loss, before)


def test_revert_keeps_a_wrapper_set_after_apply():
    """accelerate wraps the model's forward (autocast for Trainer's bf16/fp16) after apply:
    revert keeps that wrapper, and the fusetune forward inside it hands over to
    transformers' own."""
    model = tiny_model("llama", num_hidden_layers=1)
    fusetune.apply(model, rope=False)
    inner = model.forward.__func__
    model.forward = types.MethodType(lambda self, **kwargs: inner(self, **kwargs), model)
    wrapper = model.forward
    ids, labels = make_batches(1)[0]
    assert model(input_ids=ids, labels=labels).logits is None  # fused
    fusetune.revert(model)
    assert model.forward is wrapper
    assert model(input_ids=ids, labels=labels).logits is not None  # transformers' path


def test_class_level_patching_before_construction(fused_calls):
    modeling = transformers.models.llama.modeling_llama
    classes = (
        modeling.LlamaRMSNorm,
        modeling.LlamaMLP,
        modeling.LlamaForCausalLM,
        modeling.LlamaDecoderLayer,
    )
    originals = [cls.__dict__["forward"] for cls in classes]
    rope_before = modeling.apply_rotary_pos_emb
    batches = make_batches(1)
    want = train(tiny_model("llama", num_hidden_layers=1), batches)

    assert fusetune.apply("llama") == "llama"
    patched_names = [
        "LlamaDecoderLayer.forward",
        "LlamaForCausalLM.forward",
        "LlamaMLP.forward",
        "LlamaRMSNorm.forward",
        "apply_rotary_pos_emb",
    ]
    assert integration.patched("llama") == patched_names
    model = tiny_model("llama", num_hidden_layers=1)  # built after patching
    assert instance_forwards(model) == {}
    got = train(model, batches)
    assert fused_calls == expected_calls("llama", layers=1)
    assert_same_training(got, want)
    fusetune.revert("llama")
    assert [cls.__dict__["forward"] for cls in classes] == originals
    assert modeling.apply_rotary_pos_emb is rope_before

    # a PreTrainedModel class stands for its family
    assert fusetune.apply(modeling.LlamaForCausalLM) is modeling.LlamaForCausalLM
    assert integration.patched(modeling.LlamaForCausalLM) == patched_names
    fusetune.revert(modeling.LlamaModel)
    assert [cls.__dict__["forward"] for cls in classes] == originals
    assert modeling.apply_rotary_pos_emb is rope_before


def test_instance_and_class_patches_share_the_rope_function():
    modeling = transformers.models.qwen3.modeling_qwen3
    rope_before = modeling.apply_rotary_pos_emb
    first, second = tiny_model("qwen3", num_hidden_layers=1), tiny_model("qwen3")
    fusetune.apply(first), fusetune.apply(second), fusetune.apply("qwen3")
    fusetune.revert(first)
    fusetune.revert("qwen3")
    assert modeling.apply_rotary_pos_emb is not rope_before  # second still holds it
    fusetune.revert(second)
    assert modeling.apply_rotary_pos_emb is rope_before


def test_lora_false_leaves_peft_layers_alone():
    model = lora_model("llama")
    fusetune.apply(model, lora=False)
    names = integration.patched(model)
    assert not any(n.endswith("_proj") for n in names), names
    assert any(n.endswith("mlp") for n in names), names  # the MLP product is still fused
    fusetune.revert(model)


# ----------------------------------------------------------------------------- errors


def test_unknown_family_lists_the_supported_ones():
    supported = ", ".join(FAMILIES)
    with pytest.raises(
        ValueError, match=f"'gpt2' is not a model family .*; supported: {supported}"
    ):
        fusetune.apply("gpt2")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    gpt2 = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model type 'gpt2'\) is not"):
        fusetune.apply(gpt2)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model type 'gpt2'\) is not"):
        fusetune.apply(transformers.GPT2LMHeadModel)
    with pytest.raises(ValueError, match="'bert' is not a model family"):
        fusetune.revert("bert")


def test_a_family_that_does_not_map_says_why():
    with pytest.raises(ValueError, match=r"'gemma3n' is not .* \(its AltUp .*\); supported"):
        fusetune.apply("gemma3n")


def test_a_text_model_type_belongs_to_its_family():
    assert fusetune.apply("gemma3_text") == "gemma3_text"  # Gemma3ForCausalLM's config type
    assert "Gemma3ForCausalLM.forward" in integration.patched("gemma3")
    fusetune.revert("gemma3_text")
    assert integration.patched("gemma3") == []


def test_the_readme_lists_every_family():
    """The README's family table is family_table()'s output (regenerate it when it changes)."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert integration.family_table() in readme
    assert len(FAMILIES) >= 20


def test_every_family_has_a_tiny_model_for_finetune():
    from fusetune.finetune import models

    tiny = {models.resolve(f"tiny-{family}").family for family in FAMILIES}
    assert {forwards.FAMILY_OF_MODEL_TYPE[t].model_type for t in tiny} == set(FAMILIES)


def test_a_multimodal_class_warns_that_its_loss_stays_transformers():
    text = dict(CONFIG, **FAMILY_CONFIG["gemma3"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with pytest.warns(UserWarning, match="not Gemma3ForCausalLM: its loss stays transformers'"):
        fusetune.apply(model)
    names = integration.patched(model)
    assert any(name.endswith("mlp") for name in names)
    assert not any(name.startswith("model.vision_tower") for name in names)
    fusetune.revert(model)


@pytest.mark.parametrize(
    "target,message",
    [
        (42, "got int"),
        (torch.nn.Linear(2, 2), "got Linear"),
        (torch.nn.Linear, "got the class Linear"),
    ],
    ids=["int", "module", "class"],
)
def test_not_a_model(target, message):
    with pytest.raises(TypeError, match=f"model_or_model_type must be .*{message}"):
        fusetune.apply(target)


def test_options_must_be_bools():
    with pytest.raises(TypeError, match="rope must be True or False, got 'yes'"):
        fusetune.apply("llama", rope="yes")


def test_untested_transformers_version_warns_once(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "4.45.2")
    monkeypatch.setattr(integration, "_version_warned", False)
    with pytest.warns(UserWarning, match="tested with transformers 5.17 to 5.23; this is 4.45.2"):
        fusetune.apply("mistral", rope=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusetune.apply("mistral", rope=False)
    fusetune.revert("mistral")


def test_activation_names_match_their_fused_op():
    """Every activation name routed to a fused GLU computes that GLU's activation."""
    from fusetune.integrations.peft import mlp_activation

    for name, glu in forwards.GLU_BY_ACTIVATION.items():
        assert mlp_activation(transformers.activations.ACT2FN[name]) == glu, name
