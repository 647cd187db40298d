"""Docs that must match the code: the README settings table and docs/state.md's key list."""

from __future__ import annotations

import re
from pathlib import Path

from app.config import Settings
from app.state.keys import Keys

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_every_setting_once() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(FLEXLB_[A-Z_]+)` \|", readme, flags=re.M)
    expected = [f"FLEXLB_{n.upper()}" for n in Settings.model_fields]
    assert sorted(listed) == sorted(expected)


def test_state_doc_names_every_key() -> None:
    doc = (ROOT / "docs" / "state.md").read_text()
    names = [
        n for n, v in vars(Keys).items() if not n.startswith("_") and (isinstance(v, property) or callable(v))
    ]
    missing = [n for n in names if n not in ("w", "r") and n not in doc]
    assert not missing, f"docs/state.md does not mention: {missing}"
