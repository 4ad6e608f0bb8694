"""Docs and docstrings name only modules that exist (issue 34, item 8).

- docs/architecture.md's layout names every module of ``titan_ledger/`` (a new module
  without a line there fails);
- every ``titan_ledger.X[.Y...]`` path written in ``:mod:`` or in double backticks in a
  docstring or comment of the package, in docs/ or the README, imports (or is an
  attribute of a module that imports): a pre-layout path such as ``titan_ledger.records``
  fails. Profiler spans (``record_function("titan_ledger.signals")``), logger names and
  schema ids (``titan_ledger.segments/1``) are names, not paths, and are not written that way.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "titan_ledger"


def _layout_entries() -> dict[str, str]:
    """docs/architecture.md's layout block: top-level entry (``components/``, ``trainer.py``,
    ...) -> its text, continuation lines included."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    top = ""
    name = None
    for line in block.splitlines():
        m = re.match(r"^  (\S+)", line)
        if m:  # an entry of titan_ledger/ (two spaces): one or more names, then words
            name = m.group(1)
            entries[name] = line
            top += line + "\n"
        elif line.startswith("   ") and name is not None:
            entries[name] += "\n" + line
            top += line + "\n"
        else:
            name = None
    entries[""] = top
    return entries


def test_architecture_layout_names_every_module():
    entries = _layout_entries()
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue
        if len(rel.parts) == 1:
            if not re.search(rf"(?<![\w/]){re.escape(rel.name)}", entries[""]):
                missing.append(str(rel))
            continue
        entry = entries.get(rel.parts[0] + "/", "")
        words = [p.removesuffix(".py") for p in rel.parts[1:] if p != "__init__.py"]
        if len(rel.parts) > 2:
            words[0] += "/"  # a subpackage is written as a folder: rerun/
        if not entry or not all(re.search(rf"(?<![\w]){re.escape(w)}(?![\w])", entry) for w in words):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's layout omits: {missing}"


#: a dotted path in prose, a docstring or a comment; not a quoted name (a profiler span, a
#: logger), a schema id (``.../1``), a file name (``.titan_ledger.lock``) or a placeholder
#: (``titan_ledger.X``, ``titan_ledger.<tool>``)
PATH_RE = re.compile(r"(?<![\w.\"'/])(titan_ledger(?:\.[a-z_]\w*)+)(?![\w/])")


#: dotted names that are not module paths
NOT_MODULES = {"titan_ledger.run_id"}  # a key of the W&B run config (docs/ledgers.md)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            return False
        return True
    return False


def test_written_module_paths_import():
    from titan_ledger.rehearsal import backend

    backend.ensure_installed()  # some modules import torchtitan
    files = [*PKG.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             *(ROOT / "bench").rglob("*.py")]
    tests = [f for f in (ROOT / "tests").rglob("*.py") if f != Path(__file__)]
    bad = []
    for f in [*files, *tests]:
        lines = f.read_text(errors="replace").splitlines()
        if f in tests:  # a test's strings are data (unknown names on purpose): its docstring only
            lines = lines[:next((i + 1 for i, ln in enumerate(lines) if i and '"""' in ln), 1)]
        for n, line in enumerate(lines, 1):
            for m in PATH_RE.finditer(line):
                if m.group(1) not in NOT_MODULES and not _resolves(m.group(1)):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not bad, "paths that do not import:\n" + "\n".join(bad)


def test_the_checks_fail_on_a_stale_name(tmp_path):
    """The rules above catch what they are for (they are not vacuous)."""
    assert not _resolves("titan_ledger.records") and not _resolves("titan_ledger.rerun.PLAN_FOR")
    assert _resolves("titan_ledger.format.records") and _resolves("titan_ledger.tools.rerun.PLAN_FOR")
    assert PATH_RE.search("see :mod:`titan_ledger.backend`").group(1) == "titan_ledger.backend"
    assert "optimizer" in _layout_entries()["components/"]
