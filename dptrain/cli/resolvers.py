"""OmegaConf resolvers the configs in dptrain/conf use; registered when this module is imported.

`dptrain.cli.main` (the command) and `dptrain.cli.build` (which resolves the config) import it,
so every `${...}` below resolves wherever dptrain builds a job:

* `${dptrain.token_ids:${dataset.vocab_size}}`: the number of token ids of a text dataset whose
  vocabulary has `vocab_size` words, i.e. vocab_size + the reserved ids (pad, start, unknown,
  unused: `dptrain.data.datasets.imdb.NUM_RESERVED`). Used by model/transformer.yaml.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def token_ids(vocab_size: int) -> int:
    """`vocab_size` words + the dataset's reserved ids: the rows of a token embedding."""
    from dptrain.data.datasets.imdb import NUM_RESERVED  # lazy: `dptrain --help` loads no torch

    return int(vocab_size) + NUM_RESERVED


OmegaConf.register_new_resolver("dptrain.token_ids", token_ids, replace=True)
