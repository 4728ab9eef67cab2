"""model_best.pt is chosen on the validation examples of the private file without noise: the
ledger and the docs say it is not covered by epsilon and not safe to share (dptrain does not
select the best checkpoint privately)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
from test_trainer_support import make_job, make_settings

from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.train.ledger import LEDGER_SCHEMA
from dptrain.train.loop import train

ROOT = Path(__file__).resolve().parents[2]


def test_the_ledger_says_model_best_is_not_covered_by_epsilon_and_not_safe_to_share(tmp_path):
    train(make_job(validation=True), make_settings(tmp_path, epochs=2, keep_best=True))
    data = json.loads((tmp_path / "privacy_ledger.json").read_text())
    jsonschema.validate(data, LEDGER_SCHEMA)
    selection = data["model_selection"]
    assert (tmp_path / selection["model_file"]).name == "model_best.pt"
    assert (tmp_path / "model_best.pt").exists()
    assert selection["covered_by_epsilon"] is False and selection["safe_to_share"] is False
    assert "model_best.pt" in selection["note"] and "Not safe to share" in selection["note"]
    assert ledger_main([str(tmp_path)]) == 0


def _safe_to_share_line(readme: str) -> str:
    """README's 'Files safe to share' sentence, up to its **Not** list."""
    start = readme.index("**Files safe to share:**")
    return readme[start:readme.index("**Not**", start)]


def test_the_readme_no_longer_lists_model_best_as_safe_to_share():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "model_best.pt" not in _safe_to_share_line(readme)
    assert "release `model_best.pt`" not in readme
    row = next(line for line in readme.splitlines() if line.startswith("| `model.pt`"))
    assert "model_best.pt" in row and "not covered by epsilon" in row


def test_docs_privacy_marks_model_best_not_safe_to_share():
    doc = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    rows = [line for line in doc.splitlines() if line.startswith("|") and "model_best.pt" in line]
    files = [row.split("|") for row in rows if "`model_best.pt`" in row.split("|")[1]]
    # the table of files: | file | safe to share? | what it holds |
    shared = [cells[2].strip() for cells in files if len(cells) == 5]
    assert shared and all(answer.startswith("**no**") for answer in shared)
    assert not any(re.match(r"\|[^|]*model_best\.pt[^|]*\|\s*yes\s*\|", row) for row in rows)
    assert "Release `model_best.pt`" not in doc
