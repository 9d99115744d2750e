"""Training data for ``python -m fusetune finetune``: JSONL parsing, tokenisation with the loss
on the completion only, and padded batches.

A data file holds one JSON object per line (blank lines are skipped), either

    {"prompt": "Add 2 and 3.", "completion": " 5"}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

Prompt/completion pairs are concatenated as they are (BOS first when the tokenizer adds one,
EOS after the completion); chat messages go through the tokenizer's chat template (or a plain
``<|role|>`` template where it has none). Labels are -100 everywhere except the completion
and the assistant turns (their end-of-turn marker included), so the loss is on those tokens only.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import torch

from fusetune.finetune.errors import FinetuneError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
DEFAULT_DATASET = "tiny_sft.jsonl"


@dataclass(frozen=True)
class Example:
    """One training example: either ``prompt`` + ``completion`` or chat ``messages``."""

    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Batch:
    """A padded micro-batch on the CPU. ``tokens``: non-padding tokens; ``label_count``: the
    tokens the loss is taken on after the causal shift (HF's ``num_items_in_batch``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    tokens: int
    label_count: int


class Encoder(Protocol):
    """What tokenisation needs from a tokenizer (see :mod:`fusetune.finetune.tokenizers`)."""

    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def completion_pieces(self, prompt: str, completion: str) -> list[tuple[list[int], bool]]: ...

    def chat_pieces(
        self, messages: tuple[tuple[str, str], ...]
    ) -> list[tuple[list[int], bool]]: ...


# ----------------------------------------------------------------------------- reading


def default_dataset() -> resources.abc.Traversable:
    """The small instruction dataset shipped with the package."""
    return resources.files("fusetune.finetune").joinpath("datasets", DEFAULT_DATASET)


def load_examples(path: str | Path | None) -> tuple[list[Example], str]:
    """Parse a JSONL file (the shipped dataset when ``path`` is None) into examples.

    Returns the examples and a display name. Raises :class:`FinetuneError` for a missing file,
    a line that is not JSON or not an example (the message names the file and line), or a file
    with no examples.
    """
    if path is None:
        source = default_dataset()
        name = f"built-in {DEFAULT_DATASET}"
    else:
        source = Path(path)
        name = str(path)
        if not source.exists():
            raise FinetuneError(f"--data: file not found: {path}")
        if not source.is_file():
            raise FinetuneError(f"--data: not a file: {path}")
    with source.open("rb") as stream:
        examples = list(parse_lines(stream, name))
    if not examples:
        raise FinetuneError(f"--data: {name} holds no examples (one JSON object per line)")
    return examples, name


def parse_lines(lines: Iterable[bytes | str], name: str = "<data>") -> Iterator[Example]:
    """Examples from JSONL lines; errors name ``name`` and the 1-based line number."""
    for number, raw in enumerate(lines, start=1):
        where = f"{name}:{number}"
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FinetuneError(f"--data: {where}: not UTF-8 text ({exc.reason})") from None
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise FinetuneError(
                f"--data: {where}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        yield parse_record(record, where, number)


def parse_record(record: object, where: str, line: int = 0) -> Example:
    """One JSON value -> :class:`Example`, or a :class:`FinetuneError` saying what is wrong."""
    if not isinstance(record, dict):
        raise FinetuneError(f"--data: {where}: expected a JSON object, got {_json_type(record)}")
    if "messages" in record:
        return Example(line=line, messages=_parse_messages(record["messages"], where))
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                got = "missing" if value is None else _json_type(value)
                raise FinetuneError(f"--data: {where}: {key!r} must be a string, got {got}")
        if not completion:
            raise FinetuneError(f"--data: {where}: 'completion' is empty (nothing to train on)")
        return Example(line=line, prompt=prompt, completion=completion)
    keys = ", ".join(map(repr, record)) or "none"
    raise FinetuneError(
        f"--data: {where}: expected 'prompt' and 'completion' strings or a 'messages' list "
        f"(keys found: {keys})"
    )


def _parse_messages(messages: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise FinetuneError(f"--data: {where}: 'messages' must be a non-empty list")
    parsed = []
    for index, message in enumerate(messages):
        at = f"--data: {where}: messages[{index}]"
        if not isinstance(message, dict):
            raise FinetuneError(f"{at}: expected an object, got {_json_type(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise FinetuneError(f"{at}: 'role' must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            got = "missing" if content is None else _json_type(content)
            raise FinetuneError(f"{at}: 'content' must be a string, got {got}")
        parsed.append((role, content))
    if not any(role == "assistant" for role, _ in parsed):
        raise FinetuneError(f"--data: {where}: no assistant message (nothing to train on)")
    return tuple(parsed)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- tokenising


def encode_example(example: Example, encoder: Encoder) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside the completion / assistant turns), untruncated."""
    if example.messages:
        pieces = encoder.chat_pieces(example.messages)
    else:
        pieces = encoder.completion_pieces(example.prompt or "", example.completion or "")
    ids: list[int] = []
    labels: list[int] = []
    for piece, trained in pieces:
        ids.extend(piece)
        labels.extend(piece if trained else [IGNORE_INDEX] * len(piece))
    return ids, labels


def encode_all(
    examples: list[Example], encoder: Encoder, seq_len: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Encode and truncate to ``seq_len``; examples left with no trained token after the shift
    are dropped. Returns the encoded examples and how many were dropped; raises
    :class:`FinetuneError` when none is left."""
    kept, dropped = [], 0
    for example in examples:
        ids, labels = encode_example(example, encoder)
        ids, labels = ids[:seq_len], labels[:seq_len]
        if any(label != IGNORE_INDEX for label in labels[1:]):
            kept.append((ids, labels))
        else:
            dropped += 1
    if not kept:
        raise FinetuneError(
            f"--data: no example has a completion token within --seq-len {seq_len} "
            "(prompts too long?)"
        )
    return kept, dropped


def make_batches(
    encoded: list[tuple[list[int], list[int]]],
    batch_size: int,
    count: int,
    pad_id: int,
    seed: int,
    length: int | None = None,
) -> list[Batch]:
    """``count`` micro-batches of ``batch_size`` examples, drawn epoch by epoch in a seeded
    shuffle, each right-padded to its longest example (to ``length`` when given: one shape)."""
    order = _shuffled_epochs(len(encoded), seed)
    return [
        _pad([encoded[next(order)] for _ in range(batch_size)], pad_id, length)
        for _ in range(count)
    ]


def _shuffled_epochs(size: int, seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        epoch = list(range(size))
        rng.shuffle(epoch)
        yield from epoch


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int, length: int | None) -> Batch:
    length = length or max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        attention_mask[row, : len(ids)] = 1
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        tokens=int(attention_mask.sum()),
        label_count=int((labels[:, 1:] != IGNORE_INDEX).sum()),
    )


def rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a micro-batch (a rank's share), its counts recomputed."""
    labels, mask = batch.labels[start:stop], batch.attention_mask[start:stop]
    return Batch(
        input_ids=batch.input_ids[start:stop],
        attention_mask=mask,
        labels=labels,
        tokens=int(mask.sum()),
        label_count=int((labels[:, 1:] != IGNORE_INDEX).sum()),
    )
