"""Dict batches under DDP (issue 38, the DDP crossing of tests/train/test_dict_batches.py): a
Hugging Face classifier fine-tuned on a text dataset, whose batches are `{input_ids,
attention_mask, labels}` mappings, through the command's build_job + train on 2 forked gloo
ranks equals the same run in one process with the same seed (the same global Poisson batches,
cut into rank shards and physical chunks, and the same noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ddp_workers as workers
from tests.hf_tiny import review_rows, save_tiny, write_csv

pytestmark = pytest.mark.filterwarnings("ignore:The mechanism is reproducible:UserWarning")


def _overrides(files: Path) -> tuple[str, ...]:
    return ("model=hf", f"model.name_or_path={files / 'bert'}", "model.dtype=float64",
            "dataset=text", f"dataset.train_file={files / 'train.csv'}",
            f"dataset.test_file={files / 'train.csv'}", "dataset.text_column=review",
            "dataset.label_column=label", "dataset.max_len=12", "privacy=sigma",
            "privacy.noise_multiplier=1.0", "privacy.reproducible_mechanism=true",
            "train.epochs=1", "train.max_steps=3", "train.batch_size=8",
            "train.max_physical_batch_size=3", "train.progress=false")


def test_a_ddp_run_over_dict_batches_equals_the_single_process_run(tmp_path: Path) -> None:
    save_tiny(tmp_path / "bert", "bert", dropout=0.0)
    write_csv(tmp_path / "train.csv", review_rows(24))
    overrides = _overrides(tmp_path)
    single = workers.train_cli(str(tmp_path / "single"), overrides + ("hardware=cpu",))
    (tmp_path / "ranks_out").mkdir()
    ranks = workers.run_ranks(workers.cli_worker, tmp_path / "ranks_out",
                              args=(str(tmp_path / "ddp"),
                                    (overrides + ("hardware=ddp", "hardware.timeout_s=60"),)),
                              timeout_s=240.0)
    for rank in ranks:
        assert "crash" not in rank, rank.get("crash")
        run = rank["runs"][0]
        assert run["status"] == "completed" and run["steps"] == 3
        torch.testing.assert_close(run["params"], single["params"], rtol=0, atol=1e-9)
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text())
               for d in ("single", "ddp")]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["dataset"]["fingerprints"] == ledgers[1]["dataset"]["fingerprints"]
