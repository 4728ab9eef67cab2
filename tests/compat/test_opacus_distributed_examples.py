"""Opacus's distributed tutorial and example run on dptrain.opacus as Opacus runs them: several
processes started by their own `torch.multiprocessing.spawn`, on CPU with the gloo backend, 2
ranks, and the same files with their imports put back run on Opacus.

* tutorials/ddp_tutorial.ipynb, vendored as its code cells in opacus_tutorials/ddp_tutorial.py:
  each `%%writefile [-a] F` cell is written to F and each `!python -W ignore F` cell runs F, as in
  the notebook. Changed beyond the imports (each line marked `# was ...` in the vendored file):
  MNIST -> torchvision's FakeData of MNIST's shape (400 training and 200 test images), 2 processes
  instead of torch.cuda.device_count(), and the device "cpu" instead of the rank (cuda:rank).
* examples/fsdp_example.py, vendored in opacus_examples/fsdp_example.py with the same changes.

To read what the scripts compute, the harness (not the vendored files) adds one cell before each
script's `if __name__ == '__main__':` block (see HARNESS_CELL): it logs INFO to stderr (the
tutorial's logger.info lines; Opacus configures logging on import, dptrain does not) and records
every epsilon the PrivacyEngine reports, per rank. It also replaces the fixed MASTER_PORT 12355
with a free port (tests may run next to other distributed jobs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.ddp_workers import free_port

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

HARNESS_CELL = '''
# --- test harness (not in the tutorial): log INFO, record each epsilon the engine reports ---
import logging as _harness_logging
_harness_logging.basicConfig(level=_harness_logging.INFO, format="%(message)s", force=True)
if "PrivacyEngine" in globals():
    class PrivacyEngine(PrivacyEngine):
        def get_epsilon(self, *args, **kwargs):
            epsilon = super().get_epsilon(*args, **kwargs)
            import torch.distributed as _dist
            with open(f"epsilons_rank{_dist.get_rank()}.txt", "a") as _file:
                _file.write(f"{float(epsilon)!r}\\n")
            return epsilon
'''
MAIN_BLOCK = re.compile(r"^if __name__ == ['\"]__main__['\"]:", re.MULTILINE)


def _for_package(source: str, package: str) -> str:
    """`source` importing from `package`: "dptrain.opacus" as vendored, or "opacus"."""
    return source if package == "dptrain.opacus" else source.replace("from dptrain.opacus",
                                                                     "from opacus")


def _prepare(script: str, port: int) -> str:
    """The script as the harness runs it: HARNESS_CELL before its main block, a free port."""
    script = script.replace("'12355'", f"'{port}'").replace('"12355"', f'"{port}"')
    return MAIN_BLOCK.sub(lambda m: HARNESS_CELL + "\n" + m.group(0), script, count=1)


def _run_script(folder: Path, name: str) -> subprocess.CompletedProcess:
    """`python -W ignore name` in `folder` (this checkout's dptrain first on the path)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    done = subprocess.run([sys.executable, "-W", "ignore", name], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    return done


def run_notebook(package: str, folder: Path, script: str) -> str:
    """The DDP tutorial's `%%writefile` cells on `package` in `folder` up to the `!python` cell
    that runs `script`, then that cell (the scripts are independent: the earlier ones are not
    run); the script's stdout and stderr."""
    folder.mkdir(parents=True)
    source = _for_package((HERE / "opacus_tutorials" / "ddp_tutorial.py").read_text(), package)
    for cell in source.split("# %%\n")[1:]:
        first, _, body = cell.partition("\n")
        if written := re.match(r"# %%writefile( -a)? (\S+)$", first):
            path = folder / written.group(2)
            path.write_text((path.read_text() if written.group(1) else "") + body + "\n")
        elif (ran := re.match(r"# !python -W ignore (\S+)$", first)) and ran.group(1) == script:
            path = folder / script
            path.write_text(_prepare(path.read_text(), free_port()))
            done = _run_script(folder, script)
            return done.stdout + done.stderr
    raise AssertionError(f"no cell runs {script}")


def epsilons(folder: Path) -> dict[int, list[float]]:
    """{rank: the epsilons its PrivacyEngine reported, in order} (HARNESS_CELL's files)."""
    return {rank: [float(line) for line in (folder / f"epsilons_rank{rank}.txt").read_text().split()]
            for rank in (0, 1)}


@pytest.mark.slow  # 3.5 to 5.5 minutes on a shared 2-core machine (2 runs of 2 spawned ranks, 10 epochs)
def test_ddp_tutorial_trains_and_reports_opacus_epsilon_on_every_rank(tmp_path):
    outputs = {package: run_notebook(package, tmp_path / package, "opacus_ddp_demo.py")
               for package in ("dptrain.opacus", "opacus")}
    ours, theirs = epsilons(tmp_path / "dptrain.opacus"), epsilons(tmp_path / "opacus")
    assert len(theirs[0]) == 10 and theirs[0][-1] > 0  # one epsilon per epoch
    assert ours[0] == ours[1]
    assert ours[0] == pytest.approx(theirs[0], rel=1e-3)
    for package, output in outputs.items():
        assert output.count("Epoch: ") == 10, package  # rank 0 prints
    # optimizer.expected_batch_size: Opacus's is one rank's (200 / 2), dptrain's the global 200
    assert "(rank 1) Average batch size per GPU: 100" in outputs["opacus"]
    assert "(rank 1) Average batch size per GPU: 200" in outputs["dptrain.opacus"]


def _loader_lines(output: str) -> dict[str, str]:
    """{"Non-distributed" / "Distributed, non-private" / "Distributed, private": the rest of
    rank 0's log line} of the tutorial's data-loader chapter."""
    found = re.findall(r"^\(rank 0\) (Non-distributed|Distributed, non-private|Distributed, "
                       r"private)[^.]*\. (.*)$", output, re.MULTILINE)
    return dict(found)


@pytest.mark.slow  # about 2 minutes (2 runs of 2 spawned ranks)
def test_ddp_tutorial_private_loader_has_opacus_batches_and_dptrain_sample_rate(tmp_path):
    ours, theirs = (_loader_lines(run_notebook(package, tmp_path / package,
                                               "opacus_distributed_data_loader_demo.py"))
                    for package in ("dptrain.opacus", "opacus"))
    assert ours["Non-distributed"] == theirs["Non-distributed"]
    assert ours["Distributed, non-private"] == theirs["Distributed, non-private"]
    assert "#batches: 7," in theirs["Distributed, private"]  # 400 images, batch 64
    assert "#batches: 7," in ours["Distributed, private"]
    # Opacus: q = 1 / len(loader) = 1/7 and num_samples = this rank's 200; dptrain: q = 64 / 400
    # and num_samples = the whole dataset's 400 (docs/migrating-from-opacus.md)
    assert "#data points: 200, sample_rate: 0.142857" in theirs["Distributed, private"]
    assert "#data points: 400, sample_rate: 0.160000" in ours["Distributed, private"]


def _gradient_samples(output: str) -> dict[tuple[int, str], list[float]]:
    """{(rank, "before" / "after"): the first 3 gradient entries the sync chapter logs}."""
    found = re.findall(r"^\(rank=(\d)\) Gradient sample (before|after) optimizer\.step\(\): "
                       r"\[([^\]]*)\]$", output, re.MULTILINE)
    return {(int(rank), when): [float(x) for x in values.split()] for rank, when, values in found}


@pytest.mark.slow  # about 2 minutes (2 runs of 2 spawned ranks)
def test_ddp_tutorial_sync_chapter_averages_the_ranks_gradients_at_the_step(tmp_path):
    for package in ("dptrain.opacus", "opacus"):
        grads = _gradient_samples(run_notebook(package, tmp_path / package,
                                               "opacus_sync_demo.py"))
        assert grads[0, "after"] == grads[1, "after"], package  # one synchronised gradient
        # "before" is the rank's own sum / optimizer.expected_batch_size: Opacus's per-rank
        # B = 32, so the step's (sum_0 + sum_1) / 64 is their mean; dptrain's expected batch
        # is the global 64, so it is their sum
        combined = [a + b for a, b in zip(grads[0, "before"], grads[1, "before"])]
        expected = combined if package == "dptrain.opacus" else [x / 2 for x in combined]
        assert grads[0, "after"] == pytest.approx(expected, rel=1e-4, abs=1e-9), package


def run_fsdp_example(package: str, folder: Path) -> str:
    """examples/fsdp_example.py (opacus_examples/) on `package`, run as `python -W ignore` in
    `folder` (it spawns its 2 ranks itself); its stdout and stderr."""
    folder.mkdir(parents=True)
    source = _for_package((HERE / "opacus_examples" / "fsdp_example.py").read_text(), package)
    (folder / "fsdp_example.py").write_text(_prepare(source, free_port()))
    done = _run_script(folder, "fsdp_example.py")
    return done.stdout + done.stderr


@pytest.mark.slow  # 3.5 minutes on a shared 2-core machine (2 runs of 2 spawned ranks, 10 epochs)
def test_fsdp_example_trains_sharded_with_ghost_clipping_and_reports_opacus_epsilon(tmp_path):
    outputs = {package: run_fsdp_example(package, tmp_path / package)
               for package in ("dptrain.opacus", "opacus")}
    ours, theirs = epsilons(tmp_path / "dptrain.opacus"), epsilons(tmp_path / "opacus")
    assert len(theirs[0]) == 10 and theirs[0][-1] > 0  # one epsilon per epoch
    assert ours[0] == ours[1]
    assert ours[0] == pytest.approx(theirs[0], rel=1e-3)
    assert outputs["dptrain.opacus"].count("Epoch: ") == 10
    # dptrain's fully sharded DP-SGD ran: the ghost-clipping module over the FSDP2 model
    assert ("After privatization: model (ShardedPerSampleModule), optimizer (ShardedDPOptimizer)"
            in outputs["dptrain.opacus"])
