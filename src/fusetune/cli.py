"""``python -m fusetune COMMAND``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m fusetune", description=__doc__)
    parser.add_argument("command", choices=["bench"], help="bench: time ops next to their peers")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args, rest = parser.parse_known_args(argv[:1]), argv[1:]
    if args[0].command == "bench":
        from fusetune.bench import main as bench_main

        return bench_main(rest)
    return 2
