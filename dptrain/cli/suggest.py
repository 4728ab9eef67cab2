"""dptrain's one paragraph for a command line Hydra cannot compose, with did-you-mean hints.

Hydra rejects `modle=mnist_cnn`, `model=resnet1000`, `train.epoch=3` or `train.epochs=ten` with a
multi-line block; `explain` turns it into one paragraph naming the key or option, what it accepts
(from the typed schemas, dptrain.cli.schema) and the close matches (difflib) from the configs
shipped in `dptrain/conf`: the group names, each group's options, and every key of the primary
config and of each group's options. `dptrain -v` shows Hydra's own text and traceback instead.
"""

from __future__ import annotations

import difflib
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, Iterator

from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from dptrain.cli.overrides import split_override
from dptrain.cli.schema import accepts

CONF_PACKAGE = "dptrain.conf"
PRIMARY = "config.yaml"
NOT_GROUPS = ("hydra",)
LAUNCHER_GROUP = "hydra/launcher"


def _conf_root() -> Traversable:
    return resources.files(CONF_PACKAGE)


def config_groups() -> dict[str, list[str]]:
    """group name -> sorted option names (yaml stems), e.g. {"model": ["cifar10_cnn", ...]}."""
    groups = {}
    for entry in _conf_root().iterdir():
        if (
            entry.is_dir()
            and entry.name not in NOT_GROUPS
            and not entry.name.startswith(("_", "."))
        ):
            options = sorted(
                f.name[: -len(".yaml")] for f in entry.iterdir() if f.name.endswith(".yaml")
            )
            groups[entry.name] = options
    return groups


def _dotted_keys(node: Any, prefix: str) -> Iterator[str]:
    if isinstance(node, DictConfig):
        for key in node.keys():
            if key in ("defaults",):
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from _dotted_keys(node._get_node(key), path)


def _load(entry: Traversable) -> DictConfig:
    loaded = OmegaConf.create(entry.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, DictConfig) else OmegaConf.create({})


def known_keys(groups: dict[str, list[str]]) -> set[str]:
    """Every dotted key the shipped configs define (primary config + every group option)."""
    root = _conf_root()
    primary = _load(root.joinpath(PRIMARY))
    keys = {k for k in _dotted_keys(primary, "") if not k.startswith("hydra")}
    for group, options in groups.items():
        if group == "recipe":
            continue
        keys.add(group)
        for option in options:
            keys.update(_dotted_keys(_load(root.joinpath(group, f"{option}.yaml")), group))
    return keys


def _close(word: str, candidates: list[str] | set[str]) -> list[str]:
    return difflib.get_close_matches(word, sorted(candidates), n=3, cutoff=0.6)


def _split_override(arg: str) -> tuple[str, str, str] | None:
    """(key, value, prefix) of a `key=value` override, its +/++/~ prefix split off; None for flags."""
    parsed = split_override(arg)
    return None if parsed is None else (parsed[1], parsed[2], parsed[0])


def _internal(key: str) -> bool:
    """A key users never set by hand (`model._target_`): never offered as a suggestion."""
    return any(part.startswith("_") for part in key.split("."))


def owners(key: str, groups: dict[str, list[str]]) -> list[str]:
    """The `group=option` choices whose config defines the dotted `key`, e.g.
    owners("dataset.train_file") == ["dataset=text"]."""
    group = key.split(".")[0]
    root = _conf_root()
    return [f"{group}={option}" for option in groups.get(group, []) if group != "recipe"
            and key in set(_dotted_keys(_load(root.joinpath(group, f"{option}.yaml")), group))]


def _belongs_elsewhere(key: str, value: str, groups: dict[str, list[str]]) -> str | None:
    """The hint for a known key that the command's option of its group lacks; None if no
    option defines it."""
    found = owners(key, groups)
    if not found:
        return None
    extra = ADDABLE.get(key, "").format(key=key, value=value)
    return (f"{key} is a key of {' and '.join(found)}, not of the {key.split('.')[0]} option "
            f"this command uses: choose it ({found[0]} {key}={value}){extra}.")


# Keys another option may take as an addition, and how (said after the option that defines them).
ADDABLE = {"privacy.target_epsilon": ", or cap a privacy=sigma run at that budget with "
                                     "+{key}={value}"}


def _hint_for(
    key: str, value: str, prefix: str, groups: dict[str, list[str]], keys: set[str]
) -> str | None:
    """The hint for one override, or None when it names a known group option or key."""
    if key == LAUNCHER_GROUP:
        return (
            f"{LAUNCHER_GROUP}={value}: Hydra's parallel and cluster launchers (joblib, "
            f"submitit_local, submitit_slurm; dptrain's slurm) need `pip install \"dptrain[cluster]\"`."
        )
    if key.split(".")[0].split("/")[0] == "hydra" or ("+" in prefix and key not in groups):
        return None
    if key in groups:
        # a sweep (a,b) or a list of options (logger=[jsonl,csv])
        wrong = [v for v in value.strip("[]").split(",") if v and v not in groups[key]]
        for option in wrong:
            close = _close(option, groups[key])
            if close:
                options = ", ".join(groups[key])
                return (
                    f"{prefix}{key}={option}: did you mean {prefix}{key}={close[0]}? "
                    f"Options: {options}."
                )
        return None
    if key in keys:
        return None
    close = _close(key, {k for k in set(groups) | keys if not _internal(k)})
    if close:
        return f"{key}: did you mean {close[0]}={value}?"
    return f"{key}: no such config group or key. Groups: {', '.join(sorted(groups))} (see dptrain --help)."


def hints(argv: list[str]) -> list[str]:
    """One did-you-mean line for each override in `argv` that names nothing known."""
    groups = config_groups()
    keys = known_keys(groups)
    lines = []
    for arg in argv:
        parsed = _split_override(arg)
        if parsed is not None:
            hint = _hint_for(*parsed, groups, keys)
            if hint:
                lines.append(hint)
    return lines


def _override_value(argv: list[str], key: str) -> str | None:
    """The value `argv` gives `key` (the last override of it), as typed."""
    value = None
    for arg in argv:
        parsed = _split_override(arg)
        if parsed is not None and parsed[0] == key:
            value = parsed[1]
    return value


def _unquoted_non_ascii(error: BaseException, argv: list[str]) -> str | None:
    """The fix for an override Hydra's grammar cannot read because its unquoted value has a
    character outside ASCII (`hydra.run.dir=outputs/résumé`): quote it. None for other errors."""
    text = str(error)
    for arg in argv:
        key, equals, value = arg.partition("=")
        if equals and not value.isascii() and arg in text and not value.startswith(("'", '"')):
            return (f"{arg}: an unquoted value may hold ASCII characters only (Hydra's override "
                    f"grammar). Quote the value, with the shell's single quotes around the whole "
                    f"override so that Hydra sees the double quotes: '{key}=\"{value}\"'.")
    return None


def explain(error: BaseException, argv: list[str]) -> str:
    """One paragraph for a Hydra composition error of the command line `argv`: what is wrong
    (the key and value, or the option) and how to fix it."""
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, ValidationError) and key:
        value = _override_value(argv, key)
        value = cause.value if value is None else value
        wanted = accepts(key) or "a value of another type"
        return f"{key}={value} is not accepted: {key} takes {wanted}."
    found = hints(argv)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        options = ", ".join(error.options or [])
        lead = f"{group}={option} names no config of the {group} group; options: {options}."
        return " ".join(found) if found else lead
    if not key:
        quoted = _unquoted_non_ascii(error, argv)
        return quoted or " ".join([" ".join(str(error).split()), *found])
    value = _override_value(argv, key)
    elsewhere = None if value is None else _belongs_elsewhere(key, value, config_groups())
    if elsewhere:
        return elsewhere
    lead = f"{key} is not a config key"
    found = [line.removeprefix(f"{key}: ") for line in found]
    return f"{lead}: {' '.join(found)}" if found else f"{lead}; see dptrain --help for the keys."
