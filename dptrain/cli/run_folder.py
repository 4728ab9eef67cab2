"""Hydra callback guarding the output folder before Hydra writes into it.

Hydra creates the run folder (`hydra.run.dir`) or sweep folder (`hydra.sweep.dir`) and writes
`.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml` there before dptrain's job starts. This
callback runs just before that (`on_run_start` / `on_multirun_start`) and:

- stops with a one-paragraph error naming the key (exit status 2, no traceback) when the folder
  cannot be created or written, instead of Hydra's traceback;
- when a single run targets a folder that already holds a Hydra record (a resume, or a refused
  attempt on an earlier run's folder), points Hydra's record of this attempt at
  `.hydra/attempt_<UTC time>/`, so that the earlier run's `.hydra/*.yaml` is never overwritten.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from dptrain.errors import ConfigError
from dptrain.io import ensure_writable_dir

HYDRA_RECORD = "config.yaml"   # the file Hydra writes first into its output subfolder
ATTEMPT_PREFIX = "attempt_"


def check_writable(folder: str | Path, key: str) -> None:
    """Create `folder` if needed; report a folder that cannot be written and exit (status 2)."""
    try:
        ensure_writable_dir(folder, what=key)
    except ConfigError as error:
        from dptrain.cli.main import stop_on_user_error

        stop_on_user_error(error)


def attempt_subdir(run_dir: Path, output_subdir: str | None) -> str | None:
    """Where Hydra should record this attempt: None to keep `output_subdir` (a new folder, or no
    record asked for), else a fresh `<output_subdir>/attempt_<UTC time>` inside it."""
    if output_subdir is None or not (run_dir / output_subdir / HYDRA_RECORD).exists():
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    return f"{output_subdir}/{ATTEMPT_PREFIX}{stamp}"


class RunFolderCallback(Callback):
    """Registered in the primary config under `hydra.callbacks`."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.run.dir))
        check_writable(run_dir, "hydra.run.dir")
        subdir = attempt_subdir(run_dir, config.hydra.output_subdir)
        if subdir is not None:
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = subdir

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(str(config.hydra.sweep.dir)), "hydra.sweep.dir")
