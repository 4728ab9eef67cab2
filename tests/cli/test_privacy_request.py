"""The command's privacy group -> the plan (cli/privacy_request.py): the batch selection."""

import pytest

from dptrain.cli import privacy_request
from dptrain.errors import ConfigError
from dptrain.privacy.plan import COMMAND_SELECTIONS


@pytest.mark.parametrize("kind", COMMAND_SELECTIONS)
def test_privacy_sampling_accepts_every_selection_kind_the_plan_offers_a_command(kind):
    assert privacy_request._sampling({"sampling": kind}) == kind


def test_privacy_sampling_takes_its_choices_from_the_plan_not_a_list_of_its_own(monkeypatch):
    monkeypatch.setattr(privacy_request, "COMMAND_SELECTIONS", (*COMMAND_SELECTIONS, "new_kind"))
    assert privacy_request._sampling({"sampling": "new_kind"}) == "new_kind"


def test_the_python_only_given_selection_is_refused_on_the_command_line_naming_the_key():
    with pytest.raises(ConfigError, match="privacy.sampling"):
        privacy_request._sampling({"sampling": "given"})
