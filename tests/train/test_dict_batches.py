"""Batches as mappings (issue 38): `{input_ids, attention_mask, labels}` batches through the
loop, its physical chunks, user level, evaluation and resume, and the job's loss step.

Each test is named after the property it guards; "before" is the code before this change (Hugging
Face inputs packed into one `[B, 2T]` tensor, `(x, y)` batches only, data/ importing models/).

| crossing                                     | test (here unless a path is given)               |
|----------------------------------------------|--------------------------------------------------|
| the loop x a dict batch, float64 per-sample  | ..._dict_batch_through_the_loop_clips_each_...   |
|   gradients against micro-batches            |   (hooks and ghost: the ghost-mode crossing)     |
| max_physical_batch_size x a dict batch       |   the same test, chunks of 3 of a batch of 12;   |
|                                              | ..._mapping_batch_is_cut_into_chunks_with_...    |
| user level x a dict batch                    | ..._user_level_dict_batch_clips_each_users_mean_ |
|                                              |   (hooks and ghost, chunks of 2)                 |
| resume of an HF run                          | ..._hf_run_killed_mid_epoch_resumes_to_the_...   |
| old ledgers x the text datasets' fingerprint | ..._text_fingerprint_is_that_of_the_packed_...   |
| DDP x a dict batch (2 gloo ranks)            | tests/distributed/test_dict_batches_ddp.py       |
| evaluation x a dict batch / a loss step      | ..._custom_loss_step_is_what_training_and_...    |
| a mapping whose tensors disagree on B        | ..._mapping_batch_with_a_tensor_of_another_...   |
| a loss step returning a batch mean           | ..._loss_step_returning_a_batch_mean_is_refused  |
| HFModel called with ids alone (no mask)      | ..._hf_model_refuses_ids_without_a_mask_...      |
| the packed [B, 2T] input of earlier versions | ..._packed_input_gives_the_dict_batchs_logits    |
| data/ never imports models/                  | ..._no_module_of_dptrain_data_imports_...        |
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, default_collate

import dptrain
from dptrain.batches import LABELS, rows
from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.base import ArrayDataset
from dptrain.data.datasets.text import TextDataset, pack_rows
from dptrain.data.fingerprint import data_fingerprint
from dptrain.data.virtual import split_batch
from dptrain.errors import ConfigError
from dptrain.losses import ModelLoss, StepLosses
from dptrain.train import TrainSettings, private_job, train
from tests.hf_tiny import review_rows, save_tiny, write_csv
from tests.train.test_trainer_support import Killed

pytestmark = pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning",
                                        "ignore:The mechanism is reproducible:UserWarning")

ROWS, MAX_LEN, C = 12, 12, 0.5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dict_batches")
    save_tiny(root / "bert", "bert", dropout=0.0)   # no dropout: micro-batches recompute it
    write_csv(root / "train.csv", review_rows(ROWS))
    return root


def _data(files: Path) -> TextDataset:
    splits = load_dataset("text", tokenizer=str(files / "bert"),
                          train_file=str(files / "train.csv"), text_column="review",
                          max_len=MAX_LEN)
    return splits.train


def _model(files: Path) -> nn.Module:
    from dptrain.models.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(str(files / "bert"), num_labels=2, dtype="float64")


def _settings(run_dir: Path, **overrides: Any) -> TrainSettings:
    values: dict[str, Any] = dict(run_dir=run_dir, epochs=1, batch_size=ROWS, max_steps=1,
                                  max_physical_batch_size=3, progress=False)
    values.update(overrides)
    return TrainSettings(**values)


def _one_step_sum(files: Path, run_dir: Path, mode: str, bound: float = C,
                  **private: Any) -> tuple[list, nn.Module]:
    """The noise-free clipped sum of one step of the loop at q = 1 (every example or user) over
    the text dataset's dict batches, per trainable parameter in model order; and the model as
    it was before the step."""
    chunk = private.pop("chunk", 3)
    model = _model(files)
    initial = copy.deepcopy(model)
    users = private.get("user_ids")
    batch = len(set(users)) if users is not None else ROWS
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(files), batch_size=batch), noise_multiplier=0.0,
        max_grad_norm=bound, grad_sample_mode=mode, **private)
    captured: list[torch.Tensor] = []
    optimizer.attach_step_hook(lambda opt: captured.extend(p.summed_grad.clone()
                                                           for p in opt.params))
    job = private_job(engine, module, optimizer, loader, dataset_name="reviews")
    result = train(job, _settings(run_dir, batch_size=batch, max_physical_batch_size=chunk))
    assert result.steps == 1 and captured
    return captured, initial


def _micro_batch_grads(model: nn.Module, data: TextDataset) -> list[torch.Tensor]:
    """Ground truth (float64): per trainable parameter, [N, *shape], each example's gradient of
    its own loss with the model run on that example alone (a batch of one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = []
    for i in range(len(data)):
        losses = ModelLoss()(model, default_collate([data[i]])).losses
        per_example.append(torch.autograd.grad(losses.sum(), params))
    return [torch.stack([g[k] for g in per_example]) for k in range(len(params))]


def _clipped_sum(grads: list[torch.Tensor], bound: float) -> list[torch.Tensor]:
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    factor = (bound / norms).clamp(max=1.0)
    return [torch.einsum("b,b...->...", factor, g) for g in grads]


# ----------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_dict_batch_through_the_loop_clips_each_examples_own_gradient(
        files: Path, tmp_path: Path, mode: str) -> None:
    grads = _micro_batch_grads(_model(files), _data(files))
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads)).sort().values
    bound = float(norms[5] + norms[6]) / 2     # half the examples clipped, half not
    summed, initial = _one_step_sum(files, tmp_path, mode, bound)
    for got, expected in zip(summed, _clipped_sum(grads, bound), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_user_level_dict_batch_clips_each_users_mean_gradient(
        files: Path, tmp_path: Path, mode: str) -> None:
    users = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 5, 5]
    summed, initial = _one_step_sum(files, tmp_path, mode, privacy_unit="user", user_ids=users,
                                    chunk=2)
    grads = _micro_batch_grads(initial, _data(files))
    groups = [[i for i, u in enumerate(users) if u == user] for user in sorted(set(users))]
    means = [torch.stack([g[rows_].mean(0) for rows_ in groups]) for g in grads]
    for got, expected in zip(summed, _clipped_sum(means, C), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)


def test_a_mapping_batch_is_cut_into_chunks_with_every_tensor_cut_alike() -> None:
    batch = {"input_ids": torch.arange(10).view(5, 2), "attention_mask": torch.ones(5, 2),
             LABELS: torch.arange(5)}
    chunks = split_batch(batch, 2)
    assert [rows(c) for c in chunks] == [2, 2, 1]
    assert torch.equal(torch.cat([c[LABELS] for c in chunks]), batch[LABELS])
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), batch["input_ids"])


def test_a_mapping_batch_with_a_tensor_of_another_leading_size_is_refused() -> None:
    batch = {"input_ids": torch.zeros(4, 3), "position_ids": torch.arange(3)[None],
             LABELS: torch.zeros(4)}
    with pytest.raises(ConfigError, match="'position_ids' has shape \\(1, 3\\).*4 examples"):
        split_batch(batch, 2)


# ----------------------------------------------------------------------------- the loss step
def test_a_custom_loss_step_is_what_training_and_evaluation_run(files: Path,
                                                                 tmp_path: Path) -> None:
    """A job's loss_step sees every physical chunk of training and every evaluation batch as the
    dataset's mapping, and its per-example losses are what the loop reports."""
    seen: list[tuple[bool, int]] = []

    def halved(model: nn.Module, batch: dict[str, torch.Tensor]) -> StepLosses:
        seen.append((torch.is_grad_enabled(), len(batch[LABELS])))
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return StepLosses(F.cross_entropy(out, batch[LABELS], reduction="none") / 2, out,
                          batch[LABELS])

    model = _model(files)
    engine = dptrain.PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(_data(files), batch_size=ROWS), noise_multiplier=1.0,
        max_grad_norm=C)   # q = 1: every example, in one logical batch
    test_loader = DataLoader(_data(files), batch_size=5)
    job = private_job(engine, module, optimizer, loader, test_loader=test_loader,
                      loss_step=halved)
    result = train(job, _settings(tmp_path, max_physical_batch_size=5))
    assert [n for grad, n in seen if grad] == [5, 5, 2]          # the chunks of the step
    assert [n for grad, n in seen if not grad] == [5, 5, 2]      # the test batches
    plain = private_job(engine, module, optimizer, loader, test_loader=test_loader)
    from dptrain.train.evaluation import score

    assert result.test_loss == pytest.approx(score(plain, test_loader).loss / 2, rel=1e-12)
    assert result.test_accuracy == score(plain, test_loader).accuracy


def test_a_loss_step_returning_a_batch_mean_is_refused(files: Path, tmp_path: Path) -> None:
    model = _model(files)
    engine = dptrain.PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(files), batch_size=ROWS), noise_multiplier=1.0,
        max_grad_norm=C)

    def mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != LABELS}
        return F.cross_entropy(model(**inputs), batch[LABELS])   # one number: not per example

    job = private_job(engine, module, optimizer, loader, loss_step=mean_loss)
    with pytest.raises(ConfigError, match="one loss per example, a Tensor\\[B\\]"):
        train(job, _settings(tmp_path))


# ----------------------------------------------------------------------------- the model
def test_the_hf_model_refuses_ids_without_a_mask_read_as_a_packed_input(files: Path) -> None:
    batch = default_collate([_data(files)[i] for i in range(3)])
    with pytest.raises(ConfigError, match="attention_mask=mask"):
        _model(files)(batch["input_ids"])


def test_the_packed_input_gives_the_dict_batchs_logits(files: Path) -> None:
    model = _model(files).eval()
    batch = default_collate([_data(files)[i] for i in range(4)])
    by_keyword = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    packed = model(pack_rows(batch["input_ids"], batch["attention_mask"]))
    assert torch.equal(by_keyword, packed)


# ----------------------------------------------------------------------------- resume
def test_the_text_fingerprint_is_that_of_the_packed_records_earlier_ledgers_hold(
        files: Path) -> None:
    """The stored records of a text dataset stay the packed int32 `[N, 2T]` rows (ids then
    mask) and labels that version 0.3's fingerprint hashed: the ledger of an earlier HF run
    keeps matching its data on resume."""
    from transformers import AutoTokenizer

    data = _data(files)
    tokenizer = AutoTokenizer.from_pretrained(str(files / "bert"))
    texts = [row["review"] for row in review_rows(ROWS)]
    encoded = tokenizer(texts, max_length=MAX_LEN, truncation=True, padding="max_length",
                        return_tensors="pt")
    stored = torch.cat([encoded["input_ids"], encoded["attention_mask"]], dim=1).to(torch.int32)
    labels = torch.tensor([row["label"] for row in review_rows(ROWS)])
    assert data_fingerprint(data) == data_fingerprint(ArrayDataset(stored, labels))
    assert isinstance(data[0], dict)          # while its items are mappings


def test_an_hf_run_killed_mid_epoch_resumes_to_the_uninterrupted_model(
        files: Path, tmp_path: Path) -> None:
    from dptrain.train.ledger import load_ledger

    def job(kill_at: int | None = None) -> Any:
        model = _model(files)
        engine = dptrain.PrivacyEngine(accountant="rdp", seed=5, reproducible_mechanism=True)
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(_data(files), batch_size=4), noise_multiplier=1.0,
            max_grad_norm=C)
        calls = {"n": 0}

        def loss_step(model: nn.Module, batch: Any) -> StepLosses:
            if torch.is_grad_enabled():
                calls["n"] += 1
                if calls["n"] == kill_at:
                    raise Killed
            return ModelLoss()(model, batch)

        return private_job(engine, module, optimizer, loader, loss_step=loss_step,
                           dataset_name="reviews")

    settings = dict(epochs=2, max_steps=None, max_physical_batch_size=None, batch_size=4)
    straight = job()
    train(straight, _settings(tmp_path / "a", **settings))
    with pytest.raises(Killed):
        train(job(kill_at=5), _settings(tmp_path / "b", **settings))   # in epoch 2 (3 a epoch)
    resumed = job()
    train(resumed, _settings(tmp_path / "b", resume="auto", **settings))
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    ledger = load_ledger(tmp_path / "b")
    assert ledger["history"] == load_ledger(tmp_path / "a")["history"]   # replayed, not charged
    assert ledger["dataset"]["fingerprints"] == load_ledger(tmp_path / "a")["dataset"]["fingerprints"]


# ----------------------------------------------------------------------------- layering
def test_no_module_of_dptrain_data_imports_dptrain_models() -> None:
    """data/ holds datasets and loaders only: before, the text datasets imported
    dptrain.models.hf (pack_inputs, load_tokenizer) and hf_config (TASKS)."""
    root = Path(dptrain.__file__).parent / "data"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n == "dptrain.models" or n.startswith("dptrain.models.")]
    assert offenders == []
