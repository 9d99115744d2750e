"""The ``unsloth`` benchmark variant: the same random-weight model as the other variants, saved
once to a local folder and loaded through Unsloth's ``FastLanguageModel`` (Unsloth loads by name
or path only, not from a config).

Unsloth patches transformers for the whole process when it is imported, so it is imported only
here, inside the variant's own subprocess, and the folder is written by a separate interpreter
(``python -m fusetune.bench.unsloth_variant SPEC``) so that the worker imports Unsloth before
transformers, as Unsloth asks.

Environment set before the import (the GPU machine has no network): ``UNSLOTH_DISABLE_STATISTICS``
(Unsloth downloads a README from the Hub at load as usage statistics), ``HF_HUB_OFFLINE``,
``TRANSFORMERS_OFFLINE``, ``HF_DATASETS_OFFLINE``, ``HF_HUB_DISABLE_TELEMETRY``, and
``UNSLOTH_COMPILE_LOCATION`` under /tmp (Unsloth writes generated modules to
``./unsloth_compiled_cache`` otherwise).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

MODEL_ROOT = Path(os.environ.get("FUSETUNE_BENCH_MODELS", "/tmp/fusetune-bench-models"))
OFFLINE_ENV = {
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",
}
SAVE_TIMEOUT_S = 900
# Tokens of the placeholder tokenizer saved beside the weights (Unsloth loads one with the model).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def missing() -> str | None:
    """Why the variant cannot run here (a sentence for the result row), or None."""
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (carry .unsloth: tools/gpu_unsloth.sh)"
    return None


def model_folder(
    model_type: str, config: dict[str, Any], tiny_config: dict[str, Any] | None
) -> Path:
    """A folder with the model that ``torch.manual_seed(0)`` then ``from_config`` builds (bf16
    safetensors, config, placeholder tokenizer), written once and reused: the name hashes the
    config. ``tiny_config`` (the smoke run's overrides) is merged over ``config``.

    Raises RuntimeError when the writer process fails."""
    spec = {"model_type": model_type, "config": {**config, **(tiny_config or {})}}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    folder = MODEL_ROOT / f"{model_type}-{digest}"
    if (folder / "DONE").exists():
        return folder
    command = [
        sys.executable,
        "-m",
        "fusetune.bench.unsloth_variant",
        json.dumps(spec),
        str(folder),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=SAVE_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or not (folder / "DONE").exists():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"saving the model for unsloth failed: {tail[:200]}")
    return folder


def _write_folder(spec: dict[str, Any], folder: Path) -> None:
    """The writer process: build on the GPU when there is one (the same random numbers as the
    other variants, which build there), save, then mark the folder complete."""
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    _placeholder_tokenizer().save_pretrained(partial)
    (partial / "DONE").write_text("complete\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _placeholder_tokenizer() -> Any:
    """A four-token word-level tokenizer: the step feeds token ids, never text."""
    import tokenizers
    import transformers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def load(
    folder: Path,
    targets: list[str] | str,
    rank: int,
    alpha: int,
    seq_len: int,
    *,
    load_in_4bit: bool = False,
    gradient_checkpointing: bool = False,
) -> torch.nn.Module:
    """Unsloth's model with LoRA on ``targets`` (dropout 0, no bias), lora_B drawn N(0, 0.02) as
    the other variants do. ``gradient_checkpointing`` selects Unsloth's own "unsloth" mode
    (layer inputs offloaded to host memory), else none.

    Raises ImportError without unsloth."""
    os.environ.update({k: v for k, v in OFFLINE_ENV.items() if k not in os.environ})
    import unsloth  # noqa: F401 - first, so that it patches transformers before anything uses it
    from unsloth import FastLanguageModel

    # The mode is named at each of Unsloth's three entry points: from_pretrained's default is
    # "unsloth", and for_training keeps whatever was chosen last.
    mode = "unsloth" if gradient_checkpointing else False
    model, _ = FastLanguageModel.from_pretrained(
        str(folder), dtype=torch.bfloat16, load_in_4bit=load_in_4bit, max_seq_length=seq_len,
        local_files_only=True, use_gradient_checkpointing=mode,
    )  # fmt: skip
    model = FastLanguageModel.get_peft_model(
        model, r=rank, lora_alpha=alpha, lora_dropout=0, target_modules=targets, bias="none",
        use_gradient_checkpointing=mode, random_state=0,
    )  # fmt: skip
    model.config.use_cache = False
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; trained adapters are not
            torch.nn.init.normal_(param, std=0.02)
    FastLanguageModel.for_training(model, use_gradient_checkpointing=mode)
    return model


def adapter_dtype(model: torch.nn.Module) -> str:
    """The dtype of the first LoRA parameter (Unsloth may differ from PEFT's fp32 default)."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            return str(param.dtype).removeprefix("torch.")
    return "-"


def checkpointed_layers(model: torch.nn.Module) -> int:
    """How many modules have gradient checkpointing on (0 in every bench e2e variant)."""
    return sum(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


if __name__ == "__main__":
    _write_folder(json.loads(sys.argv[1]), Path(sys.argv[2]))
