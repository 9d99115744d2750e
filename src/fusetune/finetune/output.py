"""The output folder, written all at once: everything goes into a hidden sibling folder, which
is renamed onto ``--output`` only when complete. A failed or interrupted run leaves nothing but
the checkpoints it wrote (``checkpoint-<step>/`` inside ``--output``, see
:mod:`~fusetune.finetune.checkpoint`); the final output carries them over (hard links)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fusetune.finetune.errors import FinetuneError

# Written into every output folder; a folder holding it may be replaced by a later run.
MARKER = "fusetune_finetune.json"
CHECKPOINT_PREFIX = "checkpoint-"


def checkpoint_folders(path: Path) -> list[Path]:
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.name.startswith(CHECKPOINT_PREFIX))


def _ours(path: Path) -> bool:
    """Written by fusetune: a finished output, or a run's checkpoints (and their staging)."""
    if (path / MARKER).is_file():
        return True
    names = [p.name for p in path.iterdir()]
    return all(n.startswith((CHECKPOINT_PREFIX, f".{CHECKPOINT_PREFIX}")) for n in names)


def check_output(path: Path, resuming: bool = False) -> None:
    """Fail before any work if ``path`` cannot become the output folder: a file, a non-empty
    folder fusetune did not write (it is never replaced), a place we cannot write to, or (unless
    ``resuming``) a folder holding an earlier run's checkpoints."""
    if path.exists():
        if not path.is_dir():
            raise FinetuneError(f"--output {path}: exists and is not a folder")
        if any(path.iterdir()) and not _ours(path):
            raise FinetuneError(
                f"--output {path}: a non-empty folder that fusetune did not write; "
                "pick a new or empty folder (it is never overwritten)"
            )
        if checkpoint_folders(path) and not resuming:
            raise FinetuneError(
                f"--output {path}: holds an earlier run's checkpoints "
                f"({', '.join(p.name for p in checkpoint_folders(path))}); add --resume to "
                "continue that run, or pick another folder"
            )
        _check_writable(path, path)
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FinetuneError(f"--output {path}: cannot write into {ancestor} (not a folder)")
    _check_writable(path, ancestor)


def _check_writable(path: Path, folder: Path) -> None:
    """Create and remove a file in ``folder``: permission bits do not tell (root, read-only
    mounts, quotas)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise FinetuneError(
            f"--output {path}: cannot write into {folder} ({exc.strerror or exc})"
        ) from None


def check_space(path: Path, needed: int, what: str) -> None:
    """Fail before step 1 when the filesystem of ``path`` has less than ``needed`` bytes free."""
    folder = path.absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise FinetuneError(
            f"--output {path}: {_size(free)} free on its disk, {what} needs about {_size(needed)}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


@contextlib.contextmanager
def staged_output(path: Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``path`` (a previous fusetune
    output there is removed, its checkpoints carried over), on any error it is deleted."""
    path.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.absolute().parent))
    try:
        yield staging
        for folder in checkpoint_folders(path):
            link_tree(folder, staging / folder.name)
        if path.exists():
            old = staging.with_name(staging.name.replace(".partial-", ".old-"))
            path.rename(old)
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def link_tree(source: Path, target: Path) -> None:
    """Hard-link every file of ``source`` into ``target`` (copy where links are not possible):
    the original stays whole until the rename that replaces it."""
    target.mkdir()
    for item in source.iterdir():
        if item.is_dir():
            link_tree(item, target / item.name)
            continue
        try:
            os.link(item, target / item.name)
        except OSError:
            shutil.copy2(item, target / item.name)
