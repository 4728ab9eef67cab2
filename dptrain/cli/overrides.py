"""The `dptrain` command line before Hydra composes it: a sigma given on its own chooses
privacy=sigma, and keys inside an open mapping (`model.lora.r=4`) set or add.

`dptrain privacy.budget.sigma=0.5` (or its older name privacy.noise_multiplier) asks for DP-SGD
with sigma 0.5, but the default privacy option (privacy=epsilon) calibrates sigma to its target
epsilon, which a sigma would turn into a cap. `choose_sigma_option` makes the command mean what it
says: the override (with or without `+`) selects `privacy=sigma`, so the composed config, its hash
and the ledger are those of `dptrain privacy=sigma privacy.budget.sigma=0.5`. Combined with another
privacy option (privacy=epsilon, privacy=none) it is refused in one paragraph. This is the only
rewrite of the privacy group on the command line: the older flat names themselves are read after
composition (dptrain.cli.privacy_config), where config files and the compose API reach them too.

`model.lora` is an open mapping, null by default (full fine-tuning): Hydra would refuse
`model.lora.r=4` as "not a config key" because the null node has no keys, while
`+model.lora.r=4` fails once a recipe has set `r`. `open_mapping_keys` gives such overrides
Hydra's set-or-add prefix `++`, so the dotted form works with or without `+`; the mapping's keys
are checked when the model is built (dptrain.models.hf_config.LoraConfig names an unknown one).
Plain strings only: no Hydra, no torch.
"""

from __future__ import annotations

from dptrain.errors import ConfigError

SIGMA_KEYS = ("privacy.budget.sigma", "privacy.noise_multiplier")   # nested, older flat name
OPEN_MAPPINGS = ("model.lora",)   # config nodes whose keys a command line may set or add
PRIVACY_GROUP = "privacy"
SIGMA_OPTION = "sigma"


def split_override(arg: str) -> tuple[str, str, str] | None:
    """(prefix, key, value) of a `key=value` override (prefix: "", "+", "++" or "~"); None for
    flags and positional values."""
    if arg.startswith("-") or "=" not in arg:
        return None
    raw_key, value = arg.split("=", 1)
    key = raw_key.lstrip("+~")
    return raw_key[: len(raw_key) - len(key)], key, value


def choose_sigma_option(argv: list[str]) -> None:
    """Rewrite `argv` (sys.argv, in place) so that setting privacy.budget.sigma (or
    privacy.noise_multiplier) chooses privacy=sigma: `privacy=sigma` is inserted before the first
    such override unless the command already chooses it, and a `+`/`++` in front of the key is
    dropped (privacy=sigma has the key). ConfigError when the command chooses another privacy
    option."""
    sigma_at = [i for i, arg in enumerate(argv) if i > 0 and (parsed := split_override(arg)) is not None
                and parsed[1] in SIGMA_KEYS and "~" not in parsed[0]]
    if not sigma_at:
        return
    chosen = [parsed[2] for arg in argv[1:]
              if (parsed := split_override(arg)) is not None and parsed[1] == PRIVACY_GROUP]
    others = sorted({option for value in chosen for option in value.split(",")} - {SIGMA_OPTION})
    key, value = split_override(argv[sigma_at[0]])[1:]  # type: ignore[misc]
    if others:
        raise ConfigError(
            f"{key}={value} gives sigma, but privacy={','.join(others)} is chosen too "
            f"(privacy=epsilon calibrates sigma to privacy.budget.target_epsilon; privacy=none "
            f"adds no noise), so the sigma would not be used. To train with sigma {value}, drop "
            f"privacy={','.join(others)} ({key} alone chooses privacy=sigma; "
            f"privacy.budget.target_epsilon=E adds a budget cap); to calibrate sigma, drop {key}.")
    for i in sigma_at:
        argv[i] = argv[i].lstrip("+")
    if not chosen:
        argv.insert(sigma_at[0], f"{PRIVACY_GROUP}={SIGMA_OPTION}")


def open_mapping_keys(argv: list[str]) -> None:
    """Rewrite `argv` (sys.argv, in place) so that `KEY=VALUE` and `+KEY=VALUE` for a KEY inside
    an open mapping (OPEN_MAPPINGS, e.g. model.lora.r) become `++KEY=VALUE` (set or add)."""
    for i, arg in enumerate(argv[1:], start=1):
        parsed = split_override(arg)
        if parsed is None or "~" in parsed[0]:
            continue
        prefix, key, value = parsed
        if any(key.startswith(f"{mapping}.") for mapping in OPEN_MAPPINGS):
            argv[i] = f"++{key}={value}"
