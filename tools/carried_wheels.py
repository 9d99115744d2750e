"""Which carried wheels to install on the GPU machine: every wheel in the given folders whose
distribution is not installed there already, plus the pinned ones (unsloth's own and the
versions its metadata asks for: trl <= 1.15, datasets < 5), which are always installed.
Prints the wheel paths, one per line (for ``pip install --no-index --no-deps --target``).

Usage: python3 tools/carried_wheels.py .unsloth .bnb
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

ALWAYS = {"unsloth", "unsloth-zoo", "trl", "datasets", "dill", "multiprocess", "bitsandbytes"}


def distribution(wheel: Path) -> str:
    """The normalised distribution name of a wheel file (PEP 503)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(folders: list[str]) -> None:
    for folder in folders:
        for wheel in sorted(Path(folder).glob("*.whl")):
            name = distribution(wheel)
            if name in ALWAYS or not installed(name):
                print(wheel)
            else:
                print(f"skip {wheel.name}: installed", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
