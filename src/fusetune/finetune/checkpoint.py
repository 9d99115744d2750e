"""Atomic training checkpoints under ``--output``: ``checkpoint-<step>/`` holding

- ``weights.safetensors``: the trained parameters (the LoRA adapter, or the whole model);
- ``optimizer.pt``: AdamW's state, keyed by parameter name;
- ``trainer_state.pt``: the GradScaler's state (fp16) and every rank's RNG states (Python,
  torch CPU, CUDA where there is one);
- ``fusetune_checkpoint.json`` (written last): the step (which is the data position: the
  batches are a seeded sequence, so step k resumes at micro-batch k x --grad-accum), the losses
  so far, the file sizes, and what the run must match to resume it (:func:`identity`).

A checkpoint is written into a hidden ``.checkpoint-<step>.partial-*`` folder beside the
others, every file fsynced, then renamed into place (and the folder fsynced), so a run killed at
any moment leaves complete checkpoints only. The last ``--keep-checkpoints`` are kept. Under
torchrun every rank takes part in gathering the state, rank 0 writes, every rank restores.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fusetune
from fusetune.finetune.distributed import Ranks
from fusetune.finetune.errors import FinetuneError

META = "fusetune_checkpoint.json"
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "trainer_state.pt"
PREFIX = "checkpoint-"
FORMAT = 1
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
# What a resumed run must share with the checkpoint, in the order errors name them.
IDENTITY_KEYS = ("version", "model", "adapter", "data", "options")


# ----------------------------------------------------------------------------- identity


def config_hash(config: Any) -> str:
    """A hash of a transformers config, without the fields that do not change the model."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    skip = {"transformers_version", "use_cache", "dtype", "torch_dtype"}
    kept = {k: v for k, v in values.items() if k not in skip and not k.startswith("_")}
    return _sha(json.dumps(kept, sort_keys=True, default=str))


def data_hash(encoded: Sequence[tuple[list[int], list[int]]]) -> str:
    """A hash of the tokenised examples (ids and labels), so a changed file, tokenizer or
    --seq-len is caught."""
    digest = hashlib.sha256()
    for ids, labels in encoded:
        digest.update(json.dumps([ids, labels], separators=(",", ":")).encode())
    return digest.hexdigest()[:16]


def identity(model: str, config: Any, adapter: dict, data: str, options: dict) -> dict[str, Any]:
    """What a checkpoint records and a resumed run must match: fusetune's version, the model
    (name and config hash), the adapter (LoRA r, alpha, targets; or full), the data hash and
    the options that decide the batches and the arithmetic."""
    return {
        "version": fusetune.__version__,
        "model": {"name": model, "config": config_hash(config)},
        "adapter": adapter,
        "data": data,
        "options": options,
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- finding


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose metadata and file sizes have been checked."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """``checkpoint-<step>`` folders directly under ``folder``, by step."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(f for f in found if f[1].is_dir())


def latest(folder: Path) -> Path | None:
    folders = step_folders(folder)
    return folders[-1][1] if folders else None


def read(path: Path) -> Checkpoint:
    """Read and check a checkpoint folder's metadata and file sizes (not yet its tensors).

    Raises FinetuneError naming the problem: not a checkpoint, unreadable metadata, a file
    missing or of the wrong size (truncated)."""
    where = f"--resume {path}"
    if not path.is_dir():
        raise FinetuneError(f"{where}: no such checkpoint folder")
    meta_file = path / META
    if not meta_file.is_file():
        raise FinetuneError(f"{where}: not a fusetune checkpoint (no {META})")
    try:
        meta = json.loads(meta_file.read_text())
        step, files = int(meta["step"]), dict(meta["files"])
        if meta.get("format") != FORMAT or step < 1:
            raise ValueError(f"format {meta.get('format')!r}, step {step}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"{where}: corrupt checkpoint: {META} is unreadable ({exc})") from None
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise FinetuneError(f"{where}: corrupt checkpoint: {name} is missing")
        if file.stat().st_size != size:
            raise FinetuneError(
                f"{where}: corrupt checkpoint: {name} is {file.stat().st_size} bytes, "
                f"{size} were written (truncated or changed)"
            )
    return Checkpoint(path, meta)


def check_matches(checkpoint: Checkpoint, expected: dict[str, Any]) -> None:
    """Raise FinetuneError naming every part of the run that differs from the checkpoint's:
    version, model, LoRA config, data, options."""
    recorded = checkpoint.meta.get("identity", {})
    problems = [_mismatch(key, recorded.get(key), expected[key]) for key in IDENTITY_KEYS]
    problems = [p for p in problems if p]
    if problems:
        raise FinetuneError(
            f"--resume {checkpoint.path}: the checkpoint does not match this run: "
            + "; ".join(problems)
        )


def _mismatch(key: str, saved: Any, now: Any) -> str:
    if saved == now:
        return ""
    if key == "version":
        return f"fusetune version {saved} (checkpoint) vs {now} (installed)"
    if key == "model":
        saved = saved or {}
        same_name = saved.get("name") == now["name"]
        what = "config differs" if same_name else f"{saved.get('name')!r} vs {now['name']!r}"
        return f"model: {what} (config hash {saved.get('config')} vs {now['config']})"
    if key == "adapter":
        return f"LoRA config: {_text(saved)} (checkpoint) vs {_text(now)} (this run)"
    if key == "data":
        return (
            f"data: the tokenised examples differ (hash {saved} vs {now}): the same --data, "
            "--seq-len and tokenizer are needed"
        )
    saved = saved or {}
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)} vs {v}" for k, v in now.items()
             if saved.get(k) != v]  # fmt: skip
    return "options: " + ", ".join(diffs)


def _text(value: Any) -> str:
    if not isinstance(value, dict):
        return str(value)
    return " ".join(f"{k}={v}" for k, v in value.items())


# ----------------------------------------------------------------------------- state


def _options(**extra: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture(model, optimizer, scaler, ranks: Ranks) -> dict[str, Any] | None:
    """The training state, gathered in full onto rank 0's CPU (a collective under torchrun: every
    rank calls it); None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _options(cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    rng = [_rng_state()]
    if ranks.world > 1:
        rng = [None] * ranks.world
        dist.all_gather_object(rng, _rng_state())
    if not ranks.main:
        return None
    scaler_state = scaler.state_dict() if scaler is not None else None
    return {"weights": weights, "optimizer": optim, "state": {"rng": rng, "scaler": scaler_state}}


def restore(checkpoint: Checkpoint, model, optimizer, scaler, ranks: Ranks) -> None:
    """Load a checkpoint into the model, optimizer, GradScaler and RNGs; every rank reads the
    folder (one host, or a shared filesystem) and takes its shard.

    Raises FinetuneError when a file cannot be read or the parameters do not match the model's
    (a mismatched model or LoRA config that slipped past the metadata)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    where = f"--resume {checkpoint.path}"
    try:
        weights = load_file(str(checkpoint.path / WEIGHTS))
        optim = torch.load(checkpoint.path / OPTIMIZER, map_location="cpu", weights_only=True)
        state = torch.load(checkpoint.path / STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, pickle and zip errors alike: the file is bad
        raise FinetuneError(f"{where}: corrupt checkpoint: cannot read it ({exc})") from None
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    names = {_plain(n) for n in trained}
    if {_plain(n) for n in weights} != names:
        missing = sorted(names - {_plain(n) for n in weights})[:3]
        raise FinetuneError(
            f"{where}: the checkpoint does not match this run: model / LoRA config: its "
            f"parameters differ from the model's (e.g. missing {missing})"
        )
    set_model_state_dict(model, weights, options=_options(strict=False))
    set_optimizer_state_dict(model, optimizer, optim, options=_options())
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    _set_rng_state(rng[ranks.rank] if ranks.rank < len(rng) else rng[0])


def _plain(name: str) -> str:
    """A parameter name without the wrappers' prefixes (FSDP2 / compile keep the names, but be
    lenient with ``_orig_mod.``)."""
    return name.replace("_orig_mod.", "")


def estimate_bytes(model: torch.nn.Module) -> int:
    """A checkpoint's size: the trained parameters and AdamW's two moments of each."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * (p.element_size() + 8) for p in trained) + (1 << 20)


def nonfinite_weight(weights: dict[str, torch.Tensor]) -> str | None:
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


# ----------------------------------------------------------------------------- writing


def write(
    output: Path, step: int, snapshot: dict[str, Any], meta: dict[str, Any], keep: int
) -> Path:
    """Write ``snapshot`` (from :func:`capture`) as ``output/checkpoint-<step>`` atomically and
    keep the last ``keep``. Raises FinetuneError (and writes nothing) when a weight is not
    finite."""
    from safetensors.torch import save_file

    bad = nonfinite_weight(snapshot["weights"])
    if bad is not None:
        raise FinetuneError(f"step {step}: {bad} is not finite; no checkpoint written")
    output.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step}.partial-", dir=output))
    try:
        weights = {k: v.contiguous() for k, v in snapshot["weights"].items()}
        save_file(weights, str(staging / WEIGHTS))
        torch.save(snapshot["optimizer"], staging / OPTIMIZER)
        torch.save(snapshot["state"], staging / STATE)
        files = {name: (staging / name).stat().st_size for name in (WEIGHTS, OPTIMIZER, STATE)}
        record = {"format": FORMAT, **meta, "step": step, "files": files}
        (staging / META).write_text(json.dumps(record, indent=2) + "\n")
        for name in (*files, META):
            _fsync(staging / name)
        _fsync(staging)
        final = output / f"{PREFIX}{step}"
        _replace(staging, final)
        _fsync(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    prune(output, step, keep)
    return final


def _replace(staging: Path, final: Path) -> None:
    """Rename ``staging`` onto ``final``; an older folder there (a run resumed from an earlier
    checkpoint reaches the same step again) is moved aside first and then removed."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(output: Path, step: int, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``step``; later ones (left by a run that went
    further before this one resumed from an earlier checkpoint) belong to an abandoned history
    and go too."""
    folders = step_folders(output)
    older = [p for s, p in folders if s <= step]
    stale = [p for s, p in folders if s > step]
    for path in older[:-keep] + stale:
        shutil.rmtree(path, ignore_errors=True)


def clean_partials(output: Path) -> None:
    """Remove the staging folders of checkpoints whose writing was interrupted."""
    if output.is_dir():
        for path in output.iterdir():
            if path.name.startswith(f".{PREFIX}") and (".partial-" in path.name or
                                                         path.name.endswith(".old")):  # fmt: skip
                shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- the run's side


@dataclass
class Checkpointing:
    """What the training loop needs: where and how often to write, what to resume from.
    ``last_good``: the newest checkpoint written or resumed from (named when a run stops)."""

    output: Path
    every: int | None
    keep: int
    meta: dict[str, Any]
    ranks: Ranks
    resume: Checkpoint | None = None
    last_good: Path | None = None

    def start(self, model, optimizer, scaler, result) -> int:
        """Restore the checkpoint to resume from, if any; the number of steps already done."""
        if self.ranks.main:
            clean_partials(self.output)
        if self.resume is None:
            return 0
        restore(self.resume, model, optimizer, scaler, self.ranks)
        meta = self.resume.meta
        result.losses = [float("nan") if v is None else v for v in meta["losses"]]
        result.skipped = list(meta.get("skipped", []))
        result.tokens = int(meta.get("tokens", 0))
        result.resumed_from = self.resume.step
        self.last_good = self.resume.path
        return self.resume.step

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, model, optimizer, scaler, result) -> Path:
        """Every rank gathers, rank 0 writes; returns the folder (on every rank)."""
        snapshot = capture(model, optimizer, scaler, self.ranks)
        if snapshot is not None:
            losses = [v if v == v and abs(v) != float("inf") else None for v in result.losses]
            extra = {"losses": losses, "skipped": result.skipped, "tokens": result.tokens}
            write(self.output, step, snapshot, {**self.meta, **extra}, self.keep)
        if self.ranks.world > 1:
            dist.barrier()
        self.last_good = self.output / f"{PREFIX}{step}"
        return self.last_good
