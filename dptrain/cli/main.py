"""The `dptrain` command: compose the Hydra config, build the job, train, report.

    dptrain                                   # digits + digits_mlp at epsilon 3 (the default)
    dptrain +recipe=mnist_cnn dataset.download=true
    dptrain -m privacy=sigma privacy.noise_multiplier=0.5,1.0   # a sweep, summary at its root
    dptrain logger=[jsonl,tensorboard]        # metrics.jsonl and TensorBoard event files
    dptrain report PATH                       # plot a run folder or a sweep folder
    dptrain tune --poisson 4 optimizer.lr=0.05,0.1   # a random number of trials (cli/tune.py)

Configs ship inside the package (`pkg://dptrain.conf`), so the command works from any directory
after a plain `pip install .`. Bad input (a dptrain.errors exception, or an OmegaConf/Hydra config
error) stops before training with a one-paragraph message naming the key and the fix and a
non-zero exit status (2); `-v`/`--verbose` or HYDRA_FULL_ERROR=1 shows the traceback instead.
When Hydra itself rejects the command line (a value of the wrong type for its typed schema, a
misspelt group, option or key), its multi-line block is replaced by one paragraph with the close
matches (dptrain.cli.suggest.explain). Every job writes its RunResult to `result.json` in its run
folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import dptrain.cli.resolvers  # noqa: F401  (the configs' ${dptrain.*:...} resolvers)
from dptrain.cli.overrides import choose_sigma_option, open_mapping_keys
from dptrain.errors import DPTrainError, RunFolderBusyError, WriteError
from dptrain.formatting import format_epsilon

if TYPE_CHECKING:  # torch-free import, so that `dptrain --help` starts fast
    from dptrain.train.job import RunResult

VERBOSE_FLAGS = ("-v", "--verbose")
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"   # the user's way to ask for tracebacks, as in any Hydra app
VERBOSE_ENV = "DPTRAIN_VERBOSE"       # dptrain's: set by main() for the run (torchrun workers too)
CONFIG_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130                # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
USER_ERRORS = (DPTrainError, OmegaConfBaseException, HydraException)
# a folder the command cannot write: a full disk or quota, no permission, a read-only disk
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)
_failed_jobs: list[str] = []  # sweep jobs of this process stopped by bad input (exit status)


def _env_set(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _verbose() -> bool:
    """True when the user asked for tracebacks (-v, or HYDRA_FULL_ERROR=1 outside dptrain)."""
    if VERBOSE_ENV in os.environ:
        return _env_set(VERBOSE_ENV)
    return _env_set(FULL_ERROR_ENV)


def _report_error(error: BaseException) -> None:
    """Print `error` as one short paragraph on stderr (no traceback)."""
    message = " ".join(str(error).split()) or type(error).__name__
    sys.stderr.write(f"dptrain: error: {message}\n")
    sys.stderr.write("(run with -v or HYDRA_FULL_ERROR=1 for the traceback)\n")


def stop_on_user_error(error: DPTrainError) -> NoReturn:
    """Bad input found outside a job (e.g. by a Hydra callback): report it and exit with status
    2, or re-raise it with its traceback under -v / HYDRA_FULL_ERROR=1."""
    if _verbose():
        raise error
    _report_error(error)
    sys.exit(CONFIG_ERROR_EXIT)


def _format_epsilon(result: RunResult) -> str:
    if result.epsilon is None:
        return "no privacy guarantee (privacy=none)"
    return f"epsilon = {format_epsilon(result.epsilon)} at delta = {result.delta:.3g}"


def _print_outcome(result: RunResult) -> None:
    """One closing line: status, steps, test accuracy (perplexity for a language model; the
    validation accuracy labelled private), epsilon and the run folder."""
    accuracy = "n/a" if result.test_accuracy is None else f"{100 * result.test_accuracy:.2f}%"
    if result.val_accuracy is not None:
        accuracy = (f"{accuracy} (validation {100 * result.val_accuracy:.2f}%: private, not "
                    "covered by epsilon)")
    score = f"test accuracy {accuracy}"
    if result.test_accuracy is None and result.test_perplexity is not None:
        score = f"test perplexity {result.test_perplexity:.4g}"
    from dptrain.train.display import shown_path

    print(
        f"dptrain: {result.status} after {result.steps} steps: {score}, "
        f"{_format_epsilon(result)}. Outputs in {shown_path(result.run_dir)}",
        flush=True,
    )


def _print_interrupted(result: RunResult, command: str, how: str = "interrupted") -> None:
    """The one line after Ctrl-C or a preempting signal (`how` says which): what the run did
    and spent, and how to continue it."""
    spent = ("no privacy guarantee (privacy=none)" if result.epsilon is None else
             f"epsilon spent so far {format_epsilon(result.epsilon)} at delta {result.delta:.3g} (every step "
             f"committed to the ledger)")
    print(f"dptrain: {how} after {result.steps} steps; {spent}. Resume with: {command}",
          flush=True)


def _train(cfg: DictConfig, run_dir: Path, loggers: Any) -> RunResult:
    """Build the run of `cfg` and train it (with canaries under `dptrain audit`), its messages
    naming settings by their config keys."""
    from dptrain.cli.build import build_job
    from dptrain.train.settings import command_line_names

    with command_line_names():
        if cfg.get("audit") is not None:  # dptrain audit / +audit=one_run: train with canaries
            from dptrain.cli.audit import audited_run

            return audited_run(cfg, run_dir, loggers)
        job, settings = build_job(cfg, run_dir)
        from dptrain.train.loop import train

        return train(job, settings, loggers)


def run_job(cfg: DictConfig) -> float | None:
    """One Hydra job: build from `cfg`, train, write result.json.

    Returns the accuracy a Hydra sweeper should optimise: the validation accuracy when the run
    has a validation split (`dataset.validation_size`), else the test accuracy. Ctrl-C ends the
    job (and a sweep) with one line, the run's result.json and exit status 130; SIGTERM or
    SIGUSR1 (a scheduler's preemption) likewise after the step in progress and a checkpoint,
    with exit status 128 + the signal's number (143, 138).
    """
    from dptrain.train.job import RunInterrupted, RunPreempted, selection_accuracy
    from dptrain.cli.results import (
        failed_result,
        failure_replaces_result,
        ledger_snapshot,
        read_result,
        write_result,
    )

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    ledger_before = ledger_snapshot(run_dir)
    try:
        from dptrain.cli.build import build_loggers

        loggers = build_loggers(cfg, run_dir)  # a missing logger package stops here
        from dptrain.cli.build import resolve_config
        from dptrain.cli.continuing import check_auto_resume

        check_auto_resume(resolve_config(cfg), hydra_cfg, run_dir, overrides)
        from dptrain.distributed.launch import relaunch_with_torchrun  # hardware=ddp

        # --config-dir / --config-name and hydra.* overrides travel to the torchrun workers too
        code = relaunch_with_torchrun(cfg.get("hardware"), overrides, run_dir, hydra=hydra_cfg)
        if code is not None:  # the torchrun workers trained and wrote result.json in run_dir
            if code != 0 and hydra_cfg.mode != RunMode.MULTIRUN:
                sys.exit(code)
            record = read_result(run_dir) or {}
            return selection_accuracy(record.get("val_accuracy"), record.get("test_accuracy"))
        result = _train(cfg, run_dir, loggers)
    except RunPreempted as stop:
        from dptrain.cli.continuing import resume_command
        from dptrain.train.preemption import exit_status

        write_result(run_dir, stop.result, overrides, f"preempted ({stop.signal_name})")
        _print_interrupted(stop.result, resume_command(hydra_cfg, overrides, run_dir),
                           f"preempted by {stop.signal_name}")
        sys.exit(exit_status(stop.signum))
    except RunInterrupted as stop:
        from dptrain.cli.continuing import resume_command

        write_result(run_dir, stop.result, overrides, "interrupted (Ctrl-C)")
        _print_interrupted(stop.result, resume_command(hydra_cfg, overrides, run_dir))
        sys.exit(INTERRUPTED_EXIT)
    except KeyboardInterrupt:
        if ledger_snapshot(run_dir) == ledger_before:   # this attempt took no step
            if read_result(run_dir) is None:
                stopped = dataclasses.replace(failed_result(run_dir), status="interrupted")
                write_result(run_dir, stopped, overrides, "interrupted (Ctrl-C) before training")
            print("dptrain: interrupted before training started: no step was taken.", flush=True)
        sys.exit(INTERRUPTED_EXIT)   # else the torchrun workers said what they did (hardware=ddp)
    except USER_ERRORS as error:
        if _verbose():
            raise
        # keep an earlier run's result, and the result of the run holding the folder
        if not isinstance(error, RunFolderBusyError) and failure_replaces_result(
                run_dir, ledger_before):
            with contextlib.suppress(WriteError):   # a full disk: the message says so
                write_result(run_dir, failed_result(run_dir), overrides,
                             " ".join(str(error).split()))
        if isinstance(error, WriteError):
            from dptrain.cli.continuing import resume_command

            error = WriteError(f"{error} Resume with: "
                               f"{resume_command(hydra_cfg, overrides, run_dir)}")
        _report_error(error)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            _failed_jobs.append(str(run_dir))
            return None  # the sweep goes on; the summary shows it failed; main() exits with 2
        sys.exit(CONFIG_ERROR_EXIT)
    write_result(run_dir, result, overrides)
    _print_outcome(result)
    return result.selection_accuracy


_hydra_main = hydra.main(
    config_path="pkg://dptrain.conf", config_name="config", version_base="1.3"
)(run_job)


def _take_verbose_flags(argv: list[str]) -> bool:
    """Remove -v/--verbose from `argv` (Hydra does not know them); True when one was there."""
    found = any(arg in VERBOSE_FLAGS for arg in argv[1:])
    argv[1:] = [arg for arg in argv[1:] if arg not in VERBOSE_FLAGS]
    return found


@contextlib.contextmanager
def _hydra_raises(verbose: bool) -> Iterator[None]:
    """Hydra raises its errors (HYDRA_FULL_ERROR=1) instead of printing its own block, so that
    main() reports them as one paragraph; `verbose` is kept in DPTRAIN_VERBOSE for the jobs (and
    the torchrun workers). The environment is restored afterwards."""
    saved = {name: os.environ.get(name) for name in (FULL_ERROR_ENV, VERBOSE_ENV)}
    os.environ[FULL_ERROR_ENV] = "1"
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    """Console-script entry point (`dptrain`; `dptrain report PATH` is dptrain.cli.report,
    `dptrain tune ...` dptrain.cli.tune)."""
    if sys.argv[1:2] == ["report"]:
        from dptrain.cli.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if sys.argv[1:2] == ["tune"]:   # a sweep with a random number of trials (cli/tune.py)
        from dptrain.cli.tune import main as tune_main

        sys.exit(tune_main(sys.argv[2:]))
    _failed_jobs.clear()
    from dptrain.cli.audit import expand_subcommand

    expand_subcommand(sys.argv)  # `dptrain audit ...` is `dptrain +audit=one_run ...`
    verbose = _take_verbose_flags(sys.argv) or _verbose()
    try:
        choose_sigma_option(sys.argv)  # privacy.noise_multiplier=S alone is privacy=sigma
        open_mapping_keys(sys.argv)    # model.lora.r=4 sets or adds a LoRA setting
    except DPTrainError as error:
        if verbose:
            raise
        _report_error(error)
        sys.exit(CONFIG_ERROR_EXIT)
    with _hydra_raises(verbose):
        try:
            _hydra_main()
        except USER_ERRORS as error:  # Hydra could not compose the command line
            if verbose:
                raise
            from dptrain.cli.suggest import explain

            _report_error(DPTrainError(explain(error, sys.argv[1:])))
            sys.exit(CONFIG_ERROR_EXIT)
        except OSError as error:  # Hydra writing the run folder's .hydra/ before any job runs
            if verbose or error.errno not in UNWRITABLE:
                raise
            _report_error(DPTrainError(
                f"could not write {error.filename or 'the run folder'}: {error.strerror}. Nothing "
                f"was trained and nothing charged. Free space on that disk (or fix its "
                f"permissions), or point hydra.run.dir (a sweep: hydra.sweep.dir) at a writable "
                f"folder on another disk, then run the command again."))
            sys.exit(CONFIG_ERROR_EXIT)
    if _failed_jobs:
        sys.stderr.write(
            f"dptrain: {len(_failed_jobs)} sweep job(s) failed: {', '.join(_failed_jobs)}\n"
        )
        sys.exit(CONFIG_ERROR_EXIT)


if __name__ == "__main__":
    main()
