"""The privacy ledger: an auditable, crash-safe record of what a run spent.

`privacy_ledger.json` (schema version `SCHEMA_VERSION`, documented in docs/ledger.md) holds the
resolved config and its hash, the dataset, its size N and the fingerprint of its contents, the
mechanism and its plan, the accountant, the target (epsilon, delta), the history of steps as runs
of identical (noise_multiplier, sample_rate), the epsilon it implies under every accountant, the
status and the checkpoints written. Every write is atomic (`dptrain.io.atomic_write_json`).

The trainer commits steps to the history BEFORE they touch data, so a ledger left by a killed
process never under-reports: `steps_completed + committed_ahead == sum(history steps)`.
Claimed epsilons are always `epsilon_of(history, delta, accountant)` of the stored history, so
`verify_ledger` can recompute them exactly.

One job per part: `schema` (the format and its JSON Schema), `hashing` (the config hash a resume
compares), `verification` (reading, checking and recomputing a ledger) and `record` (the ledger
of one run: `PrivacyLedger`, `run_ledger`). Everything is importable from here.
"""

from __future__ import annotations

from dptrain.accounting.history import (  # noqa: F401  (the ledger's history API)
    History,
    history_from_json,
    history_steps,
    history_to_json,
    merge_history,
    truncate_history,
)
from dptrain.checks import default_delta  # noqa: F401  (re-exported: where it was)
from dptrain.train.ledger.schema import (  # noqa: F401
    APPROXIMATE_ACCOUNTANTS,
    CYCLIC_PARTITION_NOTE,
    EARLIER_REPRODUCIBLE_NOTE,
    EQUAL_SPLIT_PARTITION_NOTE,
    LEDGER_FILENAME,
    LEDGER_SCHEMA,
    NON_PRIVATE_NOTE,
    PRIVACY_UNIT,
    RANDOMNESS,
    READABLE_VERSIONS,
    REPRODUCIBLE_MECHANISM_NOTE,
    SCHEMA_VERSION,
    SHUFFLE_PRIVACY_UNIT,
    STATUSES,
    ZERO_OUT_PRIVACY_UNIT,
    schema_errors,
)
from dptrain.train.ledger.hashing import (  # noqa: F401
    ADDED_KEYS,
    RENAMED_KEYS,
    RESUME_EXEMPT_KEYS,
    config_differences,
    config_hash,
    describe_differences,
    same_config,
)
from dptrain.train.ledger.verification import (  # noqa: F401
    Verification,
    accounting_mismatches,
    accounting_record,
    available_accountants,
    charged_beyond_completed,
    consistency_errors,
    epsilon_of,
    ledger_sampling,
    load_ledger,
    records_beyond_history,
    verify_ledger,
)
from dptrain.train.ledger.record import (  # noqa: F401
    PrivacyLedger,
    best_checkpoint_selection,
    carry_partition,
    carry_randomness,
    layer_strategies,
    mechanism,
    recorded_randomness,
    refresh_layer_strategies,
    run_delta,
    run_ledger,
)
