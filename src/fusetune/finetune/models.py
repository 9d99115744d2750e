"""Models for the fine-tuning command: built-in tiny configs (random weights, byte tokenizer, no
download), local folders and hub ids; the family check before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.finetune.errors import FinetuneError
from fusetune.finetune.tokenizers import ByteTokenizer, HFTokenizer

# Small enough that the command runs in about a minute on a 2-core CPU, big enough to learn.
_TINY_SHAPE = dict(
    vocab_size=320,  # the byte tokenizer's 259 ids, rounded up to a multiple of 64
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    initializer_range=0.1,  # wide enough for LoRA alone to move the random lm_head's logits
    pad_token_id=ByteTokenizer.pad_id,
    bos_token_id=ByteTokenizer.bos_id,
    eos_token_id=ByteTokenizer.eos_id,
)
_SLIDING = {"sliding_window": 64}
_LINEAR_ATTENTION = {  # Qwen3.5 / Qwen3-Next: a Gated DeltaNet layer, then an attention layer
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
_LOCAL_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
_SHARED_EXPERT = {"shared_expert_intermediate_size": 64}
_GEMMA_SOFTCAP = {"final_logit_softcapping": 30.0}
# Gemma 4's defaults left in a tiny model: a 262144 x 256 per-layer embedding for each layer
# (134M parameters) and 512-wide heads on the global layers
_GEMMA4_SMALL = {
    "vocab_size_per_layer_input": _TINY_SHAPE["vocab_size"],
    "hidden_size_per_layer_input": 8,
    "global_head_dim": 32,
}
# family -> (model_type of its causal LM config, settings on top of _TINY_SHAPE)
_TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "ministral": ("ministral", _SLIDING),
    "ministral3": ("ministral3", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {}),
    "helium": ("helium", {}),
    "exaone4": ("exaone4", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", _SLIDING),
    "phi3": ("phi3", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "granite": ("granite", {"logits_scaling": 4.0, "embedding_multiplier": 2.0}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16, **_SLIDING, **_GEMMA_SOFTCAP}),
    "gemma3": ("gemma3_text", {"query_pre_attn_scalar": 16, **_SLIDING, **_GEMMA_SOFTCAP}),
    "gemma4": ("gemma4_text", {**_SLIDING, **_GEMMA_SOFTCAP, **_GEMMA4_SMALL}),
    "qwen3_5": ("qwen3_5_text", _LINEAR_ATTENTION),
    "qwen3_next": ("qwen3_next", {**_LINEAR_ATTENTION, **_EXPERTS, **_SHARED_EXPERT}),
    "qwen2_moe": ("qwen2_moe", {**_EXPERTS, **_SHARED_EXPERT}),
    "qwen3_moe": ("qwen3_moe", _EXPERTS),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_LINEAR_ATTENTION, **_EXPERTS, **_SHARED_EXPERT}),
    "mixtral": ("mixtral", {**_LOCAL_EXPERTS, "sliding_window": None}),
    "granitemoe": ("granitemoe", {**_LOCAL_EXPERTS, "logits_scaling": 4.0}),
    "gpt_oss": (
        "gpt_oss",
        {**_LOCAL_EXPERTS, **_SLIDING, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "cohere": ("cohere", {"logit_scale": 0.25}),
    "cohere2": ("cohere2", {"logit_scale": 0.25, **_SLIDING}),
}
# name -> (model_type, family-specific settings on top of _TINY_SHAPE): tiny-<family>
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    f"tiny-{family}": entry for family, entry in _TINY_FAMILIES.items()
}
# transformers recommends eager attention for training Gemma (its attention softcap);
# gpt-oss's attention sinks need it too.
_EAGER_FAMILIES = ("gemma2", "gemma3", "gemma4", "gpt_oss")
DEFAULT_MODEL = "tiny-llama"


@dataclass(frozen=True)
class ModelSpec:
    """A resolved ``--model``: where it comes from, its family and its config."""

    name: str
    family: str
    config: Any
    tiny: bool

    @property
    def attn_implementation(self) -> str:
        return "eager" if _family_of(self.family) in _EAGER_FAMILIES else "sdpa"


def supported_families() -> tuple[str, ...]:
    """The model families fusetune can patch (``fusetune.integrations.transformers``)."""
    from fusetune.integrations.transformers import SUPPORTED_FAMILIES

    return tuple(SUPPORTED_FAMILIES)


def _family_of(model_type: str) -> str | None:
    """The family of a config's model type ("gemma3_text" -> "gemma3"), or None."""
    from fusetune.integrations._transformers_forwards import FAMILY_OF_MODEL_TYPE

    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    return None if family is None else family.model_type


def resolve(name: str) -> ModelSpec:
    """Read ``--model``'s config (no weights yet) and check that fusetune can patch it."""
    import transformers

    if name in TINY_MODELS:
        model_type, settings = TINY_MODELS[name]
        config = transformers.AutoConfig.for_model(model_type, **{**_TINY_SHAPE, **settings})
        spec = ModelSpec(name, model_type, config, tiny=True)
    else:
        _check_local(name)
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except (OSError, ValueError, KeyError) as exc:
            raise FinetuneError(
                f"--model {name!r} is not a built-in tiny model ({', '.join(TINY_MODELS)}), "
                f"a local model folder or a reachable hub id: {_first_line(exc)}"
            ) from None
        spec = ModelSpec(name, getattr(config, "model_type", "?"), config, tiny=False)
    if _family_of(spec.family) is None:
        from fusetune.integrations._transformers_forwards import NOT_SUPPORTED

        reason = NOT_SUPPORTED.get(spec.family)
        raise FinetuneError(
            f"--model {name!r} is a {spec.family!r} model, which fusetune cannot patch"
            f"{f' ({reason})' if reason else ''}; supported families: "
            f"{', '.join(supported_families())}"
        )
    return spec


def _check_local(name: str) -> None:
    """A name written as a path must be a model folder (no hub request for a typo'd path)."""
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or path.exists()
    if not looks_local:
        return  # a hub id, "org/name"
    if not path.is_dir():
        raise FinetuneError(f"--model {name!r}: no such model folder")
    if not (path / "config.json").is_file():
        raise FinetuneError(f"--model {name!r}: the folder has no config.json")


def build(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """The causal LM in ``dtype`` on ``device``: random weights (seeded) for a tiny model, the
    checkpoint's otherwise. Its KV cache is off (training)."""
    import transformers

    if spec.tiny:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            spec.config, attn_implementation=spec.attn_implementation
        )
        model = model.to(device=device, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.name, dtype=dtype, attn_implementation=spec.attn_implementation
        ).to(device)
    model.config.use_cache = False
    return model


def tokenizer(spec: ModelSpec) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for tiny models, the checkpoint's own otherwise."""
    if spec.tiny:
        return ByteTokenizer()
    import transformers

    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(spec.name)
    except (OSError, ValueError) as exc:
        message = f"--model {spec.name!r}: no usable tokenizer: {_first_line(exc)}"
        raise FinetuneError(message) from None
    encoder = HFTokenizer(hf_tokenizer, spec.name)
    model_vocab = getattr(spec.config, "vocab_size", None)
    if model_vocab is not None and encoder.vocab_size > model_vocab:
        raise FinetuneError(
            f"--model {spec.name!r}: its tokenizer has {encoder.vocab_size} tokens but the "
            f"model's embedding only {model_vocab}"
        )
    return encoder


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def quantize_4bit(model: Any) -> Any:
    """QLoRA's base: every nn.Linear of the decoder (not the lm_head) replaced in place by a
    bitsandbytes ``Linear4bit`` holding its weight in NF4 (blocksize 64, double quantisation),
    computing in the weight's dtype; fusetune's LoRA ops read it through
    :func:`fusetune.dequantize_4bit`. Raises FinetuneError without bitsandbytes."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise FinetuneError(
            "--load-in-4bit needs bitsandbytes: pip install 'fusetune[qlora]'"
        ) from None
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            dtype, device = child.weight.dtype, child.weight.device
            layer = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None,
                compute_dtype=dtype, quant_type="nf4", compress_statistics=True,
            )  # fmt: skip
            weight = bnb.nn.Params4bit(
                child.weight.data.cpu(), requires_grad=False, quant_type="nf4",
                compress_statistics=True,
            )  # fmt: skip
            layer.weight = weight._quantize("cpu") if device.type == "cpu" else weight.to(device)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, child_name, layer)
    return model
