"""Benchmarks: ``python -m fusetune bench [OP ...]``.

Cases files (``fusetune.bench.cases_<op>``) build :class:`Case` objects and :func:`register`
them; :func:`run_bench` runs them and :func:`main` is the command line. See
:mod:`fusetune.bench.harness` for how timing, memory and floors are measured.
"""

from fusetune.bench.harness import Case, main, register, run_bench

__all__ = ["Case", "main", "register", "run_bench"]
