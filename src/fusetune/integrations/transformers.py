"""One line to put a transformers causal LM on fusetune's kernels.

    model = AutoModelForCausalLM.from_pretrained(...)   # or get_peft_model(...)
    fusetune.apply(model)                                # this instance, in place
    fusetune.apply("llama")                              # or the family's classes, before loading
    ...train (HF Trainer, TRL, a loop)...
    fusetune.revert(model)                               # transformers' own code back, exactly

What is routed, per family (``SUPPORTED_FAMILIES``; transformers 5.x):

- ``rms_norm``: every RMSNorm module (decoder norms, the final norm, q/k norms) ->
  :func:`fusetune.rms_norm`, with the family's casting ("llama": round, then weight; "gemma":
  fp32 with 1 + w, or w (OLMo 2, gpt-oss, Gemma 4), rounded once). In a decoder layer that is
  line for line Llama's, the attention's residual add fuses into the post-attention norm
  (:func:`fusetune.add_rms_norm`). Cohere normalises with LayerNorm: left to transformers. The
  Gated DeltaNet layers' gated norm (Qwen3.5, Qwen3-Next) -> :func:`fusetune.rms_norm_gated`.
- ``rope``: the family's ``apply_rotary_pos_emb`` -> :func:`fusetune.rope` (interleaved pairs
  for Cohere). It is a module-level function in transformers, so patching an instance replaces
  it for the whole family while any patched model (or a class-level patch) of that family is
  alive; the fused function computes the same rotation (in fp32, rounded once).
- ``mlp``: the gated MLP -> :func:`fusetune.swiglu` / :func:`fusetune.geglu` (Gemma 2's
  gelu_pytorch_tanh is geglu "tanh"); other activations keep transformers' forward. Where
  down_proj is a plain nn.Linear whose weight trains (full fine-tuning), the product and the
  down projection are one :func:`fusetune.glu_linear` (the product is not kept for the
  backward); a trained down_proj with hooks (ZeRO-3's included) is called as a module, with
  one warning.
- ``linear_cross_entropy``: ``XForCausalLM.forward`` with labels in training computes the loss
  with :func:`fusetune.linear_cross_entropy` from the final hidden states, with the model's own
  settings (Gemma final_logit_softcapping, Cohere logit_scale, Granite logits_scaling, a
  mixture of experts' router load-balancing loss, HF's num_items_in_batch for gradient
  accumulation, shift_labels, ignore_index); ``logits`` is then None. Without labels,
  or in eval mode, transformers' forward runs unchanged (logits, logits_to_keep, generation);
  ``skip_logits=True/False`` overrides the choice per call.
- ``lora``: a PEFT LoRA model's q/k/v, MLP and other LoRA linears ->
  :func:`fusetune.integrations.peft.apply` (fused LoRA ops).
- ``gated_delta`` / ``experts`` (live models): Qwen3.5 / Qwen3-Next Gated DeltaNet layers ->
  :func:`fusetune.gated_delta_rule`; experts of Qwen3-MoE, Qwen3.5-MoE, Mixtral, gpt-oss ->
  :func:`fusetune.moe_mlp`.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusetune.integrations import gated_delta as gated_delta_integration
from fusetune.integrations import moe as moe_integration
from fusetune.integrations import peft as peft_integration
from fusetune.integrations import trl as trl_integration
from fusetune.integrations._transformers_forwards import (
    FAMILIES,
    FAMILY_OF_MODEL_TYPE,
    NOT_SUPPORTED,
    Family,
    activation_module,
    causal_lm_forward,
    decoder_layer_forward,
    gated_norm_class,
    glu_of,
    llama_like_layer,
    mlp_forward,
    rms_norm_forward,
    rms_norm_gated_forward,
    rope_function,
)

__all__ = [
    "SUPPORTED_FAMILIES",
    "TESTED_TRANSFORMERS",
    "apply",
    "compile_layers",
    "family_table",
    "patched",
    "revert",
]

SUPPORTED_FAMILIES: tuple[str, ...] = tuple(FAMILIES)
# transformers releases the patches are tested against (CI: the newest, GPU pass: the oldest).
TESTED_TRANSFORMERS = ("5.17", "5.23")

_MARK = "_fusetune_hf_patch"  # on each patched submodule: what revert restores
_STATE = "_fusetune_hf_state"  # on the patched model
_ABSENT = object()
_version_warned = False


@dataclass
class _Patch:
    original: Callable | None  # the instance-level forward before patching, if there was one
    had_instance_forward: bool
    installed: Callable  # the bound forward apply set (revert leaves a wrapper around it)


@dataclass
class _State:
    family: str
    rope: bool = False  # holds the family's rope function (until revert or collection)
    peft: bool = False  # we applied fusetune.integrations.peft (revert undoes it)
    routed: dict[str, int] = field(default_factory=dict)  # "gated_delta" / "experts": layers


@dataclass
class _RopeSlot:
    """Who holds a family's module-level apply_rotary_pos_emb patched: the class-level patch
    and/or live patched instances (by id; each one's finalizer lets go when it is collected
    without revert). Restored when the last one lets go."""

    original: Callable | None = None
    class_level: bool = False
    holders: dict[int, weakref.finalize] = field(default_factory=dict)


# family -> {(owner, attribute): value before patching, or _ABSENT}
_CLASS_PATCHES: dict[str, dict[tuple[object, str], object]] = {}
_ROPE: dict[str, _RopeSlot] = {}


# ----------------------------------------------------------------------------- checks


def _check_transformers_version() -> None:
    """One warning per process when transformers is outside the tested releases."""
    global _version_warned
    import transformers

    version = transformers.__version__
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    low, high = (tuple(int(p) for p in v.split(".")) for v in TESTED_TRANSFORMERS)
    if not low <= major_minor <= high and not _version_warned:
        _version_warned = True
        warnings.warn(
            f"fusetune.integrations.transformers is tested with transformers "
            f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}; this is {version}. The "
            "patches fall back to transformers' own code where a forward does not look as "
            "expected, but check the loss against an unpatched run.",
            UserWarning,
            stacklevel=3,
        )


def _family(model_type: object, owner: str | None = None) -> Family:
    family = FAMILY_OF_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        what = repr(model_type) if owner is None else f"{owner} (model type {model_type!r})"
        reason = NOT_SUPPORTED.get(model_type) if isinstance(model_type, str) else None
        why = f" ({reason})" if reason else ""
        raise ValueError(
            f"model_or_model_type: {what} is not a model family fusetune patches{why}; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def _check_options(options: dict[str, object]) -> None:
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _pretrained_class():
    from transformers import PreTrainedModel

    return PreTrainedModel


def _resolve(target: object) -> tuple[Family, type | None, torch.nn.Module | None]:
    """(family, class, None) for a model type or class; (family, None, model) for a live
    model, where model is the transformers model inside a PEFT or compile wrapper."""
    pretrained = _pretrained_class()
    if isinstance(target, str):
        return _family(target), None, None
    if isinstance(target, type):
        if not issubclass(target, pretrained):
            raise TypeError(
                "model_or_model_type must be a model type string, a transformers "
                f"PreTrainedModel class or a model instance, got the class {target.__name__}"
            )
        model_type = getattr(target.config_class, "model_type", None)
        return _family(model_type, target.__name__), target, None
    if isinstance(target, torch.nn.Module):
        inner = next((m for m in target.modules() if isinstance(m, pretrained)), None)
        if inner is not None:
            model_type = getattr(inner.config, "model_type", None)
            return _family(model_type, type(inner).__name__), None, inner
    raise TypeError(
        "model_or_model_type must be a model type string (e.g. 'llama'), a transformers "
        "PreTrainedModel class or a model instance (PEFT-wrapped too), got "
        f"{type(target).__name__}"
    )


# ----------------------------------------------------------------------------- rope slot


def _hold_rope(family: Family, holder: torch.nn.Module | None) -> None:
    slot = _ROPE.setdefault(family.model_type, _RopeSlot())
    modeling = family.modeling
    if slot.original is None:
        slot.original = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = rope_function(family, slot.original)
    if holder is None:
        slot.class_level = True
    elif id(holder) not in slot.holders:
        # a model collected without revert lets go too (kept here, not on the model, so that
        # deepcopy of a patched model copies no finalizer)
        finalizer = weakref.finalize(holder, _let_go, family, id(holder))
        slot.holders[id(holder)] = finalizer


def _release_rope(family: Family, holder: torch.nn.Module | None) -> None:
    slot = _ROPE.get(family.model_type)
    if slot is None:
        return
    if holder is None:
        slot.class_level = False
    else:
        finalizer = slot.holders.get(id(holder))
        if finalizer is not None:
            finalizer.detach()
    _let_go(family, None if holder is None else id(holder))


def _let_go(family: Family, holder_id: int | None) -> None:
    slot = _ROPE.get(family.model_type)
    if slot is None:
        return
    slot.holders.pop(holder_id, None)
    if slot.original is not None and not slot.class_level and not slot.holders:
        family.modeling.apply_rotary_pos_emb = slot.original
        slot.original = None


# ----------------------------------------------------------------------------- class level


def _set_class_attribute(family: Family, owner: type, name: str, value: object) -> None:
    saved = _CLASS_PATCHES.setdefault(family.model_type, {})
    if (owner, name) in saved:
        return  # already patched: applying twice is harmless
    saved[(owner, name)] = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)


def _fused_residual_layer(family: Family, options: dict[str, bool]) -> type | None:
    """The family's decoder-layer class when its residual add fuses into the norm after it."""
    layer = family.attribute("DecoderLayer")
    fusable = options["rms_norm"] and family.norm_casting and llama_like_layer(layer)
    return layer if fusable else None


def _apply_to_classes(family: Family, options: dict[str, bool]) -> None:
    norm, mlp, lm = (family.part(s) for s in ("RMSNorm", "MLP", "ForCausalLM"))
    if options["rms_norm"] and family.norm_casting and norm is not None:
        _set_class_attribute(family, norm, "forward", rms_norm_forward(family, norm.forward))
    gated = gated_norm_class(family) if options["rms_norm"] else None
    if gated is not None:
        forward = rms_norm_gated_forward(family, gated.forward)
        _set_class_attribute(family, gated, "forward", forward)
    layer = _fused_residual_layer(family, options)
    if layer is not None:
        _set_class_attribute(family, layer, "forward", decoder_layer_forward(family, layer.forward))
    if options["mlp"] and mlp is not None:
        _set_class_attribute(family, mlp, "forward", mlp_forward(family, mlp.forward))
    if options["linear_cross_entropy"] and lm is not None:
        _set_class_attribute(family, lm, "forward", causal_lm_forward(family, lm.forward))
    if options["rope"] and family.rope_form:
        _hold_rope(family, None)


def _revert_classes(family: Family) -> None:
    for (owner, name), before in _CLASS_PATCHES.pop(family.model_type, {}).items():
        if before is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
    _release_rope(family, None)


# ----------------------------------------------------------------------------- instance level


def _install(module: torch.nn.Module, make_forward: Callable[[Callable], Callable]) -> None:
    """Give ``module`` the instance forward ``make_forward(original)``, guarded: once
    reverted it hands every call to the original, so a wrapper set around it after apply
    (accelerate wraps the model's forward for Trainer's bf16 / fp16) still does the right
    thing after revert."""
    if hasattr(module, _MARK):
        return  # applying twice is harmless
    original = _instance_forward(module)
    patched_forward = make_forward(original)

    @functools.wraps(patched_forward)
    def guarded(self, *args, **kwargs):
        if getattr(self, _MARK, None) is None:
            return original(self, *args, **kwargs)
        return patched_forward(self, *args, **kwargs)

    had_instance_forward = "forward" in module.__dict__
    before = module.__dict__.get("forward")
    module.forward = types.MethodType(guarded, module)
    setattr(module, _MARK, _Patch(before, had_instance_forward, module.forward))


def _instance_forward(module: torch.nn.Module) -> Callable:
    """The unbound forward ``module`` runs now (its instance forward, else its class's)."""
    bound = module.__dict__.get("forward")
    if bound is None:
        return type(module).forward

    def forward(self, *args, **kwargs):
        return bound(*args, **kwargs)

    # inspect (Trainer's column filter, generate's kwarg check) must still see the parameters
    signature = inspect.signature(bound)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(
        parameters=[self_parameter, *signature.parameters.values()]
    )
    return forward


def _apply_to_instance(family: Family, model: torch.nn.Module, options: dict[str, bool]) -> None:
    norm, mlp, lm = (family.part(s) for s in ("RMSNorm", "MLP", "ForCausalLM"))
    state = model.__dict__.get(_STATE) or _State(family.model_type)
    layer = _fused_residual_layer(family, options)
    gated = gated_norm_class(family) if options["rms_norm"] else None
    for module in model.modules():
        if hasattr(module, peft_integration._PATCH):
            continue  # already on fusetune's LoRA path
        if options["rms_norm"] and family.norm_casting and norm and isinstance(module, norm):
            _install(module, functools.partial(rms_norm_forward, family))
        elif gated is not None and isinstance(module, gated):
            _install(module, functools.partial(rms_norm_gated_forward, family))
        elif layer is not None and isinstance(module, layer):
            _install(module, functools.partial(decoder_layer_forward, family))
        elif options["mlp"] and mlp and isinstance(module, mlp) and _glu_matches(family, module):
            _install(module, functools.partial(mlp_forward, family))
    if options["linear_cross_entropy"] and lm is not None and isinstance(model, lm):
        _install(model, functools.partial(causal_lm_forward, family))
    elif options["linear_cross_entropy"]:
        warnings.warn(
            f"fusetune: {type(model).__name__} is not {family.prefix}ForCausalLM: its loss stays "
            "transformers' (the norms, RoPE and MLP are fused)",
            stacklevel=4,
        )
    if options["rope"] and family.rope_form:
        _hold_rope(family, model)  # once per model (a deepcopy of a patched one holds anew)
        state.rope = True
    for part, integration in _ROUTED_PARTS.items():
        if options[part]:
            state.routed[part] = integration.route(model)
    setattr(model, _STATE, state)


# part -> the integration that routes it on a live model (route(model) / unroute(model))
_ROUTED_PARTS = {"gated_delta": gated_delta_integration, "experts": moe_integration}


def _glu_matches(family: Family, mlp: torch.nn.Module) -> bool:
    """The activation named by the config is the one act_fn computes (checked by value, so
    a model whose act_fn was swapped after construction keeps its own forward)."""
    glu = glu_of(family, mlp)
    activation = activation_module(family, mlp)
    return glu is not None and peft_integration.mlp_activation(activation) == glu


def _apply_lora(target: torch.nn.Module, model: torch.nn.Module) -> None:
    if any(peft_integration.is_lora_layer(m) for m in target.modules()):
        peft_integration.apply(target)
        model.__dict__[_STATE].peft = True


def _revert_instance(family: Family, target: torch.nn.Module, model: torch.nn.Module) -> None:
    state = model.__dict__.pop(_STATE, None)
    if state is not None and state.peft:
        peft_integration.unpatch(target)
    for part in state.routed if state is not None else ():
        _ROUTED_PARTS[part].unroute(model)
    for module in target.modules():
        patch = module.__dict__.pop(_MARK, None)
        if patch is None or module.__dict__.get("forward") is not patch.installed:
            continue  # not ours, or wrapped since: the guard now calls the original
        if patch.had_instance_forward:
            module.forward = patch.original
        else:
            module.__dict__.pop("forward", None)
    if state is not None and state.rope:
        _release_rope(family, model)


# ----------------------------------------------------------------------------- public API


def apply(
    model_or_model_type,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    linear_cross_entropy: bool = True,
    lora: bool = True,
    gated_delta: bool = True,
    experts: bool = True,
):
    """Route a transformers causal LM through fusetune's kernels (see the module doc).

    Args:
        model_or_model_type: a TRL trainer (GRPOTrainer, SFTTrainer, ...): its models, and
            TRL's fused LM head served by fusetune's kernels (:mod:`fusetune.integrations.trl`);
            a model type ("llama", ...) or a PreTrainedModel class: patches the
            family's classes, so models built afterwards (from_pretrained) use fusetune, and
            live ones too; or a live model (a PeftModel / LoraModel or a torch.compile wrapper
            is searched for the transformers model inside): patches that instance only (and
            the family's apply_rotary_pos_emb, a module-level function, while it lives).
        rms_norm, rope, mlp, linear_cross_entropy: which parts to route.
        lora: with a live model holding PEFT LoRA layers, also
            :func:`fusetune.integrations.peft.apply` (fused LoRA projections and MLP).
        gated_delta: a live Qwen3.5 / Qwen3-Next model's Gated DeltaNet layers ->
            :func:`fusetune.gated_delta_rule` (:mod:`fusetune.integrations.gated_delta`).
        experts: a live mixture-of-experts model's experts (Qwen3-MoE, Qwen3.5-MoE, Mixtral,
            gpt-oss; PEFT LoRA on them too) -> :func:`fusetune.moe_mlp`
            (:mod:`fusetune.integrations.moe`); the router and its auxiliary loss stay
            transformers'. These two act on live models only (a family or class patch leaves
            them to transformers).

    Applying twice is harmless (a second call only adds parts not yet routed). Compile the
    model after patching (a compiled graph keeps the code it traced).

    Returns:
        ``model_or_model_type``, unchanged in identity.

    Raises:
        ValueError: a model family fusetune does not patch (the message lists the supported
            ones). TypeError: an object that is no model, class or type string; an option that
            is not a bool. Warns once per process when transformers is outside
            ``TESTED_TRANSFORMERS``.
    """
    options = dict(
        rms_norm=rms_norm,
        rope=rope,
        mlp=mlp,
        linear_cross_entropy=linear_cross_entropy,
        lora=lora,
        gated_delta=gated_delta,
        experts=experts,
    )
    _check_options(options)
    if trl_integration.is_trainer(model_or_model_type):
        return trl_integration.apply(model_or_model_type, **options)
    family, _, model = _resolve(model_or_model_type)
    _check_transformers_version()
    if model is None:
        _apply_to_classes(family, options)
        return model_or_model_type
    _apply_to_instance(family, model, options)
    if lora:
        _apply_lora(model_or_model_type, model)
    return model_or_model_type


def compile_layers(model: torch.nn.Module, **compile_options: object) -> int:
    """Compile the decoder stack of ``model`` in place, after :func:`apply`: the module that
    holds the decoder layers (``model.model`` of a causal LM) becomes one graph. The layers'
    Python (PEFT's LoRA dispatch, fusetune's wrappers, the glue between kernels) then runs
    once at trace time instead of every step; fusetune's kernels stay opaque custom ops in
    the graph. The stack is compiled whole, one graph for every layer's Python. Compiling
    layer by layer (``layer.compile()`` on each, as FSDP2 setups do) works too: the layers share
    their graphs, as plain PEFT's do (fusetune's LoRA forwards go through the class, not a
    per-module object; train without a KV cache, ``use_cache=False``, whose per-layer state
    recompiles any layer). The loss head stays eager (its fused loss is one kernel call
    already).

    Args:
        model: a transformers model, or a PEFT / TRL wrapper around one.
        compile_options: passed to ``torch.compile`` (``mode``, ``dynamic``, ...).

    Returns:
        How many decoder layers the compiled stack holds.

    Raises:
        ValueError: ``model`` holds no module with a ``layers`` list of decoder layers.
    """
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and any(
            type(layer).__name__.endswith("DecoderLayer") for layer in layers
        ):
            _build_masks_eagerly(module)
            module.compile(**compile_options)
            return len(layers)
    raise ValueError(f"model: no decoder layers found in {type(model).__name__}")


class _EagerMasks:
    """How many stacks compiled by :func:`compile_layers` are running (their forward hooks
    count): only there do the mask builders run outside the graph."""

    depth = 0


def _build_masks_eagerly(stack: torch.nn.Module) -> None:
    """Run the stack's attention-mask builders (transformers.masking_utils' ``create_*``
    functions, as the stack's modeling module names them) outside the graph while ``stack``
    runs, at the cost of one graph break. Traced, transformers cannot look at values, so it
    keeps every mask: with torch < 2.14 it never drops an all-visible causal mask, and it always
    takes position ids for packed sequences (a [B, 1, T, T] mask instead of SDPA's
    ``is_causal``: on the H100 Llama-3.2-1B's attention went from 11.3 to 28.8 ms a step).
    Eager, the builders decide as they do without compile. The module's names are replaced by
    switches that call the original unless a compiled stack is running, so other models of
    the family (a whole model under ``torch.compile(fullgraph=True)``) trace them as before."""
    namespace = sys.modules[type(stack).__module__].__dict__
    for name, value in list(namespace.items()):
        if (
            name.startswith("create_")
            and callable(value)
            and getattr(value, "__module__", "") == "transformers.masking_utils"
            and not hasattr(value, "_fusetune_eager")
        ):
            namespace[name] = _mask_switch(value)
    if not getattr(stack, "_fusetune_eager_masks", False):
        stack._fusetune_eager_masks = True
        stack.register_forward_pre_hook(_enter_compiled_stack)
        stack.register_forward_hook(_leave_compiled_stack, always_call=True)


def _mask_switch(builder: Callable) -> Callable:
    eager = torch.compiler.disable(builder)

    @functools.wraps(builder)
    def switch(*args, **kwargs):
        return (eager if _EagerMasks.depth else builder)(*args, **kwargs)

    switch._fusetune_eager = True
    return switch


def _enter_compiled_stack(module, args) -> None:
    _EagerMasks.depth += 1


def _leave_compiled_stack(module, args, output) -> None:
    _EagerMasks.depth -= 1


def revert(model_or_model_type):
    """Undo :func:`apply`: for a model type or class, the family's classes and module
    function; for a model, every forward apply set on it (its own instance forwards come
    back as they were) and the LoRA routing apply added; for a TRL trainer, its models and
    TRL's LM head. Returns the argument."""
    if trl_integration.is_trainer(model_or_model_type):
        return trl_integration.revert(model_or_model_type)
    family, _, model = _resolve(model_or_model_type)
    if model is None:
        _revert_classes(family)
    else:
        _revert_instance(family, model_or_model_type, model)
    return model_or_model_type


def patched(model_or_model_type) -> list[str]:
    """What is routed now: for a model, the names of its modules with a fusetune forward
    (LoRA routing included, "" for the model itself) plus "apply_rotary_pos_emb" when the
    family's function is fused; for a family, the patched class attributes."""
    family, _, model = _resolve(model_or_model_type)
    slot = _ROPE.get(family.model_type)
    rope_on = ["apply_rotary_pos_emb"] if slot is not None and slot.original is not None else []
    if model is None:
        saved = _CLASS_PATCHES.get(family.model_type, {})
        return sorted(f"{owner.__name__}.{name}" for owner, name in saved) + rope_on
    root = model_or_model_type
    names = [
        name
        for name, module in root.named_modules()
        if hasattr(module, _MARK) or hasattr(module, peft_integration._PATCH)
    ]
    return names + rope_on


def family_table() -> str:
    """The README's table of supported families (markdown), generated from the family table:
    per family its config model types and what is routed."""
    header = "| family | model types | RMSNorm | RoPE | gated MLP | loss |"
    rows = [header, "|---|---|---|---|---|---|"]
    for family in FAMILIES.values():
        rows.append("| " + " | ".join(_family_row(family)) + " |")
    return "\n".join(rows)


def _family_row(family: Family) -> list[str]:
    norm = {None: "LayerNorm: transformers'", "llama": "llama casting", "gemma": "fp32"}[
        family.norm_casting
    ]
    if family.norm_casting == "gemma":
        norm += ", w" if family.norm_offset == 0.0 else ", 1 + w"
    rope = "pairs" if family.interleaved_rope else "halves"
    if family.rope_form == "single":
        rope += ", one tensor per call"
    mlp = "gate_up_proj" if family.fused_gate_up else "gate_proj, up_proj"
    if family.part("MLP") is None:
        mlp = "none (its experts: below)"
    loss = [
        option
        for option, name in (
            ("softcap", family.logit_softcap),
            ("logit scale", family.logit_scale),
            ("logits / scaling", family.logit_divisor),
        )
        if name
    ]
    types = ", ".join(f"`{t}`" for t in family.model_types)
    return [family.model_type, types, norm, rope, mlp, ", ".join(["fused CE", *loss])]
