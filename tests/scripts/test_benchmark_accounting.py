"""scripts/benchmark_accounting.py answers --help without timing anything."""

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_accounting.py"


def _run_script(args: list[str], monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`python scripts/benchmark_accounting.py ARGS` run as __main__ in this process:
    (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    capsys.readouterr()
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_help_prints_the_usage_and_runs_no_benchmark(monkeypatch, capsys) -> None:
    code, out, err = _run_script(["--help"], monkeypatch, capsys)
    assert code == 0, err
    assert out.startswith("usage: benchmark_accounting.py") and " s " not in out
    assert "RDP" in out


def test_an_unknown_argument_is_refused(monkeypatch, capsys) -> None:
    code, _, err = _run_script(["--steps", "3"], monkeypatch, capsys)
    assert code == 2 and "unrecognized arguments" in err
