"""Prompts for ``python -m fusetune grpo``: JSONL, one ``{"prompt": ..., "answer": ...}`` a line
(``answer`` optional; any other string columns are passed to the rewards too), or the small
arithmetic set shipped with fusetune."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from fusetune.finetune.errors import FinetuneError

DEFAULT_NAME = "tiny_arithmetic.jsonl (built-in)"


def load_prompts(path: str | None) -> tuple[list[dict[str, str]], str]:
    """(rows, a name for the summary). Raises FinetuneError naming the file and line."""
    if path is None:
        text = resources.files("fusetune.grpo").joinpath("datasets/tiny_arithmetic.jsonl")
        lines, name = text.read_text().splitlines(), DEFAULT_NAME
    else:
        file = Path(path)
        if not file.is_file():
            raise FinetuneError(f"--data {path}: no such file")
        lines, name = file.read_text(encoding="utf-8").splitlines(), str(file)
    rows = [_parse(line, name, number) for number, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise FinetuneError(f"--data {name}: no prompts")
    keys = set(rows[0])
    for number, row in enumerate(rows, 1):
        if set(row) != keys:
            raise FinetuneError(
                f"--data {name}: row {number} has fields {sorted(row)}, the first {sorted(keys)}"
            )
    return rows, name


def _parse(line: str, name: str, number: int) -> dict[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise FinetuneError(f"--data {name}, line {number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise FinetuneError(f"--data {name}, line {number}: needs a string 'prompt'")
    if not record["prompt"]:
        raise FinetuneError(f"--data {name}, line {number}: an empty 'prompt'")
    return {key: str(value) for key, value in record.items()}
