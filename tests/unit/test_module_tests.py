"""docs/development.md's module -> tests table stays true: every module of
``titan_ledger/`` has a row, every listed test file exists and names its module (its
dotted path, an import of it, or its name as a word: ``rerun/plan`` through
``test_rerun.py``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("### Which tests cover a module", 1)[1]
    rows = {}
    for line in block.splitlines():
        m = re.match(r"^\| `([\w.]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([\w/]+\.py)`", m.group(2))
    return rows


def _modules() -> list[str]:
    pkg = ROOT / "titan_ledger"
    return sorted(".".join(p.relative_to(pkg).with_suffix("").parts) for p in pkg.rglob("*.py")
                  if p.name != "__init__.py" and "assets" not in p.parts)


def test_every_module_has_tests_that_name_it():
    rows = _table()
    missing = [m for m in _modules() if not rows.get(m)]
    assert not missing, f"docs/development.md's module -> tests table has no tests for: {missing}"
    stale = [m for m in rows if m not in _modules()]
    assert not stale, f"the table lists modules that do not exist: {stale}"
    bad = []
    for mod, tests in rows.items():
        name = mod.rsplit(".", 1)[-1]
        for t in tests:
            path = ROOT / "tests" / t
            if not path.exists():
                bad.append(f"{mod}: {t} does not exist")
            elif not (f"titan_ledger.{mod}" in (text := path.read_text()) or re.search(rf"\b{name}\b", text)):
                bad.append(f"{mod}: {t} never names it")
    assert not bad, "\n".join(bad)


def test_the_table_check_is_not_vacuous():
    rows = _table()
    assert len(rows) == len(_modules()) > 60
    assert rows["components.response.recovery"][0] == "unit/components/response/test_recovery.py"
