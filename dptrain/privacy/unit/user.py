"""User-level privacy (privacy.unit=user): two neighbouring datasets differ in all the examples of
one user. Users, not examples, are Poisson-sampled at q = batch_size / N_users
(dptrain.data.user_sampling), each contributing at most `max_examples_per_user` examples, and
each sampled user's mean gradient is clipped (dptrain.privacy.user_level; ghost mode:
dptrain.privacy.user_level_ghost). The user of each example is data (make_private's `user_ids`);
which rows form each user is fingerprinted for resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from torch import nn
from torch.utils.data import DataLoader

from dptrain.data.sampling import dataset_size
from dptrain.data.user_sampling import (
    UserDPDataLoader,
    user_fingerprint,
    user_groups,
    user_sample_rate,
)
from dptrain.errors import ConfigError
from dptrain.privacy.clipping import Clipper
from dptrain.privacy.unit.base import LoaderRate, Unit
from dptrain.privacy.user_level import USER_PRIVACY_UNIT, check_user_level_source
from dptrain.privacy.user_level_ghost import user_level_clipper

if TYPE_CHECKING:
    from dptrain.privacy.selection import LoaderContext, Selection

#: the ledger's mechanism.user_sampling
USER_SAMPLING = "poisson over users (ULS); a user's mean gradient is clipped"


@dataclass(frozen=True)
class UserUnit(Unit):
    """All the training examples of one user, whatever their number (add/remove of a user)."""

    kind: str = "user"

    samples_examples: ClassVar[bool] = False
    protects: ClassVar[str] = "one user"

    # -- the population ------------------------------------------------------------------------
    def population(self, data_loader: DataLoader, user_ids: Any,
                   loader_rate: LoaderRate) -> tuple[int, float]:
        """(N_users, batch_size / N_users); without `user_ids` the loader's (check_data refuses
        them missing where the mechanism is built)."""
        if user_ids is None:
            return loader_rate(data_loader)
        num_users = len(user_groups(user_ids, dataset_size(data_loader)))
        return num_users, user_sample_rate(data_loader, num_users)

    def count(self, dataset: Any) -> tuple[int, str]:
        ids = self.data_arguments(dataset)["user_ids"]
        return len(user_groups(ids, len(dataset), "dataset.user_column")), "users"

    # -- rules -----------------------------------------------------------------------------------
    def check_selection(self, selection: "Selection") -> None:
        """Users are drawn by Poisson sampling over users: a selection must say it supports it."""
        if not selection.supports_user_level:
            raise ConfigError("privacy.unit=user samples users with Poisson sampling: "
                              f"privacy.sampling={selection.kind} (or poisson_sampling=false) "
                              "is not supported with it. Use privacy.sampling=poisson.")

    def check_data(self, user_ids: Any, distributed: bool) -> None:
        """One user id per example is needed, and one process (the user loader is not sharded)."""
        if user_ids is None:
            raise ConfigError("privacy_unit='user' needs user_ids, one user id per training "
                              "example (from the CLI: dataset.user_column=COLUMN of a text "
                              "dataset).")
        if distributed:
            raise ConfigError("privacy_unit='user' is not supported with a DistributedDataParallel "
                              "or fully sharded (FSDP) model (hardware=ddp, hardware=fsdp): train "
                              "user-level runs on one process.")

    def data_arguments(self, dataset: Any) -> dict[str, Any]:
        """{"user_ids": the training set's user of each row} (dataset.user_column)."""
        user_ids = getattr(dataset, "user_ids", None)
        if user_ids is None:
            raise ConfigError("privacy.unit=user needs the user of every training example: set "
                              "dataset.user_column=COLUMN (dataset=text: the CSV/JSON/Parquet "
                              "column naming each row's user), or use privacy.unit=example.")
        return {"user_ids": user_ids}

    # -- the index stream and clipping -----------------------------------------------------------
    def private_loader(self, selection: "Selection", data_loader: DataLoader, user_ids: Any,
                       context: "LoaderContext") -> UserDPDataLoader:
        """Poisson sampling over users at the selection's q (check_selection: only a selection
        that supports it), each sampled user's examples capped."""
        return UserDPDataLoader.from_user_ids(
            data_loader, user_ids, max_examples_per_user=self.max_examples_per_user,
            generator=context.generator, secure=context.secure,
            sample_rate_schedule=context.rate_schedule)

    def clipper(self, clipper: Clipper, params: Sequence[nn.Parameter], data_loader: Any,
                source: Any) -> Clipper:
        """`clipper` applied to each sampled user's mean gradient (hooks or ghost norms), the
        users of each row read from the user loader."""
        check_user_level_source(source)
        return user_level_clipper(clipper, list(params), data_loader.batch_user_groups, source)

    # -- resume and the ledger ---------------------------------------------------------------------
    def assignment_fingerprint(self, data_loader: Any) -> str | None:
        """Which rows form each user and the cap (dptrain.data.user_sampling.user_fingerprint)."""
        return user_fingerprint(data_loader)

    def privacy_unit(self, selection: "Selection") -> str:
        return USER_PRIVACY_UNIT

    def ledger_entries(self, data_loader: Any) -> dict[str, Any]:
        """The number of users N (the accountant's; q = batch_size / N) and the cap on a sampled
        user's examples, read off the user loader's sampler."""
        sampler = data_loader.poisson_sampler
        return {"num_users": int(sampler.num_samples),
                "max_examples_per_user": sampler.max_examples_per_user,
                "user_sampling": USER_SAMPLING}


__all__ = ["USER_SAMPLING", "UserUnit"]
