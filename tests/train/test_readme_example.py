"""Every Python block of the README runs as written: the private run through dptrain.train
leaves a ledger, checkpoints and the model file, like a `dptrain` run folder; the others run,
and the epsilons the planning example quotes are the accountants' (the `dptrain` commands of
the README: tests/cli/test_readme_commands.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def readme_blocks(language: str) -> list[str]:
    """The README's code blocks in `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def readme_example() -> str:
    """The README's python block that trains through dptrain.train."""
    (example,) = [block for block in readme_blocks("python") if "from dptrain.train import" in block]
    return example


def run_python(code: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `code` as a script (`__name__ == "__main__"`) from `cwd`, in this process; what it
    raises fails the test."""
    monkeypatch.chdir(cwd)
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})


def test_the_readme_example_is_about_ten_lines() -> None:
    assert len([line for line in readme_example().splitlines() if line.strip()]) <= 11


def test_the_readme_example_writes_a_ledger_checkpoints_and_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_python(readme_example(), tmp_path, monkeypatch)
    run = tmp_path / "run"
    ledger = json.loads((run / "privacy_ledger.json").read_text(encoding="utf-8"))
    assert ledger["status"] == "completed" and ledger["private"]
    assert ledger["steps_completed"] == 2 * 23 and 0 < ledger["epsilon"] < 10
    assert (run / "checkpoints" / "last.pt").is_file() and (run / "model.pt").is_file()
    assert [c["path"] for c in ledger["checkpoints"]][-1] == "checkpoints/last.pt"


OTHER_BLOCKS = [block for block in readme_blocks("python") if block != readme_example()]


@pytest.mark.parametrize("block", OTHER_BLOCKS, ids=[b.splitlines()[-1][:40] for b in OTHER_BLOCKS])
def test_every_other_python_block_of_the_readme_runs_as_written(
        block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_python(block, tmp_path, monkeypatch)


def test_the_epsilons_the_planning_example_quotes_are_the_accountants() -> None:
    from dptrain.accounting import compute_epsilon

    (block,) = [b for b in readme_blocks("python") if "get_accountant" in b]
    quoted = re.search(r"get_epsilon\(1e-5\)\s+# ([0-9.]+) \(RDP: ([0-9.]+)\)", block)
    assert quoted, block
    for accountant, value in zip(("prv", "rdp"), quoted.groups()):
        epsilon = compute_epsilon([(1.1, 0.004, 10_000)], 1e-5, accountant)
        assert f"{epsilon:.2f}" == value, accountant
