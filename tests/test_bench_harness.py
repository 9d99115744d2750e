"""Tests of the benchmark harness (fusetune.bench.harness) with a dummy op.

They run on the CPU in a few seconds; the one test that needs CUDA checks the do_bench and
memory path and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fusetune.bench import harness as bench_harness
from fusetune.bench.harness import Case, UnknownOpError, floor_ms, register, run_bench

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no registered cases and the real CASE_MODULES left untouched."""
    monkeypatch.setattr(bench_harness, "_REGISTRY", {})
    monkeypatch.setattr(bench_harness, "CASE_MODULES", dict(bench_harness.CASE_MODULES))


def _step(device: torch.device) -> Callable[[], torch.Tensor]:
    """A small forward+backward step that clears its gradients at the end, as closures must."""
    x = torch.randn(64, 32, device=device, requires_grad=True)
    w = torch.randn(32, 16, device=device, requires_grad=True)

    def run() -> torch.Tensor:
        loss = (x @ w).tanh().square().mean()
        loss.backward()
        x.grad = None
        w.grad = None
        return loss

    return run


def _broken() -> object:
    raise RuntimeError("boom: a peer's bug\nsecond line of detail")


def _make_dummy(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
    assert quick or device.type == "cuda", "the harness must force quick mode on the CPU"
    return {"fusetune": _step(device), "torch": _step(device), "broken": _broken}


def _dummy_case(name: str = "64x32x16", **kwargs: object) -> Case:
    defaults: dict[str, object] = {
        "floor_bytes": lambda quick: 64 * 32 * 4 * 2.0,
        "floor_flops": lambda quick: 2.0 * 64 * 32 * 16 * 3,
    }
    return Case(op="dummy", name=name, **{"make": _make_dummy, **defaults, **kwargs})


def _rows_by_provider(rows: list[dict]) -> dict[str, dict]:
    return {r["provider"]: r for r in rows}


def test_cpu_run_writes_rows_env_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    register(_dummy_case())
    out = tmp_path / "results_dir"  # does not exist yet: run_bench must create it

    rows = run_bench(["dummy"], quick=False, out_dir=out, device="cpu")

    data = json.loads((out / "results.json").read_text())
    assert set(data) == {"env", "ceilings", "rows"}
    assert data["rows"] == rows
    env = data["env"]
    for key in ("date", "gpu", "python", "versions", "device", "quick"):
        assert key in env
    assert env["gpu"] is None and env["quick"] is True  # CPU forces the quick smoke mode
    assert env["versions"]["torch"] and "liger_kernel" in env["versions"]
    assert data["ceilings"] == {"copy_bytes_per_s": None, "bf16_matmul_flops_per_s": None}

    by_provider = _rows_by_provider(rows)
    assert list(by_provider) == ["fusetune", "torch", "broken"]  # the order make() gave
    for provider in ("fusetune", "torch"):
        row = by_provider[provider]
        assert row["error"] is None
        assert row["time_ms"] > 0 and row["first_call_ms"] > 0
        assert row["peak_extra_gib"] is None  # no allocator statistics on the CPU
        assert row["floor_bytes"] == 64 * 32 * 4 * 2.0
        assert row["floor_ms"] is None and row["floor_fraction"] is None  # no ceilings on CPU
    assert (out / "results.png").exists() == HAS_MATPLOTLIB

    printed = capsys.readouterr().out
    assert "% floor" in printed and "env:" in printed and "ceilings:" in printed


def test_provider_error_is_recorded_not_raised(tmp_path: Path) -> None:
    register(_dummy_case())

    rows = run_bench(["dummy"], quick=True, out_dir=tmp_path, device="cpu")

    broken = _rows_by_provider(rows)["broken"]
    assert broken["error"] == "RuntimeError: boom: a peer's bug"  # first line only
    assert broken["time_ms"] is None
    # The providers after and before the failing one still ran.
    assert _rows_by_provider(rows)["torch"]["time_ms"] > 0


def test_make_error_and_gpu_only_and_floor_error_rows(tmp_path: Path) -> None:
    def failing_make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        raise MemoryError("inputs do not fit")

    register(Case(op="dummy", name="inputs too big", make=failing_make))
    register(_dummy_case("gpu only", gpu_only=True))
    register(_dummy_case("bad floor", floor_bytes=lambda quick: 1 / 0))

    rows = run_bench(["dummy"], quick=True, out_dir=tmp_path, device="cpu")

    by_case: dict[str, list[dict]] = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    (make_row,) = by_case["inputs too big"]
    assert make_row["provider"] == "(make)" and "inputs do not fit" in make_row["error"]
    (skip_row,) = by_case["gpu only"]
    assert skip_row["note"] == "skipped: gpu_only" and skip_row["error"] is None
    bad = _rows_by_provider(by_case["bad floor"])["torch"]
    assert bad["time_ms"] > 0 and "ZeroDivisionError" in bad["note"]


def test_providers_filter_orders_and_marks_missing(tmp_path: Path) -> None:
    register(_dummy_case())

    rows = run_bench(["dummy"], True, tmp_path, providers=["torch", "cce"], device="cpu")

    assert [(r["provider"], r["note"]) for r in rows] == [("cce", "not available"), ("torch", "")]
    assert rows[1]["time_ms"] > 0


def test_providers_filter_finds_a_labelled_provider(tmp_path: Path) -> None:
    labelled = "torch (guard lifted: timing only)"

    def make(device: torch.device, quick: bool) -> dict:
        return {labelled: dict(_make_dummy(device, quick))["torch"]}

    register(_dummy_case("labelled", make=make))

    rows = run_bench(["dummy"], True, tmp_path, providers=["torch"], device="cpu")

    assert [(r["provider"], r["note"]) for r in rows] == [(labelled, "")]
    assert rows[0]["time_ms"] > 0


def test_unknown_op_raises_listing_known_ops(tmp_path: Path) -> None:
    register(_dummy_case())

    with pytest.raises(UnknownOpError, match=r"'nope'.*known ops: .*cross_entropy.*dummy"):
        run_bench(["nope"], quick=True, out_dir=tmp_path, device="cpu")
    assert issubclass(UnknownOpError, ValueError)
    assert not (tmp_path / "results.json").exists()


def test_cases_module_is_imported_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = "fusetune_test_bench_dummy_cases"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import torch
            from fusetune.bench.harness import Case, register

            def make(device, quick):
                x = torch.randn(8, 8, device=device, requires_grad=True)
                def step():
                    (x * x).sum().backward()
                    x.grad = None
                return {"torch": step}

            register(Case(op="from_module", name="8x8", make=make))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench_harness.CASE_MODULES, "from_module", module)
    try:
        rows = run_bench(["from_module"], True, tmp_path / "out", device="cpu")
    finally:
        sys.modules.pop(module, None)

    assert [(r["op"], r["case"], r["provider"]) for r in rows] == [("from_module", "8x8", "torch")]
    assert rows[0]["error"] is None


def test_missing_cases_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        bench_harness.CASE_MODULES, "ghost", "fusetune.bench.cases_ghost_does_not_exist"
    )
    register(_dummy_case())

    # Asked for by name: a clear error.
    with pytest.raises(UnknownOpError, match=r"'ghost' has no cases.*cases_ghost_does_not_exist"):
        run_bench(["ghost"], quick=True, out_dir=tmp_path, device="cpu")
    # Part of "all ops": skipped, the other ops still run.
    monkeypatch.setattr(
        bench_harness, "CASE_MODULES", {"ghost": bench_harness.CASE_MODULES["ghost"]}
    )
    rows = run_bench(None, quick=True, out_dir=tmp_path, device="cpu")
    assert {r["op"] for r in rows} == {"dummy"}


def test_main_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # keep this test on the CPU
    register(_dummy_case())
    out = str(tmp_path / "out")

    assert bench_harness.main(["dummy", "--out", out, "--providers", "torch, broken"]) == 0
    data = json.loads((Path(out) / "results.json").read_text())
    assert [r["provider"] for r in data["rows"]] == ["torch", "broken"]

    assert bench_harness.main(["dummy", "--quick", "--out", out, "--providers", "fusetune"]) == 0

    def make_failing(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        return {"fusetune": _broken}

    register(Case(op="dummy", name="fusetune fails", make=make_failing))
    assert bench_harness.main(["dummy", "--out", out]) == 1  # our own provider failing is a failure

    assert bench_harness.main(["no_such_op", "--out", out]) == 2
    assert "known ops" in capsys.readouterr().err


def test_floor_ms_takes_the_larger_bound() -> None:
    ceilings = {"copy_bytes_per_s": 3e12, "bf16_matmul_flops_per_s": 800e12}
    assert floor_ms(3e9, None, ceilings) == pytest.approx(1.0)
    assert floor_ms(None, 8e12, ceilings) == pytest.approx(10.0)
    assert floor_ms(3e9, 8e12, ceilings) == pytest.approx(10.0)
    assert floor_ms(None, None, ceilings) is None
    assert floor_ms(3e9, 8e12, {"copy_bytes_per_s": None, "bf16_matmul_flops_per_s": None}) is None


def test_table_columns_line_up() -> None:
    rows = [
        {
            **bench_harness._row(_dummy_case(), "fusetune", torch.device("cpu"), True),
            "time_ms": 1.5,
        },
        {
            **bench_harness._row(
                _dummy_case("a much longer case name"), "torch", torch.device("cpu"), True
            ),
            "time_ms": 12.25,
            "error": "RuntimeError: " + "x" * 200,
        },
    ]
    lines = bench_harness.format_table(rows).splitlines()
    assert len(lines) == 4
    header, _, first, second = lines
    end = header.index("time ms") + len("time ms")
    assert first[:end].endswith("1.500") and second[:end].endswith("12.250")
    assert "ERROR RuntimeError" in second and second.endswith("...")


@pytest.fixture
def cuda_device() -> Iterator[torch.device]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    yield torch.device("cuda")
    torch.cuda.empty_cache()


def test_cuda_run_measures_time_memory_and_floor(tmp_path: Path, cuda_device: torch.device) -> None:
    def make_with_leak(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        x = torch.randn(8192, 2048, device=device, requires_grad=True)  # 64 MiB

        def keeps_grad() -> None:  # clears at the start: the harness must notice
            x.grad = None
            (x * 2).sum().backward()

        return {**_make_dummy(device, quick), "keeps_grad": keeps_grad}

    register(_dummy_case(make=make_with_leak))

    rows = run_bench(["dummy"], quick=True, out_dir=tmp_path, device=cuda_device)

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["env"]["gpu"]
    assert data["ceilings"]["copy_bytes_per_s"] > 1e11
    assert data["ceilings"]["bf16_matmul_flops_per_s"] > 1e13
    row = _rows_by_provider(rows)["torch"]
    assert row["error"] is None and row["time_ms"] > 0
    assert row["peak_extra_gib"] is not None and row["peak_extra_gib"] > 0
    assert row["retained_gib"] == 0 and row["note"] == ""
    leaky = _rows_by_provider(rows)["keeps_grad"]
    assert leaky["retained_gib"] * 1024 == pytest.approx(64, abs=1) and "grads" in leaky["note"]
    assert 0 < row["floor_fraction"] < 1.5
    assert _rows_by_provider(rows)["broken"]["error"].startswith("RuntimeError")


def test_kernel_kinds_of_a_profiled_step():
    """Names from an FSDP2 LoRA step's profile (2x H200): NCCL's kernels were counted as Triton."""
    from fusetune.bench.cases_e2e import kernel_kind

    names = {
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<8>)": "collective",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>": "pytorch",
        "_lora_glu_backward_kernel": "triton",
    }
    assert {name: kernel_kind(name) for name in names} == names


def test_fla_rows_keep_the_lifted_guard_label(monkeypatch):
    """Both Gated DeltaNet shapes ask for FLA; once the Triton guard is lifted for the first,
    the second row must still say that its results are not checked."""
    import types

    from fusetune.bench import cases_gated_delta_rule as cases

    chunk_o = types.SimpleNamespace(TRITON_ABOVE_3_7_1=False)
    rule = types.SimpleNamespace(chunk_gated_delta_rule=object())
    modules = {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
               "fla.ops.common": types.SimpleNamespace(chunk_o=chunk_o),
               "fla.ops.gated_delta_rule": rule}  # fmt: skip
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    names = [cases._fla_chunk()[0] for _ in range(2)]
    assert names == ["fla (Triton < 3.7.1 guard lifted: timing only)"] * 2
    assert chunk_o.TRITON_ABOVE_3_7_1 is True
