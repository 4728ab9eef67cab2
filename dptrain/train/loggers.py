"""Metric loggers: where a run's loss, accuracy and epsilon go while it trains.

Every logger has the same small interface (`MetricLogger`): `log(step, metrics)` with the logical
step and a flat dict of values, then `close()`. The training loop logs one record per epoch
(train loss and accuracy, the test / validation loss and accuracy when it evaluated, epsilon spent
so far, sigma, the sample rate, the clipping bound, the learning rate, the time) and one at the
end; a logger with `every_n_steps > 0` also gets `{"step_loss": ...}` every that many steps.
`MetricLoggers` splits each record into its public and private parts (Privacy, below).

    jsonl        metrics.jsonl in the run folder, one JSON object per record (the default);
                 the private part in private_metrics.jsonl
    tensorboard  TensorBoard event files in the run folder (`tensorboard --logdir outputs/`)
    csv          metrics.csv in the run folder, one row per record; private_metrics.csv
    wandb        Weights & Biases, offline by default (files under the run folder's wandb/)
    mlflow       MLflow, tracking into the run folder's mlruns/ by default (file:// URI)

The packages of the last three are optional: they are imported when the logger is created, before
anything is trained, and a missing one is a ConfigError naming the pip command. No logger makes a
network call unless its config names a server (wandb `mode: online`, an http mlflow URI).

Privacy: a record is split in two (`split_private`). Its public part holds what epsilon covers
or what is computed on data other than the private training file: epsilon, sigma, q, the clipping
bound, the learning rate, the test metrics, with the step, the epoch and the `final` marker
(`PUBLIC_KEYS`); every logger gets it through `log`. Its private part holds everything else: the
training loss and accuracy (per epoch, and per step), the validation metrics (examples held out
of the private training file) and the wall clock; none is covered by epsilon. A logger gets it
through `log_private` only when its `private_metrics` option is true: by default the loggers
that keep it in a file of its own (jsonl: `private_metrics.jsonl`; csv: `private_metrics.csv`,
each record marked `"private": true`), never by default the ones that mix it into one store that
is shared or uploaded whole (tensorboard, wandb, mlflow: under the `private/` prefix when asked).
The fraction of clipped samples is not logged at all.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import inspect
import io
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Union

from dptrain.checks import BOOLEAN, NON_NEGATIVE_INT
from dptrain.errors import ConfigError
from dptrain.io import JsonLines, atomic_write_bytes

MetricValue = Union[float, int, bool, None]
Metrics = Mapping[str, MetricValue]

METRICS_FILENAME = "metrics.jsonl"
PRIVATE_METRICS_FILENAME = "private_metrics.jsonl"
CSV_FILENAME = "metrics.csv"
PRIVATE_CSV_FILENAME = "private_metrics.csv"
MLRUNS_DIRNAME = "mlruns"
INSTALL_ALL = "pip install 'dptrain[loggers]'"
NOT_SCALARS = ("time", "final")   # record fields that are no curve (wall clock, end marker)
# Where a record belongs (the logical step is passed apart): in its public and its private part.
CONTEXT_KEYS = ("epoch", "final")
# The record keys a run may publish: epsilon and the mechanism's parameters (sigma, q, C), the
# learning rate (also "lr_0", "lr_1"...) and the metrics of the test split, which is not the
# private training data. Every other key is private: not covered by epsilon (see split_private).
PUBLIC_KEYS = frozenset({"epsilon", "noise_multiplier", "sample_rate", "max_grad_norm", "lr",
                         "test_loss", "test_accuracy", "test_perplexity"})
PRIVATE_PREFIX = "private/"   # the private metrics' names in TensorBoard, W&B and MLflow
# How the flat record keys are grouped in TensorBoard, W&B and MLflow ("section/name").
TAGS = {
    "train_loss": "train/loss", "train_accuracy": "train/accuracy", "step_loss": "train/step_loss",
    "test_loss": "test/loss", "test_accuracy": "test/accuracy", "test_perplexity": "test/perplexity",
    "val_loss": "val/loss", "val_accuracy": "val/accuracy", "val_perplexity": "val/perplexity",
    "epsilon": "privacy/epsilon", "noise_multiplier": "privacy/noise_multiplier",
    "sample_rate": "privacy/sample_rate", "max_grad_norm": "privacy/max_grad_norm",
}


def is_public(key: str) -> bool:
    """Whether a record key may be published: a context key or a value epsilon covers."""
    return key in CONTEXT_KEYS or key in PUBLIC_KEYS or key.startswith("lr_")


def split_private(metrics: Metrics) -> tuple[dict[str, MetricValue], dict[str, MetricValue]]:
    """(public, private) parts of a record (`is_public` decides; an unknown key is private).

    Both parts keep the context keys (epoch, final); the private part is {} when the record has
    no private value (a record of public values only)."""
    public = {k: v for k, v in metrics.items() if is_public(k)}
    private = {k: v for k, v in metrics.items() if k in CONTEXT_KEYS or not is_public(k)}
    return public, (private if any(k not in CONTEXT_KEYS for k in private) else {})


def tag(key: str) -> str:
    """The grouped name of a record key: "test_accuracy" -> "test/accuracy", "lr" -> "optim/lr",
    "private/train_loss" -> "private/train/loss"."""
    if key.startswith(PRIVATE_PREFIX):
        return PRIVATE_PREFIX + tag(key[len(PRIVATE_PREFIX):])
    if key in TAGS:
        return TAGS[key]
    return f"optim/{key}" if key == "lr" or key.startswith("lr_") else key


def scalars(metrics: Metrics) -> dict[str, float]:
    """The numeric values of a record as floats (None, booleans, time and final dropped)."""
    return {key: float(value) for key, value in metrics.items()
            if key.removeprefix(PRIVATE_PREFIX) not in NOT_SCALARS
            and isinstance(value, numbers.Real)
            and not isinstance(value, bool)}


def learning_rates(param_groups: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """{"lr": rate} when every parameter group has the same rate, else {"lr_0": ..., "lr_1": ...}."""
    rates = [float(group["lr"]) for group in param_groups if "lr" in group]
    if len(set(rates)) <= 1:
        return {"lr": rates[0]} if rates else {}
    return {f"lr_{i}": rate for i, rate in enumerate(rates)}


def require(module: str, logger: str, package: str | None = None) -> ModuleType:
    """Import `module` for `logger=<logger>`, or a ConfigError naming the pip install command."""
    package = package or module
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"logger={logger} needs the `{package}` package, which is not installed: run "
            f"`pip install {package}` (or `{INSTALL_ALL}` for every logger), or choose another "
            "logger (e.g. logger=jsonl). Nothing was trained.") from error


class MetricLogger(ABC):
    """A destination for a run's metrics.

    Subclasses implement `log`; `log_private` logs under `PRIVATE_PREFIX` through `log`, and
    `flush`, `resume_at`, `log_config` and `close` do nothing, unless overridden. A logger gets
    the private part of the records (`split_private`) only with `private_metrics`; it defaults to
    the class's `PRIVATE_BY_DEFAULT`. `every_n_steps` (0: never) asks for the per-step training
    loss as well, a private metric: it needs `private_metrics`.
    """

    name = "logger"
    PRIVATE_BY_DEFAULT = False

    def __init__(self, every_n_steps: int = 0, private_metrics: bool | None = None) -> None:
        self.every_n_steps = NON_NEGATIVE_INT.check(every_n_steps,
                                                    f"logger.{self.name}.every_n_steps")
        self.private_metrics = self.PRIVATE_BY_DEFAULT if private_metrics is None else \
            BOOLEAN.check(private_metrics, f"logger.{self.name}.private_metrics")
        if self.every_n_steps and not self.private_metrics:
            raise ConfigError(
                f"logger.{self.name}.every_n_steps={self.every_n_steps} asks for the training "
                "loss of every N-th step, a statistic of the private training data that is not "
                f"covered by epsilon, but logger.{self.name}.private_metrics is false: set "
                f"logger.{self.name}.private_metrics=true to send this logger the private "
                "metrics (they are then not safe to publish), or every_n_steps=0.")

    @abstractmethod
    def log(self, step: int, metrics: Metrics) -> None:
        """Record `metrics` (flat: key -> number, None where unknown) at logical step `step`."""

    def log_private(self, step: int, metrics: Metrics) -> None:
        """Record the private part of a record (`split_private`: the context keys and the values
        epsilon does not cover); by default through `log`, each name under `PRIVATE_PREFIX`."""
        self.log(step, {PRIVATE_PREFIX + key: value for key, value in metrics.items()
                        if key not in CONTEXT_KEYS})

    def flush(self) -> None:
        """Make what was logged so far visible to readers (called after each epoch's record)."""

    def resume_at(self, step: int) -> None:
        """A resumed run retakes the steps after `step`: forget what was logged after it."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's resolved config (hyperparameters), once before the first record."""

    def close(self) -> None:
        """Flush and release files or connections (the run is over)."""


PRIVATE_FIELD = "private"   # true in every record of a private metrics file


def private_record(metrics: Metrics) -> dict[str, MetricValue]:
    """The private part of a record as a private file writes it: marked `"private": true`."""
    return {PRIVATE_FIELD: True, **metrics}


class JsonlLogger(MetricLogger):
    """`metrics.jsonl`: one JSON object per record, `{"epoch", "step", ...}`, each line fsynced;
    the private part of the records in `private_metrics.jsonl`, each marked `"private": true`."""

    name = "jsonl"
    PRIVATE_BY_DEFAULT = True

    def __init__(self, run_dir: Path | str, every_n_steps: int = 0,
                 private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        self.lines = JsonLines(Path(run_dir) / METRICS_FILENAME)
        self.private_lines = JsonLines(Path(run_dir) / PRIVATE_METRICS_FILENAME)

    @staticmethod
    def _record(step: int, metrics: Metrics) -> dict[str, Any]:
        record: dict[str, Any] = {"epoch": metrics["epoch"]} if "epoch" in metrics else {}
        record["step"] = step
        record.update((k, v) for k, v in metrics.items() if k != "epoch")
        return record

    def log(self, step: int, metrics: Metrics) -> None:
        self.lines.append(self._record(step, metrics))

    def log_private(self, step: int, metrics: Metrics) -> None:
        self.private_lines.append(self._record(step, private_record(metrics)))

    def resume_at(self, step: int) -> None:
        for lines in (self.lines, self.private_lines):
            lines.keep(lambda record: record.get("step", math.inf) <= step)


class _CsvFile:
    """One CSV file of records: a header of every key seen so far, one row per record (empty: no
    value). A record with a key the header lacks rewrites the file with the wider header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._header: list[str] | None = None   # the file's header, read on first use

    def rows(self) -> tuple[list[str], list[dict[str, str]]]:
        """(header, rows) of the file as written so far (([], []) before the first record)."""
        if not self.path.exists():
            return [], []
        with open(self.path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            return list(reader.fieldnames or []), list(reader)

    def append(self, step: int, metrics: Metrics) -> None:
        row = {"step": step, **{k: ("" if v is None else v) for k, v in metrics.items()}}
        if self._header is None:
            self._header = self.rows()[0]
        if self._header and set(row) <= set(self._header):
            with open(self.path, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, fieldnames=self._header).writerow(row)
            return
        header, rows = self.rows()
        self._write(header + [k for k in row if k not in header], [*rows, row])

    def keep_until(self, step: int) -> None:
        """Drop the rows after logical step `step`."""
        header, rows = self.rows()
        if header:
            self._write(header, [r for r in rows if r.get("step") and int(r["step"]) <= step])

    def _write(self, header: list[str], rows: list[dict[str, Any]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(self.path, text.getvalue().encode("utf-8"))
        self._header = header


class CsvLogger(MetricLogger):
    """`metrics.csv`: a header of every key seen so far, one row per record (empty: no value);
    the private part of the records in `private_metrics.csv` (a `private` column, true)."""

    name = "csv"
    PRIVATE_BY_DEFAULT = True

    def __init__(self, run_dir: Path | str, every_n_steps: int = 0,
                 private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        self.file = _CsvFile(Path(run_dir) / CSV_FILENAME)
        self.private_file = _CsvFile(Path(run_dir) / PRIVATE_CSV_FILENAME)
        self.path = self.file.path

    def rows(self) -> tuple[list[str], list[dict[str, str]]]:
        """(header, rows) of metrics.csv as written so far (([], []) before the first record)."""
        return self.file.rows()

    def log(self, step: int, metrics: Metrics) -> None:
        self.file.append(step, metrics)

    def log_private(self, step: int, metrics: Metrics) -> None:
        self.private_file.append(step, private_record(metrics))

    def resume_at(self, step: int) -> None:
        self.file.keep_until(step)
        self.private_file.keep_until(step)


class TensorBoardLogger(MetricLogger):
    """TensorBoard event files (torch.utils.tensorboard) in the run folder, or in `log_dir`."""

    name = "tensorboard"

    def __init__(self, run_dir: Path | str, every_n_steps: int = 0,
                 log_dir: str | None = None, private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        require("tensorboard", self.name)
        self.log_dir = Path(log_dir) if log_dir else Path(run_dir)
        self._purge_step: int | None = None
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The SummaryWriter, opened on first use (so a run refused before training writes none)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
        return self._writer

    def log(self, step: int, metrics: Metrics) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(tag(key), value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def resume_at(self, step: int) -> None:
        self._purge_step = step + 1   # TensorBoard hides the older events from this step on

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger(MetricLogger):
    """Weights & Biases: offline by default (`wandb sync` uploads later), files in the run folder.

    `mode: online` (a network call, with the user's W&B login) only when configured.
    """

    name = "wandb"
    MODES = ("offline", "online", "disabled")

    def __init__(self, run_dir: Path | str, every_n_steps: int = 0, project: str = "dptrain",
                 entity: str | None = None, name: str | None = None,
                 mode: str = "offline", private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        if mode not in self.MODES:
            raise ConfigError(f"logger.wandb.mode={mode!r} cannot be used: choose one of "
                              f"{', '.join(self.MODES)} (offline writes locally; online uploads).")
        self._wandb = require("wandb", self.name)
        self.settings = {"project": project, "entity": entity, "name": name, "mode": mode,
                         "dir": str(run_dir)}
        self._config: dict[str, Any] = {}
        self._run: Any = None

    @property
    def run(self) -> Any:
        if self._run is None:
            self._run = self._wandb.init(config=self._config, **self.settings)
        return self._run

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)

    def log(self, step: int, metrics: Metrics) -> None:
        self.run.log({tag(k): v for k, v in scalars(metrics).items()}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowLogger(MetricLogger):
    """MLflow: a run in the experiment `experiment`, tracked into the run folder's mlruns/
    (a file:// URI) unless `tracking_uri` names another store."""

    name = "mlflow"

    def __init__(self, run_dir: Path | str, every_n_steps: int = 0,
                 tracking_uri: str | None = None, experiment: str = "dptrain",
                 run_name: str | None = None, private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        self._mlflow = require("mlflow", self.name)
        self.tracking_uri = tracking_uri or (Path(run_dir).resolve() / MLRUNS_DIRNAME).as_uri()
        self.experiment, self.run_name = experiment, run_name
        self._config: dict[str, Any] = {}
        self._client: Any = None
        self._run_id: str | None = None

    def _start(self) -> tuple[Any, str]:
        """(client, run id): the run is created on first use, with the config as its params."""
        if self._run_id is None:
            from dptrain.distributed.consistency import flatten  # torch: only with a run

            client = self._mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
            self._run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            self._client = client
            for key, value in flatten(self._config).items():
                client.log_param(self._run_id, key, str(value)[:250])
        return self._client, self._run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)

    def log(self, step: int, metrics: Metrics) -> None:
        client, run_id = self._start()
        for key, value in scalars(metrics).items():
            client.log_metric(run_id, tag(key), value, step=step)

    def close(self) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id)
            self._run_id = None


LOGGERS: dict[str, type[MetricLogger]] = {
    cls.name: cls for cls in (JsonlLogger, TensorBoardLogger, CsvLogger, WandbLogger, MlflowLogger)
}


def make_logger(name: str, run_dir: Path | str, options: Mapping[str, Any] | None = None
                ) -> MetricLogger:
    """The logger `name` (a key of LOGGERS) for `run_dir`, configured by `options`.

    Raises ConfigError for an unknown name or option, or a missing optional package.
    """
    cls = LOGGERS.get(name)
    if cls is None:
        raise ConfigError(f"logger={name} is not a known logger: choose from "
                          f"{', '.join(LOGGERS)} (several as a list, e.g. logger=[jsonl,tensorboard]).")
    options = dict(options or {})
    known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "run_dir")]
    for key in options:
        if key not in known:
            raise ConfigError(f"logger.{name}.{key} is not an option of the {name} logger: its "
                              f"options are {', '.join(known)}.")
    return cls(run_dir, **options)


def with_run_record(run_dir: Path | str, loggers: Sequence[MetricLogger]) -> list[MetricLogger]:
    """`loggers` with the run's own record in front: a JsonlLogger writing `run_dir`'s
    metrics.jsonl unless one is among them. Every run writes metrics.jsonl (what `dptrain
    report` and the resume read); the other loggers are extra destinations."""
    if any(isinstance(logger, JsonlLogger) for logger in loggers):
        return list(loggers)
    return [JsonlLogger(run_dir), *loggers]


def make_loggers(specs: Mapping[str, Mapping[str, Any] | None], run_dir: Path | str
                 ) -> list[MetricLogger]:
    """One logger per entry of `specs` ({name: options}, the `logger` config), in order."""
    return [make_logger(name, run_dir, options) for name, options in specs.items()]


def _send(logger: MetricLogger, step: int, metrics: Metrics) -> None:
    """A record to `logger`: its public part (when it has a value), and its private part when
    the logger takes private metrics."""
    public, private = split_private(metrics)
    if any(key not in CONTEXT_KEYS for key in public):
        logger.log(step, public)
    if private and logger.private_metrics:
        logger.log_private(step, private)


class MetricLoggers:
    """Every logger of a run behind one call; only the process that writes run files (rank 0 of
    a distributed run) logs."""

    def __init__(self, loggers: Iterable[MetricLogger]) -> None:
        self.loggers = list(loggers)

    @staticmethod
    def _writes() -> bool:
        from dptrain.distributed.runtime import is_main_process

        return is_main_process()

    def log(self, step: int, metrics: Metrics) -> None:
        """An epoch's (or the final) record, to every logger, flushed: its public part to each,
        its private part (`split_private`) to those with `private_metrics`."""
        if self._writes():
            for logger in self.loggers:
                _send(logger, step, metrics)
                logger.flush()

    def step_due(self, step: int) -> bool:
        """Whether some logger wants the per-step metrics of `step`."""
        return any(lg.every_n_steps and step % lg.every_n_steps == 0 for lg in self.loggers)

    def log_step(self, step: int, metrics: Metrics) -> None:
        """Per-step metrics, to the loggers whose `every_n_steps` divides `step` (split as
        `log` does)."""
        if self._writes():
            for logger in self.loggers:
                if logger.every_n_steps and step % logger.every_n_steps == 0:
                    _send(logger, step, metrics)

    def resume_at(self, step: int) -> None:
        if self._writes():
            for logger in self.loggers:
                logger.resume_at(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_config(config)

    def __enter__(self) -> MetricLoggers:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: Any) -> None:
        """Close every logger; a failure to close does not hide the error that ended the run."""
        if error_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Close every logger (all of them, even when one fails; its error is raised after)."""
        failure: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as error:  # noqa: BLE001 - re-raised once the others are closed
                failure = failure or error
        if failure is not None:
            raise failure
