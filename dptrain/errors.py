"""User-facing errors.

Every error that a user can cause (bad config, bad argument, unsupported module) is one of these,
with a one-paragraph message that names the config key, argument or submodule and says how to fix
it. The CLI prints these without a traceback; the engine raises them from plain Python.
"""


class DPTrainError(Exception):
    """Base class of every error dptrain raises on purpose."""


class ConfigError(DPTrainError, ValueError):
    """A config key or a function argument has a value that cannot be used."""


class PrivacyError(DPTrainError, ValueError):
    """A privacy parameter is invalid (sigma, q, delta, target epsilon, clipping norm...)."""


class UnreachableEpsilonError(PrivacyError):
    """No noise multiplier reaches `target_epsilon` at `delta` in `steps` steps at sample rate
    `sample_rate`: even the largest sigma tried gives `best` (the message names the Python
    arguments; a caller that knows other names for them, the CLI's keys, can say it again)."""

    def __init__(self, message: str, target_epsilon: float, best: float, sample_rate: float,
                 steps: int, delta: float) -> None:
        super().__init__(message)
        self.target_epsilon, self.best, self.sample_rate = target_epsilon, best, sample_rate
        self.steps, self.delta = steps, delta


class UnsupportedModuleError(DPTrainError, ValueError):
    """A module cannot be trained privately as it is (e.g. BatchNorm): the message names it.

    `problems`: the `dptrain.validation.ModuleProblem`s found by the model validation (empty for
    other refusals), so that a caller knowing other names for the model can say it again
    (`dptrain.validation.invalid_model_error`) without validating the model a second time."""

    def __init__(self, message: str, problems: tuple = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class BudgetExhaustedError(DPTrainError):
    """The next step would spend more privacy than the run's target allows."""


class RunFolderBusyError(ConfigError):
    """Another process holds the run folder's lock (dptrain.train.run_lock): the message names
    that process."""


class WriteError(DPTrainError, OSError):
    """A run file could not be written (disk full, quota, failing storage): the message names the
    file and the system's reason; `errno` is the system's error number."""
