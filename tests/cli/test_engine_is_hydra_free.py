"""Only dptrain.cli (and the configs it registers, dptrain.conf) imports Hydra: the engine and the
run machinery (dptrain.train) work without it; the command's start-up loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

IMPORT_ENGINE = """
import importlib, pathlib, sys
import dptrain
root = pathlib.Path(dptrain.__file__).parent
names = sorted(
    ".".join(("dptrain",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for path in root.rglob("*.py")
    if path.relative_to(root).parts[0] not in ("cli", "conf", "__main__.py"))
for name in names:
    importlib.import_module(name)
loaded = sorted(k for k in sys.modules if k.split(".")[0] in ("hydra", "omegaconf"))
print(len(names), len([n for n in names if n.startswith("dptrain.train.")]), loaded)
"""


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout


def test_importing_every_engine_and_train_module_loads_neither_hydra_nor_omegaconf() -> None:
    count, train_modules, loaded = _run(IMPORT_ENGINE).split(maxsplit=2)
    assert int(count) > 30 and int(train_modules) >= 10 and loaded.strip() == "[]"


@pytest.mark.slow
def test_the_run_api_imports_without_hydra() -> None:
    out = _run("import sys, dptrain.train; from dptrain.train import private_job, train; "
               "print(sorted(k for k in sys.modules if k.split('.')[0] in ('hydra', 'omegaconf')))")
    assert out.strip() == "[]"


def test_the_command_and_its_typed_configs_load_no_torch_before_a_job_runs() -> None:
    out = _run("import sys, dptrain.conf, dptrain.cli.main, dptrain.cli.suggest; "
               "print('torch' in sys.modules)")
    assert out.strip() == "False"
