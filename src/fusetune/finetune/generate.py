"""``python -m fusetune generate``: try a fine-tuned model.

    python -m fusetune generate --model tiny-llama --adapter fusetune-finetune-output "1+1="
    python -m fusetune generate --model fusetune-finetune-output "1+1="   # the same
    python -m fusetune generate --model fusetune-finetune-output/merged "1+1="

``--model``: a built-in tiny model, a local folder or hub id, or a ``finetune`` output folder
(its base model and adapter, or its full model). ``--adapter``: a LoRA adapter folder (PEFT's
format). Without a prompt, one prompt a line is read from stdin, each answered in turn. Greedy
decoding unless ``--temperature`` > 0. Prints the completion only; exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from fusetune.finetune import models
from fusetune.finetune.args import _non_negative_float, _positive_int, resolve_device
from fusetune.finetune.errors import FinetuneError
from fusetune.finetune.output import MARKER
from fusetune.finetune.tokenizers import ByteTokenizer

BYTE_TOKENIZER = "byte_tokenizer.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune generate",
        description="Complete a prompt with a model, optionally with a LoRA adapter on it.",
        allow_abbrev=False,
    )
    parser.add_argument("prompt", nargs="?", help="(default: one prompt a line from stdin)")
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="(default: %(default)s)")
    parser.add_argument("--adapter", default=None, help="a LoRA adapter folder")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32)
    parser.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="0: greedy (default)"
    )
    parser.add_argument("--seed", type=int, default=None, help="a tiny model's weights' seed")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn (chat template)"
    )
    parser.add_argument("--device", default="auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; exit status 0, or 2 with ``error: ...`` on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            model, tokenizer = load(args)
        prompts = [args.prompt] if args.prompt is not None else _stdin_prompts()
        for prompt in prompts:
            print(complete(model, tokenizer, prompt, args), flush=True)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _stdin_prompts():
    for line in sys.stdin:
        if line.strip():
            yield line.rstrip("\n")


def _record(folder: Path) -> dict[str, Any] | None:
    """A finetune output's run record, or None."""
    marker = folder / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model in eval mode on the device, tokenizer). Raises FinetuneError for a model or
    adapter that is not there."""
    device = resolve_device(args.device)
    name, adapter = args.model, args.adapter
    record = _record(Path(name)) if Path(name).is_dir() else None
    if record is not None and record.get("mode") == "lora" and adapter is None:
        name, adapter = record["model"], args.model  # an output folder: its base and adapter
    if adapter is not None:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise FinetuneError(f"--adapter {adapter}: no adapter_config.json in it")
        record = _record(Path(adapter)) or record
    seed = args.seed
    if seed is None:  # a tiny base must be the one the adapter was trained on
        seed = int(((record or {}).get("args") or {}).get("seed", 0))
    model, tokenizer = _base(name, device, seed)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval(), tokenizer


def _base(name: str, device: torch.device, seed: int) -> tuple[Any, Any]:
    if name in models.TINY_MODELS:
        spec = models.resolve(name)
        return models.build(spec, torch.float32, device, seed), ByteTokenizer()
    import transformers

    folder = Path(name)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise FinetuneError(f"--model {name}: the folder has no config.json")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
        if (folder / BYTE_TOKENIZER).is_file():  # a tiny model fine-tuned by fusetune
            return model, ByteTokenizer()
        return model, transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"--model {name}: cannot load it: {exc}") from None


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids as finetune trains them: BOS + text (prompt / completion data), or
    the chat template with the assistant's header."""
    if isinstance(tokenizer, ByteTokenizer):
        text = f"<|user|>\n{prompt}\n<|assistant|>\n" if chat else prompt
        return [tokenizer.bos_id, *tokenizer.encode(text)]
    if chat and getattr(tokenizer, "chat_template", None):
        turns = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


@torch.no_grad()
def complete(model: Any, tokenizer: Any, prompt: str, args: argparse.Namespace) -> str:
    """The decoded completion (special tokens and the prompt left out)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids(tokenizer, prompt, args.chat)], device=device)
    eos = tokenizer.eos_id if isinstance(tokenizer, ByteTokenizer) else tokenizer.eos_token_id
    pad = tokenizer.pad_id if isinstance(tokenizer, ByteTokenizer) else tokenizer.pad_token_id
    sample = args.temperature > 0
    if sample and args.seed is not None:
        torch.manual_seed(args.seed)
    extra = {"do_sample": True, "temperature": args.temperature} if sample else {}
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=args.max_new_tokens,
        do_sample=sample,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else eos,
        **extra,
    )
    new = output[0, ids.shape[1] :].tolist()
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(new)
    return tokenizer.decode(new, skip_special_tokens=True)
