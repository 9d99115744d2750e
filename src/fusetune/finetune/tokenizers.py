"""Tokenizers for the fine-tuning command: a byte-level one built in code (for the built-in tiny
models: no download) and an adapter around a HuggingFace tokenizer.

Both hand tokenisation pieces to :func:`fusetune.finetune.data.encode_example`: lists of token
ids, each marked trained (the loss is taken on it) or not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fusetune.finetune.errors import FinetuneError

Pieces = list[tuple[list[int], bool]]


def _plain_chat(encode, messages, end_of_turn: list[int]) -> Pieces:
    """A template for tokenizers without one: ``<|role|>\\n`` headers, each assistant reply
    followed by the end-of-turn tokens (trained, so the model learns to stop)."""
    pieces: Pieces = []
    for role, content in messages:
        if role == "assistant":
            pieces.append((encode("<|assistant|>\n"), False))
            pieces.append((encode(content) + end_of_turn, True))
            pieces.append((encode("\n"), False))
        else:
            pieces.append((encode(f"<|{role}|>\n{content}\n"), False))
    return pieces


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then PAD, BOS and EOS: a 259-token vocabulary that needs no
    file. Used with the built-in tiny models."""

    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def completion_pieces(self, prompt: str, completion: str) -> Pieces:
        return [
            ([self.bos_id, *self.encode(prompt)], False),
            (self.encode(completion) + [self.eos_id], True),
        ]

    def chat_pieces(self, messages: tuple[tuple[str, str], ...]) -> Pieces:
        return [([self.bos_id], False), *_plain_chat(self.encode, messages, [self.eos_id])]

    def save(self, directory: Path) -> None:
        spec = {"type": "fusetune.ByteTokenizer", "vocab_size": self.vocab_size}
        spec.update(pad_id=self.pad_id, bos_id=self.bos_id, eos_id=self.eos_id)
        (directory / "byte_tokenizer.json").write_text(json.dumps(spec, indent=2) + "\n")


class HFTokenizer:
    """A ``transformers`` tokenizer: its chat template for messages (the plain template where
    it has none), its BOS/EOS around prompt/completion pairs."""

    def __init__(self, tokenizer: Any, name: str):
        self.tokenizer = tokenizer
        self.name = name
        if tokenizer.eos_token_id is None:
            raise FinetuneError(f"--model {name}: its tokenizer has no EOS token")
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        bos = tokenizer.bos_token_id
        self.prefix = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids if text else []

    def completion_pieces(self, prompt: str, completion: str) -> Pieces:
        return [
            (self.prefix + self.encode(prompt), False),
            (self.encode(completion) + [self.eos_id], True),
        ]

    def chat_pieces(self, messages: tuple[tuple[str, str], ...]) -> Pieces:
        if not getattr(self.tokenizer, "chat_template", None):
            return [(self.prefix, False), *_plain_chat(self.encode, messages, [self.eos_id])]
        return self._templated(messages)

    def _render(self, messages, generation_prompt: bool = False) -> str:
        turns = [{"role": role, "content": content} for role, content in messages]
        return self.tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _templated(self, messages: tuple[tuple[str, str], ...]) -> Pieces:
        """Render growing prefixes of the conversation; the text each assistant turn adds is
        trained, the rest (headers, user turns) is not."""
        pieces: Pieces = []
        done = ""
        for index, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            before = self._render(messages[:index], generation_prompt=True)
            after = self._render(messages[: index + 1])
            if not before.startswith(done) or not after.startswith(before):
                raise FinetuneError(
                    f"--model {self.name}: its chat template rewrites earlier turns, so the "
                    "assistant turns cannot be found; use prompt/completion data"
                )
            pieces.append((self.encode(before[len(done) :]), False))
            pieces.append((self.encode(after[len(before) :]), True))
            done = after
        rest = self._render(messages)[len(done) :]
        pieces.append((self.encode(rest), False))
        return pieces

    def save(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(str(directory))
