"""`dptrain hardware=ddp` re-launches itself under torchrun with the parent's Hydra config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dptrain_runner import read_json

TINY_RECIPE = """\
# @package _global_
defaults:
  - override /privacy: sigma
privacy:
  noise_multiplier: 0.75
train:
  epochs: 1
  max_steps: 1
  batch_size: 64
  eval_every: 0
  checkpoint_every: 0
  progress: false
"""


def test_a_recipe_from_the_users_config_dir_reaches_the_torchrun_workers(tmp_path: Path):
    (tmp_path / "myconf" / "recipe").mkdir(parents=True)
    (tmp_path / "myconf" / "recipe" / "tiny.yaml").write_text(TINY_RECIPE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "dptrain", "--config-dir", "myconf", "+recipe=tiny",
         "hardware=ddp", "hardware.nproc_per_node=2", "hardware.timeout_s=60",
         "hydra.run.dir=run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    assert ledger["history"] == [{"noise_multiplier": 0.75, "sample_rate": 64 / 1442, "steps": 1}]
    assert ledger["config"]["hardware"]["nproc_per_node"] == 2
