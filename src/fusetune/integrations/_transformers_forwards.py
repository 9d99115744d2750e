"""The model families :mod:`fusetune.integrations.transformers` patches, and the forwards it
puts in place of transformers' own. Every forward here keeps the signature and the outputs of
the one it replaces, and hands the call back to it where fusetune's op does not apply."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from fusetune.ops.activation import geglu, swiglu
from fusetune.ops.glu_linear import glu_linear
from fusetune.ops.linear_cross_entropy import linear_cross_entropy
from fusetune.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_gated
from fusetune.ops.rope import rope


@dataclass(frozen=True)
class Family:
    """What differs between the supported families (transformers 5.x class and attribute
    names). ``norm_casting`` None: the family normalises with LayerNorm, left to transformers."""

    model_type: str  # the family's name: the model type of its multimodal or only config
    prefix: str  # class-name prefix: LlamaRMSNorm, LlamaMLP, LlamaForCausalLM
    norm_casting: str | None = "llama"  # fusetune.rms_norm's casting of the family's RMSNorm
    norm_offset: float | None = None  # fusetune.rms_norm's offset (None: the casting's default)
    norm_eps: str = "variance_epsilon"  # the RMSNorm's eps attribute
    activation: str = "hidden_act"  # the config attribute the MLP builds its activation from
    mlp_class: str | None = "MLP"  # {prefix}{mlp_class}: the dense gated MLP (None: none)
    fused_gate_up: bool = False  # one gate_up_proj whose output halves are (gate, up) (Phi-3)
    rope_form: str | None = "pair"  # apply_rotary_pos_emb(q, k, ...); "single": (x, ...)
    # (Gemma 4); None: not routed
    interleaved_rope: bool = False  # rotate pairs (2p, 2p + 1) (Cohere) instead of halves
    # how the function reshapes transformers' cos / sin tables before rotating: "duplicate"
    # (gpt-oss: they hold one half, used for both), "interleave" (GLM, Helium: the first
    # half's frequencies, each repeated twice, for pairs)
    rope_table: str | None = None
    logit_softcap: str | None = None  # config attribute: c * tanh(logits / c) (Gemma 2)
    logit_scale: str | None = None  # model attribute: s * logits (Cohere)
    logit_divisor: str | None = None  # config attribute: logits / d (Granite)
    text_model_type: str | None = None  # the model type of its ForCausalLM's config, if other

    @property
    def model_types(self) -> tuple[str, ...]:
        """Config model types that belong to the family (a multimodal one and its text one)."""
        return (self.model_type,) + ((self.text_model_type,) if self.text_model_type else ())

    @property
    def modeling(self) -> ModuleType:
        return importlib.import_module(
            f"transformers.models.{self.model_type}.modeling_{self.model_type}"
        )

    def attribute(self, suffix: str):
        """The modeling module's ``{prefix}{suffix}`` (e.g. LlamaMLP), or None."""
        return getattr(self.modeling, f"{self.prefix}{suffix}", None)

    def part(self, name: str):
        """The class of a patched part: "RMSNorm", "MLP" (the dense MLP) or "ForCausalLM"."""
        if name == "MLP":
            return self.attribute(self.mlp_class) if self.mlp_class else None
        return self.attribute(name)


_GEMMA = dict(norm_casting="gemma", norm_eps="eps", activation="hidden_activation")
# fp32 norm and weight, rounded once, no offset: (w * x_fp32).to(dtype) (OLMo 2, gpt-oss)
_FP32_WEIGHT = dict(norm_casting="gemma", norm_offset=0.0)
# rotate pairs (2p, 2p + 1) with the frequencies of the table's first half (GLM, Helium)
_PAIRS_FROM_HALVES = dict(interleaved_rope=True, rope_table="interleave")

FAMILIES = {
    family.model_type: family
    for family in (
        Family("llama", "Llama"),
        Family("mistral", "Mistral"),
        Family("ministral", "Ministral"),
        Family("ministral3", "Ministral3"),
        Family("qwen2", "Qwen2"),
        Family("qwen3", "Qwen3"),  # its q_norm / k_norm are Qwen3RMSNorm too
        Family("smollm3", "SmolLM3"),
        Family("helium", "Helium", **_FP32_WEIGHT, **_PAIRS_FROM_HALVES),
        Family("exaone4", "Exaone4"),
        Family("hunyuan_v1_dense", "HunYuanDenseV1"),
        Family("olmo2", "Olmo2", **_FP32_WEIGHT),
        Family("olmo3", "Olmo3", **_FP32_WEIGHT),
        Family("phi3", "Phi3", fused_gate_up=True),
        Family("glm", "Glm", fused_gate_up=True, **_PAIRS_FROM_HALVES),
        Family("glm4", "Glm4", fused_gate_up=True, **_PAIRS_FROM_HALVES),
        Family("granite", "Granite", logit_divisor="logits_scaling"),
        Family("gemma", "Gemma", norm_casting="gemma", norm_eps="eps"),
        Family("gemma2", "Gemma2", **_GEMMA, logit_softcap="final_logit_softcapping"),
        Family(
            "gemma3",
            "Gemma3",
            **_GEMMA,
            logit_softcap="final_logit_softcapping",
            text_model_type="gemma3_text",
        ),
        Family(
            "gemma4",
            "Gemma4",
            norm_casting="gemma",
            norm_offset=0.0,
            norm_eps="eps",
            activation="hidden_activation",
            mlp_class="TextMLP",
            rope_form="single",
            logit_softcap="final_logit_softcapping",
            text_model_type="gemma4_text",
        ),
        # Qwen3.5 / Qwen3-Next: full-attention layers, norms (the Gated DeltaNet layers' gated
        # norm too: rms_norm_gated), MLP and loss; the delta rule: integrations.gated_delta.
        Family(
            "qwen3_5",
            "Qwen3_5",
            norm_casting="gemma",
            norm_eps="eps",
            text_model_type="qwen3_5_text",
        ),  # fmt: skip
        Family("qwen3_next", "Qwen3Next", norm_casting="gemma", norm_eps="eps"),
        # Mixtures of experts: the dense parts (experts stay transformers' own).
        Family("qwen2_moe", "Qwen2Moe"),
        Family("qwen3_moe", "Qwen3Moe"),
        Family(
            "qwen3_5_moe",
            "Qwen3_5Moe",
            norm_casting="gemma",
            norm_eps="eps",
            text_model_type="qwen3_5_moe_text",
        ),  # fmt: skip
        Family("mixtral", "Mixtral"),
        Family("granitemoe", "GraniteMoe", logit_divisor="logits_scaling"),
        # GptOssMLP is its router + experts block, not a dense MLP
        Family("gpt_oss", "GptOss", **_FP32_WEIGHT, mlp_class=None, rope_table="duplicate"),
        # Cohere normalises with LayerNorm (mean subtracted): not an RMSNorm, left as it is.
        Family(
            "cohere", "Cohere", norm_casting=None, interleaved_rope=True, logit_scale="logit_scale"
        ),
        Family(
            "cohere2",
            "Cohere2",
            norm_casting=None,
            interleaved_rope=True,
            logit_scale="logit_scale",
        ),  # fmt: skip
    )
}
# every config model type -> its family
FAMILY_OF_MODEL_TYPE = {
    model_type: family for family in FAMILIES.values() for model_type in family.model_types
}
# Families transformers has whose parts do not map onto fusetune's ops: why, for the error.
NOT_SUPPORTED = {
    "gemma3n": "its AltUp / LAuReL layers and sparse-activation MLP have no fused op",
    "seed_oss": "its MLP adds residual dropout after the down projection",
    "apertus": "its MLP is not gated (xIELU of up_proj)",
    "arcee": "its MLP is not gated (ReLU^2 of up_proj)",
    "phi": "it normalises with LayerNorm and its MLP is not gated",
    "olmo": "it normalises with a weightless LayerNorm",
    "starcoder2": "it normalises with LayerNorm and its MLP is not gated",
    "gpt2": "it normalises with LayerNorm, has learned positions and no gated MLP",
}

# ----------------------------------------------------------------------------- RMSNorm


def rms_norm_forward(family: Family, original: Callable) -> Callable:
    """An RMSNorm module's forward through fusetune.rms_norm with the family's casting:
    "llama" rounds the normalised value to the input dtype before the weight (LlamaRMSNorm),
    "gemma" stays in fp32 with (offset + weight) and rounds once (Gemma's 1 + w, OLMo 2's w).
    A norm without a weight (Gemma 4's ``with_scale=False``) keeps ``original``."""
    casting, offset, eps_name = family.norm_casting, family.norm_offset, family.norm_eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "weight", None)
        if weight is None:
            return original(self, hidden_states)
        eps = getattr(self, eps_name)
        return rms_norm(hidden_states, weight, eps, offset=offset, casting=casting)

    return forward


def gated_norm_class(family: Family) -> type | None:
    """The family's gated RMSNorm (Gated DeltaNet's output norm) when its forward is, line for
    line, Qwen3.5's: norm in fp32, rounded to the input dtype, times the weight, times
    silu(gate) in fp32, one rounding. (Mamba's gated norm gates before normalising: another
    op.)"""
    found = family.part("RMSNormGated")
    if found is None:
        return None
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    try:
        same = _source_lines(found.forward) == _source_lines(Qwen3_5RMSNormGated.forward)
    except (OSError, TypeError):  # no source
        return None
    return found if same else None


def rms_norm_gated_forward(family: Family, original: Callable) -> Callable:
    """A gated RMSNorm module's forward through fusetune.rms_norm_gated (casting "llama",
    offset 0: transformers' order, its plain weight); a call without a gate keeps
    ``original``."""
    del family  # one form (gated_norm_class checks it), whatever the family

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
        if gate is None:
            return original(self, hidden_states, gate)
        return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon,
                              offset=0.0, casting="llama")  # fmt: skip

    return forward


# ----------------------------------------------------------------------------- decoder layer


@functools.cache
def _source_lines(function: Callable) -> tuple[str, ...]:
    """A function's code lines, stripped, without blank lines and comments."""
    lines = (line.strip() for line in inspect.getsource(function).splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def llama_like_layer(layer_class: type | None) -> bool:
    """The decoder layer's forward is, line for line, LlamaDecoderLayer's of the same
    transformers (pre-norm: norm, attention, residual add, norm, MLP, residual add); checked
    from the source, so a family whose layer changes in a release is simply not fused."""
    if layer_class is None:
        return False
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    try:
        return _source_lines(layer_class.forward) == _source_lines(LlamaDecoderLayer.forward)
    except (OSError, TypeError):  # no source (a frozen or compiled build)
        return False


def decoder_layer_forward(family: Family, original: Callable) -> Callable:
    """A Llama-like decoder layer's forward with the attention's residual add fused into the
    post-attention RMSNorm (:func:`fusetune.add_rms_norm`: one pass writes the sum and its
    norm; the backward adds the two gradients in the same pass). The call's keywords go to
    the attention as the original passes them; positional extras go to ``original``."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        norm = self.post_attention_layernorm
        # transformers 5.2x checkpoints inside the class's forward (a wrapper this instance
        # forward would bypass): with gradient checkpointing on, the original runs (unfused)
        checkpointing = self.training and getattr(self, "gradient_checkpointing", False)
        if args or checkpointing or getattr(norm, "weight", None) is None:
            return original(self, hidden_states, *args, **kwargs)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        eps = getattr(norm, family.norm_eps)
        hidden_states, residual = add_rms_norm(
            hidden_states, residual, norm.weight, eps,
            offset=family.norm_offset, casting=family.norm_casting,
        )  # fmt: skip
        return residual + self.mlp(hidden_states)

    return forward


# ----------------------------------------------------------------------------- MLP

# transformers' activation names (ACT2FN keys) whose gated MLP is a fused op.
GLU_BY_ACTIVATION = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_python": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_python_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "gelu_fast": "geglu_tanh",
}
GLU_OPS = {
    "swiglu": swiglu,
    "geglu": geglu,
    "geglu_tanh": functools.partial(geglu, approximate="tanh"),
}


def glu_of(family: Family, mlp: torch.nn.Module) -> str | None:
    """The fused GLU for ``mlp`` from its config's activation name ("swiglu", "geglu",
    "geglu_tanh"), or None. A string lookup, so torch.compile traces it as a constant."""
    config = getattr(mlp, "config", None)
    return GLU_BY_ACTIVATION.get(getattr(config, family.activation, None))


def activation_module(family: Family, mlp: torch.nn.Module) -> torch.nn.Module | None:
    """The MLP's activation module (``act_fn``; ``activation_fn`` with a fused gate_up)."""
    return getattr(mlp, "activation_fn" if family.fused_gate_up else "act_fn", None)


# the fused GLU -> fusetune.glu_linear's activation name
GLU_LINEAR_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


def mlp_forward(family: Family, original: Callable) -> Callable:
    """A gated MLP's forward, ``down(act(gate(x)) * up(x))``, with the activation and the
    product fused (swiglu / geglu); an activation without a fused op goes to ``original``.
    With a fused ``gate_up_proj`` (Phi-3, GLM) the gate and up are its output's two halves.
    Where the down projection's weight trains (:func:`trained_down_projection`), the product
    and the down projection are one :func:`fusetune.glu_linear`, which does not keep the
    product for the weight gradient (torch's linear would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        glu = glu_of(family, self)
        if glu is None:
            return original(self, x)
        if family.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        down = trained_down_projection(self)
        if down is not None:
            activation = GLU_LINEAR_ACTIVATIONS[glu]
            return glu_linear(gate, up, down.weight, down.bias, activation=activation)
        return self.down_proj(GLU_OPS[glu](gate, up))

    return forward


def has_own_forward(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs something other than its class's forward when called: a forward
    set on the instance (a wrapper) or accelerate's offload hook (``_hf_hook``)."""
    return "forward" in module.__dict__ or hasattr(module, "_hf_hook")


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)
_MLP_WARNED: set[str] = set()  # the reasons warned about (once per process each)


def trained_down_projection(mlp: torch.nn.Module) -> torch.nn.Linear | None:
    """``mlp.down_proj`` when :func:`fusetune.glu_linear` may read its parameters outside its
    call: a plain nn.Linear whose weight requires grad, with grad mode on, no hooks and no
    forward of its own. None (the module is called as before) where the weight does not train
    (LoRA, inference: torch's linear keeps nothing then) or the module is another class (a
    PEFT or quantised layer, FSDP2's ``fully_shard`` of the projection alone); also None, with
    one warning per reason, for a trained nn.Linear that hooks or an engine must see called
    (user hooks, DeepSpeed ZeRO-3's gathering, accelerate). A layer sharded by FSDP2 as a
    whole (per decoder layer) has its projections' unsharded parameters in place from its
    forward to its backward: that is the usual full fine-tuning case, served."""
    down = getattr(mlp, "down_proj", None)
    weight = getattr(down, "weight", None)
    if not (isinstance(weight, torch.Tensor) and weight.requires_grad and torch.is_grad_enabled()):
        return None
    if type(down) is not torch.nn.Linear:
        return None
    reason = None
    if hasattr(weight, "ds_id"):
        reason = "its weight is partitioned by DeepSpeed ZeRO-3 (gathered by the module's hooks)"
    elif any(getattr(down, name) for name in _HOOKS):
        reason = "it has forward or backward hooks"
    elif any(getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOKS):
        reason = "global module hooks are registered (torch.nn.modules.module)"
    elif has_own_forward(down):
        reason = "it has a forward of its own (an accelerate hook or a wrapper)"
    elif type(weight) not in (torch.Tensor, torch.nn.Parameter):
        reason = f"its weight is a {type(weight).__name__}, not a plain tensor"
    if reason is None:
        return down
    if not torch.compiler.is_compiling() and reason not in _MLP_WARNED:
        _MLP_WARNED.add(reason)
        warnings.warn(
            f"fusetune: {type(mlp).__name__}.down_proj runs as its own module, keeping "
            f"act(gate) * up for its weight gradient (fusetune.glu_linear would recompute it "
            f"instead): {reason}",
            stacklevel=3,
        )
    return None


# ----------------------------------------------------------------------------- RoPE


def rope_function(family: Family, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through fusetune.rope.
    unsqueeze_dim 1 means q, k are [B, H, T, D] (what the attention passes), 2 [B, T, H, D];
    cos, sin [B, T, R] with R <= D (partial rotary leaves the rest of each head as it is).
    Gemma 4's form rotates one tensor, ``(x, cos, sin, unsqueeze_dim=1)``; the family's
    ``rope_table`` says how its function reads cos / sin (:func:`_rope_table`). Anything else
    (another signature's extra arguments, cos requiring grad) goes to ``original``."""
    single = family.rope_form == "single"
    tensors = 3 if single else 4
    extra_names = list(inspect.signature(original).parameters)[tensors:]
    interleaved, table = family.interleaved_rope, family.rope_table

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args, **kwargs):
        if single:
            (q, cos, sin, *rest), k = args, None
        else:
            q, k, cos, sin, *rest = args
        options = dict(zip(extra_names, rest, strict=False))
        options.update(kwargs)
        unsqueeze_dim = options.pop("unsqueeze_dim", 1)
        unusual = (
            len(rest) > len(extra_names)
            or any(value is not None for value in options.values())
            or unsqueeze_dim not in (1, 2)
            or q.dim() != 4
            or (not single and k.dim() != 4)
            or cos.dim() != 3
            or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        )
        if unusual:
            return original(*args, **kwargs)
        layout = "BHTD" if unsqueeze_dim == 1 else "BTHD"
        if single:  # a key with no heads: one launch rotates x alone
            head_dim = 1 if layout == "BHTD" else 2
            k = q.narrow(head_dim, 0, 0)
        if table is not None:
            cos, sin = _rope_table(cos, table), _rope_table(sin, table)
        q_out, k_out = rope(q, k, cos, sin, layout=layout, interleaved=interleaved)
        return q_out if single else (q_out, k_out)

    return apply_rotary_pos_emb


def _rope_table(table: torch.Tensor, form: str) -> torch.Tensor:
    """The [.., R] table fusetune.rope reads from a family's own: "duplicate" [a] -> [a, a]
    (gpt-oss rotates halves with a half-size table), "interleave" [a, a] -> [a0, a0, a1, a1..]
    (GLM's ``cos[..., :R // 2].repeat_interleave(2)``, for pairs)."""
    if form == "duplicate":
        return torch.cat((table, table), dim=-1)
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1)


# ----------------------------------------------------------------------------- causal LM


def _keep_last(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """transformers 5.17's inline slicing (5.2x has slice_logits_to_keep)."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


def _keep_positions_function() -> Callable:
    """Looked up when patching: an import that fails inside a traced forward is a graph
    break (Dynamo raises on the ImportError)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return _keep_last
    return slice_logits_to_keep


def head_route(model: torch.nn.Module) -> tuple[torch.nn.Linear | None, bool, str | None]:
    """(lm_head, inside, reason) for the fused loss. ``inside``: the loss must run inside the
    head module's own call, so that the hooks a sharding engine put on it fire (FSDP2's
    ``fully_shard`` of the head, which swaps its class; DeepSpeed ZeRO-3's parameter hooks):
    they gather the weight before, free it after, and route its gradient to the engine's
    reduction. ``reason`` says why the fused loss cannot apply (head None): a head with a
    forward of its own (PEFT LoRA or modules_to_save), an accelerate offload hook, no Linear."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return None, False, f"lm_head is {type(head).__name__}, not an nn.Linear"
    if has_own_forward(head):
        return None, False, "lm_head has a forward of its own (an accelerate hook or a wrapper)"
    if type(head) is not torch.nn.Linear and type(head).forward is not torch.nn.Linear.forward:
        return None, False, f"lm_head is a {type(head).__name__} with its own forward"
    if _sharded(head):
        return head, True, None
    if head._forward_hooks or head._forward_pre_hooks:
        return None, False, "lm_head has forward hooks that are not FSDP2's or ZeRO-3's"
    if type(head) is not torch.nn.Linear:
        return None, False, f"lm_head is a {type(head).__name__}, not a plain nn.Linear"
    return head, False, None


def _sharded(module: torch.nn.Module) -> bool:
    """FSDP2's ``fully_shard`` applied to the module itself, or a DeepSpeed ZeRO-3 parameter."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()  # noqa: N806
    return isinstance(module, FSDPModule) or hasattr(module.weight, "ds_id")


def _warn_fallback(model: torch.nn.Module, reason: str) -> None:
    """One warning per model and reason: the fused loss is not used."""
    warned = model.__dict__.setdefault("_fusetune_fallback_warned", set())
    if reason not in warned:
        warned.add(reason)
        warnings.warn(
            f"fusetune: {type(model).__name__} computes its loss through transformers' logits "
            f"path, not fusetune's fused linear cross-entropy: {reason}",
            stacklevel=3,
        )


def run_inside(module: torch.nn.Module, function: Callable, *args):
    """``function(*args)`` as ``module``'s forward for one call: the module's hooks (an
    engine's weight gathering, its gradient hooks) run around it as around its own forward.
    ``function`` reads the module's parameters while they are gathered. A forward set on the
    instance (TRL's cast_lm_head_to_fp32) is put back afterwards."""
    own = module.__dict__.get("forward")
    module.forward = function
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def causal_lm_forward(family: Family, original: Callable) -> Callable:
    """XForCausalLM.forward: with labels in training (or ``skip_logits=True``) the loss comes
    from fusetune.linear_cross_entropy on the final hidden states (the [B, T, V] logits never
    exist; ``logits`` is None); otherwise ``original`` runs unchanged (generation, evaluation
    with logits). The signature seen by inspect (Trainer, generate) is ``original``'s."""
    names = [
        name
        for name, parameter in list(inspect.signature(original).parameters.items())[1:]
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    ]

    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    # mixtures of experts: the router's load-balancing loss is added as transformers adds it
    routed = "output_router_logits" in names
    output_class = MoeCausalLMOutputWithPast if routed else CausalLMOutputWithPast

    keep_positions = _keep_positions_function()

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if len(args) > len(names):
            return original(self, *args, **kwargs)
        kwargs.update(zip(names, args, strict=False))
        skip_logits = kwargs.pop("skip_logits", None)
        wanted = self.training if skip_logits is None else skip_logits
        if kwargs.get("labels") is None or not wanted:
            return original(self, **kwargs)
        head, inside, reason = head_route(self)
        if head is None:
            _warn_fallback(self, reason)
            return original(self, **kwargs)
        return _fused_loss_forward(
            family, self, head, inside, keep_positions, output_class, **kwargs
        )

    return forward


def logit_scale_of(family: Family, model: torch.nn.Module) -> float | None:
    """The factor on the logits: Cohere's ``logit_scale``, Granite's 1 / ``logits_scaling``."""
    if family.logit_scale:
        return getattr(model, family.logit_scale)
    if family.logit_divisor:
        return 1.0 / getattr(model.config, family.logit_divisor)
    return None


def _fused_loss_forward(
    family: Family,
    model,
    head: torch.nn.Linear,
    inside: bool,
    keep_positions: Callable,
    output_class: type,
    labels: torch.Tensor,
    logits_to_keep=0,
    return_dict: bool | None = None,
    **kwargs,
):
    """The causal-LM forward of transformers 5.x with ForCausalLMLoss replaced by the fused
    loss. Like transformers, every other keyword goes to the base model and to the loss
    (num_items_in_batch: sum / num_items for gradient accumulation; shift_labels: labels
    already shifted; ignore_index). A mixture of experts' ``output_router_logits`` (the
    keyword, else its config) adds the router's load-balancing loss times
    ``router_aux_loss_coef``, with transformers' own function."""
    moe = "aux_loss" in output_class.__dataclass_fields__  # MoeCausalLMOutputWithPast
    if moe and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = getattr(model.config, "output_router_logits", False)
    outputs = getattr(model, model.base_model_prefix)(**kwargs)
    hidden = keep_positions(outputs.last_hidden_state, logits_to_keep)
    shift_labels = kwargs.get("shift_labels")
    targets = labels if shift_labels is None else shift_labels

    def loss_of(hidden: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            head.weight,
            targets.to(hidden.device),
            head.bias,
            shift=shift_labels is None,
            ignore_index=kwargs.get("ignore_index", -100),
            logit_softcap=getattr(model.config, family.logit_softcap)
            if family.logit_softcap
            else None,
            logit_scale=logit_scale_of(family, model),
            num_items=kwargs.get("num_items_in_batch"),
        )

    loss = run_inside(head, loss_of, hidden) if inside else loss_of(hidden)
    extra = {}
    if moe:
        aux = _router_aux_loss(family, model, outputs, kwargs)
        if isinstance(aux, torch.Tensor):  # 0 without router logits (GraniteMoe 5.17)
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        extra = dict(router_logits=outputs.router_logits, aux_loss=aux)
    output = output_class(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **extra,
    )
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return output if return_dict else output.to_tuple()


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured (a CPU-only torch has no CUDA to ask)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _router_aux_loss(family: Family, model, outputs, kwargs: dict):
    """transformers' load-balancing loss of the router logits, or None when they were not
    asked for (as the MoE causal-LM forwards compute it)."""
    if not kwargs["output_router_logits"]:
        return None
    mask = kwargs.get("attention_mask")
    if mask is None and _capturing(outputs.last_hidden_state):
        # without a mask transformers counts with bincount, which syncs (refused in a CUDA graph
        # capture: fusetune.graph_train_step); its masked branch with an all-ones mask counts
        # the same assignments with scatter_add, on the device
        hidden = outputs.last_hidden_state  # [B, T, H]: a [B, T] mask, as a batch's own
        mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    return family.modeling.load_balancing_loss_func(
        outputs.router_logits, model.num_experts, model.num_experts_per_tok, mask
    )
