"""The CLI's build_job + train under hardware=fsdp on 2 forked gloo ranks (torchrun's variables
set by hand): the same batches, ledger and (near-noiseless) weights as one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ddp_workers as workers

COMMON = ("privacy=sigma", "privacy.noise_multiplier=1e-6", "privacy.reproducible_mechanism=true",
          "train.epochs=1", "train.progress=false", "train.batch_size=16", "train.max_steps=3",
          "train.checkpoint_every=0")
FSDP = ("hardware=fsdp", "hardware.timeout_s=60")
# One row per physical chunk: each rank's chunk count is its shard's size, which differs between
# the ranks in almost every step (evened out with empty chunks, else FSDP's gathers would hang).
CHUNKS = ("train.max_physical_batch_size=1",)
TRANSFORMER = ("model=transformer", "model.n_embd=16", "model.n_head=2", "dataset=imdb",
               "dataset.synthetic=true", "dataset.max_samples=64", "dataset.vocab_size=40",
               "dataset.max_len=8")


def _ledger(run_dir: Path) -> dict:
    return json.loads((run_dir / "privacy_ledger.json").read_text())


def _fsdp_runs(rank, world_size, port, runs):
    """cli_worker for each (run folder, overrides) of `runs` in turn."""
    return {"runs": [workers.cli_worker(rank, world_size, port, folder, (overrides,))["runs"][0]
                     for folder, overrides in runs]}


@pytest.fixture(scope="module")
def transformer_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp_cli")
    single = workers.train_cli(str(root / "single"), COMMON + TRANSFORMER + ("hardware=cpu",))
    torch.save(single, root / "single.pt")
    ranks = workers.run_ranks(_fsdp_runs, root, timeout_s=240, args=((
        (str(root / "fsdp_{rank}"), COMMON + TRANSFORMER + FSDP + CHUNKS),
        (str(root / "bf16_{rank}"), COMMON + TRANSFORMER + FSDP + ("hardware.precision=bf16",))),))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    torch.save(ranks, root / "ranks.pt")
    return root


def test_a_sharded_transformer_run_trains_the_single_process_weights(transformer_runs: Path):
    single = torch.load(transformer_runs / "single.pt", weights_only=False)
    for rank in torch.load(transformer_runs / "ranks.pt", weights_only=False):
        torch.testing.assert_close(rank["runs"][0]["params"], single["params"], rtol=0, atol=1e-4)


def test_a_sharded_bf16_run_keeps_float32_weights_close_to_the_float32_run(transformer_runs: Path):
    single = torch.load(transformer_runs / "single.pt", weights_only=False)
    for rank in torch.load(transformer_runs / "ranks.pt", weights_only=False):
        bf16 = rank["runs"][1]
        assert bf16["status"] == "completed" and bf16["params"].dtype == torch.float32
        torch.testing.assert_close(bf16["params"], single["params"], rtol=0, atol=5e-2)


def test_the_ledger_of_a_sharded_run_equals_the_single_process_ledger(transformer_runs: Path):
    single, sharded = _ledger(transformer_runs / "single"), _ledger(transformer_runs / "fsdp_0")
    for key in ("history", "epsilon", "steps_completed", "status"):
        assert sharded[key] == single[key], key


RESUMABLE = tuple(o for o in COMMON if not o.startswith(("train.max_steps", "train.checkpoint"))) \
    + TRANSFORMER + ("optimizer=sgd",)


@pytest.fixture(scope="module", params=["optimizer.momentum=0.9", "optimizer.momentum=0.0"])
def resumed(tmp_path_factory, request) -> Path:
    """4 steps on one process; 2 steps at 2 ranks resumed to 4 on one process; 2 steps on one
    process resumed to 4 at 2 ranks: SGD with momentum (its state crosses too) and plain SGD (the
    default: no state at all, which torch's sharded loader once refused); not Adam, whose update
    turns the differing tiny noise of coordinates without gradient into steps of size lr (its
    resume: test_every_configured_optimizer_resumes_a_two_rank_run_where_it_would_have_ended)."""
    root = tmp_path_factory.mktemp("fsdp_resume")
    single = RESUMABLE + (request.param, "hardware=cpu")
    sharded = RESUMABLE + (request.param,) + FSDP
    results = {"straight": workers.train_cli(str(root / "straight"), single + ("train.max_steps=4",))}
    workers.train_cli(str(root / "one_then_two"), single + ("train.max_steps=2",))
    ranks = workers.run_ranks(_fsdp_runs, root, timeout_s=240, args=((
        (str(root / "two_then_one"), sharded + ("train.max_steps=2",)),
        (str(root / "one_then_two"), sharded + ("train.max_steps=4", "train.resume=auto"))),))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    results["one_then_two"] = ranks[0]["runs"][1]
    results["two_then_one"] = workers.train_cli(str(root / "two_then_one"),
                                                single + ("train.max_steps=4", "train.resume=auto"))
    torch.save(results, root / "results.pt")
    return root


@pytest.mark.parametrize("run", ["two_then_one", "one_then_two"])
def test_a_run_checkpointed_at_one_number_of_ranks_resumes_at_another(resumed: Path, run: str):
    results = torch.load(resumed / "results.pt", weights_only=False)
    assert results[run]["steps"] == 4
    torch.testing.assert_close(results[run]["params"], results["straight"]["params"],
                               rtol=0, atol=1e-4)
    assert _ledger(resumed / run)["history"] == _ledger(resumed / "straight")["history"]


def _two_rank_runs(rank, world_size, port, root, runs):
    """cli_worker for each (folder under root, overrides) of `runs` in turn, on every rank."""
    return {"runs": [workers.cli_worker(rank, world_size, port, f"{root}/{folder}", (overrides,))["runs"][0]
                     for folder, overrides in runs]}


@pytest.mark.parametrize("hardware", [FSDP, ("hardware=ddp", "hardware.timeout_s=60")],
                         ids=["fsdp", "ddp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_every_configured_optimizer_resumes_a_two_rank_run_where_it_would_have_ended(
        tmp_path, optimizer: str, hardware: tuple[str, ...]):
    """Every optimizer of conf/optimizer/ (SGD's default momentum 0 keeps no state at all),
    stopped after 2 steps at 2 ranks and resumed to 4, ends with the uninterrupted run's weights
    and history."""
    args = tuple(o for o in COMMON if not o.startswith(("train.max_steps", "train.checkpoint"))) \
        + TRANSFORMER + (f"optimizer={optimizer}",) + hardware
    ranks = workers.run_ranks(_two_rank_runs, tmp_path, timeout_s=240, args=(str(tmp_path), (
        ("straight", args + ("train.max_steps=4",)),
        ("resumed", args + ("train.max_steps=2",)),
        ("resumed", args + ("train.max_steps=4", "train.resume=auto")))))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
        straight, resumed = result["runs"][0], result["runs"][2]
        assert resumed["status"] == "completed" and resumed["steps"] == 4
        torch.testing.assert_close(resumed["params"], straight["params"], rtol=0, atol=1e-6)
    assert _ledger(tmp_path / "resumed")["history"] == _ledger(tmp_path / "straight")["history"]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> Path:
    """A tiny GPT-2 (model=hf, tied embeddings, ghost mode) fine-tuned on one process and sharded
    over 2 ranks (one unit per GPT2Block), in one-row chunks: the rank with fewer runs padding
    passes (a Hugging Face model cannot run a batch of 0 rows)."""
    hf_tiny = pytest.importorskip("tests.hf_tiny")
    root = tmp_path_factory.mktemp("fsdp_hf")
    hf_tiny.save_tiny(root / "gpt2", "gpt2", dropout=0.0)
    hf_tiny.write_csv(root / "e2e.csv", hf_tiny.e2e_rows(32))
    args = tuple(o for o in COMMON if not o.startswith("train.batch_size")) + (
        "model=hf", f"model.name_or_path={root / 'gpt2'}", "model.task=causal_lm",
        'model.pad_token="<|endoftext|>"', "dataset=text", f"dataset.train_file={root / 'e2e.csv'}",
        "dataset.text_column=ref", "dataset.prompt_column=mr", "dataset.label_column=null",
        "dataset.max_len=16", "train.batch_size=8", "privacy.grad_sample_mode=ghost",
        "optimizer=sgd", "optimizer.lr=0.5")  # not model=hf's AdamW: its update turns the ranks'
    # other (tiny) noise on coordinates without gradient into steps of size lr
    torch.save(workers.train_cli(str(root / "single"), args + ("hardware=cpu",)), root / "single.pt")
    ranks = workers.run_ranks(workers.cli_worker, root, timeout_s=240,
                              args=(str(root / "fsdp_{rank}"), (args + FSDP + CHUNKS,)))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    torch.save(ranks, root / "ranks.pt")
    return root


def test_a_sharded_hugging_face_gpt2_run_trains_the_single_process_weights(hf_runs: Path):
    single = torch.load(hf_runs / "single.pt", weights_only=False)
    for rank in torch.load(hf_runs / "ranks.pt", weights_only=False):
        torch.testing.assert_close(rank["runs"][0]["params"], single["params"], rtol=0, atol=1e-4)
    assert _ledger(hf_runs / "fsdp_0")["history"] == _ledger(hf_runs / "single")["history"]


@pytest.fixture(scope="module")
def pooled_runs(tmp_path_factory) -> Path:
    """A tiny sentence-transformers BERT (model=hf reads it through its mean pooling:
    dptrain.models.hf_pooling.PooledClassifier; no dropout) fine-tuned on one process and sharded
    over 2 ranks (one unit per BertEmbeddings and BertLayer), in one-row chunks, with hooks and
    with ghost clipping. Each unit ends in a LayerNorm whose output is the unit's output."""
    hf_tiny = pytest.importorskip("tests.hf_tiny")
    root = tmp_path_factory.mktemp("fsdp_pooled")
    hf_tiny.save_sentence_transformer(root / "sentence")
    hf_tiny.write_csv(root / "reviews.csv", hf_tiny.review_rows(32))
    args = tuple(o for o in COMMON if not o.startswith("train.batch_size")) + (
        "model=hf", f"model.name_or_path={root / 'sentence'}", "dataset=text",
        f"dataset.train_file={root / 'reviews.csv'}", "dataset.text_column=review",
        "dataset.max_len=16", "train.batch_size=8", "optimizer=sgd", "optimizer.lr=0.5",
        "optimizer.head_lr=null",
        "model.zero_init_head=false")  # a random head: the body gets gradient from step one
    modes = {mode: args + (f"privacy.grad_sample_mode={mode}",) for mode in ("hooks", "ghost")}
    for mode, mode_args in modes.items():
        torch.save(workers.train_cli(str(root / f"single_{mode}"), mode_args + ("hardware=cpu",)),
                   root / f"single_{mode}.pt")
    ranks = workers.run_ranks(_fsdp_runs, root, timeout_s=240, args=(tuple(
        (str(root / f"fsdp_{mode}_{{rank}}"), mode_args + FSDP + CHUNKS)
        for mode, mode_args in modes.items()),))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    torch.save(ranks, root / "ranks.pt")
    return root


@pytest.mark.parametrize("index, mode", [(0, "hooks"), (1, "ghost")])
def test_a_sharded_bert_whose_units_end_in_a_layer_norm_trains_the_single_process_weights(
        pooled_runs: Path, index: int, mode: str):
    """The hooks of a layer whose output is its unit's output run after FSDP's pre-backward
    hook has gathered the unit's parameters (they were keyed by the sharded ones: hooks mode
    refused the run, ghost mode trained other weights)."""
    single = torch.load(pooled_runs / f"single_{mode}.pt", weights_only=False)
    for rank in torch.load(pooled_runs / "ranks.pt", weights_only=False):
        torch.testing.assert_close(rank["runs"][index]["params"], single["params"], rtol=0, atol=1e-4)
        assert rank["runs"][index]["history"] == single["history"]


@pytest.mark.slow
def test_dptrain_hardware_fsdp_relaunches_itself_under_torchrun_like_ddp(tmp_path: Path):
    """The real command: `dptrain hardware=fsdp hardware.nproc_per_node=2` starts torchrun."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = ["privacy=sigma", "privacy.noise_multiplier=1.0", "train.epochs=1", "train.max_steps=2",
            "train.progress=false"]
    run = subprocess.run([sys.executable, "-c", "from dptrain.cli.main import main; main()",
                          "hardware=fsdp", "hardware.nproc_per_node=2", *args,
                          f"hydra.run.dir={tmp_path / 'fsdp'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "fsdp" / "result.json").read_text())["status"] == "completed"
    assert _ledger(tmp_path / "fsdp")["steps_completed"] == 2
    assert (tmp_path / "fsdp" / "model.pt").exists()


def test_a_sharded_shuffled_run_trains_the_single_process_batches(tmp_path):
    """privacy.sampling=shuffle under FSDP2 (2 ranks): every rank draws rank 0's permutation
    and trains on its share of each batch, so the weights (reproducible, near-noiseless) and the
    ledger's history and epsilon are the single process's."""
    args = COMMON + TRANSFORMER + ("privacy.sampling=shuffle",)
    single = workers.train_cli(str(tmp_path / "single"), args + ("hardware=cpu",))
    ranks = workers.run_ranks(_fsdp_runs, tmp_path, timeout_s=240, args=((
        (str(tmp_path / "fsdp_{rank}"), args + FSDP),),))
    for rank in ranks:
        assert "crash" not in rank, rank.get("crash")
        torch.testing.assert_close(rank["runs"][0]["params"], single["params"], rtol=0, atol=1e-4)
    sharded, one = _ledger(tmp_path / "fsdp_0"), _ledger(tmp_path / "single")
    assert sharded["mechanism"]["sampling"] == "shuffle"
    assert (sharded["history"], sharded["epsilon"]) == (one["history"], one["epsilon"])
