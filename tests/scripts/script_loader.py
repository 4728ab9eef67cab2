"""Import a script of scripts/ as a module, the way the tests of scripts/ read its functions."""

import importlib.util
import sys
import types
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> types.ModuleType:
    """scripts/`name`.py, imported and registered as sys.modules[`name`] (its dataclasses and
    pickling look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
