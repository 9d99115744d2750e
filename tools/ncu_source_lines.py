"""Nsight Compute's warp-stall samples of one Triton kernel, summed per source line.

ncu's source page (``--page source --csv --print-source sass``) lists every SASS instruction of
the profiled kernel with its stall samples, but a Triton kernel's lines only come back through
the cubin's line table. This joins the two: the SASS of ``CUBIN`` (disassembled with
``nvdisasm -g``, from Triton's wheel) gives each instruction its file and line, in the same
order as ncu's rows. The cubin must be the one profiled: take it from the Triton cache the
profiled process wrote (a fresh TRITON_CACHE_DIR, as docs/bench/session-2026-12-02-twentyninth/
call-03.sh does); a cubin of another specialisation does not line up, and the script says so.

    python tools/ncu_source_lines.py CUBIN SASS_CSV [--top 30]

Prints, per line (most samples first): its share of all samples, its top stall reasons and the
opcodes the samples fell on.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess

import triton

SAMPLES = "Warp Stall Sampling (All Samples)"


def sass_lines(cubin: str) -> list[tuple[str, str]]:
    """(file:line, opcode) of every instruction of the cubin, in address order."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    text = subprocess.run([tool, "-g", "-c", cubin], capture_output=True, text=True, check=True)
    where, out = "?", []
    for line in text.stdout.splitlines():
        found = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if found:
            where = f"{os.path.basename(found.group(1))}:{found.group(2)}"
            continue
        code = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if code:
            out.append((where, opcode(code.group(1))))
    return out


def opcode(instruction: str) -> str:
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def number(row: list[str], column: int) -> float:
    try:
        return float(row[column].replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cubin")
    parser.add_argument("sass_csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    rows = list(csv.reader(open(args.sass_csv)))
    header, body = rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    code = sass_lines(args.cubin)
    profiled = [opcode(row[column["Source"]]) if row[column["Source"]].split() else ""
                for row in body]  # fmt: skip
    if profiled != [op for _, op in code]:
        raise SystemExit(
            f"the cubin ({len(code)} instructions) is not the profiled kernel "
            f"({len(body)}): take the cubin from the profiled run's Triton cache"
        )
    stalls = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    per_line = collections.defaultdict(collections.Counter)
    ops = collections.defaultdict(collections.Counter)
    for (where, op), row in zip(code, body, strict=True):
        for name in stalls:
            per_line[where][name[6:]] += number(row, column[name])
        ops[where][op] += number(row, column[SAMPLES])
    total = sum(sum(c.values()) for c in per_line.values())
    ranked = sorted(per_line, key=lambda w: -sum(per_line[w].values()))
    for where in ranked[: args.top]:
        samples = sum(per_line[where].values())
        reasons = ", ".join(f"{name} {100 * n / samples:.0f}%"
                            for name, n in per_line[where].most_common(3))  # fmt: skip
        hot = ", ".join(op for op, _ in ops[where].most_common(3))
        print(f"{100 * samples / total:5.1f}%  {where:24s} {reasons:45s} {hot}")


if __name__ == "__main__":
    main()
