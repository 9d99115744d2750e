"""The output folder, written all at once: everything goes into a hidden sibling folder, which
is renamed onto ``--output`` only when complete. A failed or interrupted run leaves nothing."""

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


def check_output(path: Path) -> None:
    """Fail before any work if ``path`` cannot become the output folder: a file, a non-empty
    folder fusetune did not write (it is never replaced), or a place we cannot write to."""
    if path.exists():
        if not path.is_dir():
            raise FinetuneError(f"--output {path}: exists and is not a folder")
        if any(path.iterdir()) and not (path / MARKER).is_file():
            raise FinetuneError(
                f"--output {path}: a non-empty folder that fusetune did not write; "
                "pick a new or empty folder (it is never overwritten)"
            )
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise FinetuneError(f"--output {path}: cannot write into {ancestor}")


@contextlib.contextmanager
def staged_output(path: Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``path`` (a previous fusetune
    output there is removed), on any error it is deleted."""
    path.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.absolute().parent))
    try:
        yield staging
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
