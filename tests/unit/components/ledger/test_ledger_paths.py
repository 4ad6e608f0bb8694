"""Ledger paths are spelled in ``titan_ledger/format/`` only (issue 34, item 7).

``format/records.py`` owns every file name inside a ledger folder (``SIGNALS_FILE``,
``rank_file(r)``, ``data_file(dp)``, ``DATA_GLOB``, ``rerun_summary_file``, ...) and the
default folder name (``LEDGER_FOLDER``). This test parses every module of the package
outside ``format/`` and fails on a string constant -- an f-string's literal parts
included -- that spells one: a message prints ``folder / records.SPIKES_FILE``, not
``'spikes.jsonl'``. Docstrings and other bare string statements (documentation, no
effect at run time) and comments (``ast`` drops them) may name files in prose.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
PKG = ROOT / "titan_ledger"

#: a ledger file's name (or the part of one a tool could build a name from); an
#: f-string's replacement fields read as ``{}``
LEDGER_NAME_RE = re.compile(
    r"signals\.jsonl|spikes\.jsonl|rejected_steps\.jsonl|segments\.jsonl|wandb\.json"
    r"|rerun\.json|quarantine\.jsonl|data_dp"
    r"|rank(?:\{\}|\d+|<r>|&lt;r&gt;|\*)?\.jsonl"
    r"|/rerun/|rerun/step|step(?:\{\}|\d+|<T>)\.json(?!l)")

#: the default ledger folder's name, where a string is used as one: a parameter's or an
#: argparse option's default, ``getattr(x, "folder", "ledger")``, a comparison, an assignment
#: (``ledger`` as a TOML section or attribute name -- ``getattr(config, "ledger")``,
#: ``doc.get("ledger")`` -- is not a path)
FOLDER = "ledger"

#: occurrences in modules other engineers are editing: being moved (issue 34). Each is
#: (path relative to the repo, the text the scan matched). Empty this as they move.
ALLOW = {
    # being moved (issue 34)
    ("titan_ledger/components/ledger/ledger.py", "ledger"),
    ("titan_ledger/components/ledger/dashboards.py", "wandb.json"),
    ("titan_ledger/components/ledger/dashboards.py", "ledger"),
    ("titan_ledger/tools/rerun/plan.py", "ledger"),
}


def _render(node: ast.JoinedStr) -> str:
    return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                   for v in node.values)


def scan(source: str, name: str = "<string>") -> list[tuple[int, str, str]]:
    """``(line, the string, what matched)`` for each string constant of ``source`` that
    spells a ledger path, docstrings and bare string statements excepted."""
    tree = ast.parse(source, filename=name)
    skip: set[int] = set()
    hits: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Constant, ast.JoinedStr)):
            skip.update(id(n) for n in ast.walk(node.value))  # a docstring: prose
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(n) for n in node.values)  # read whole below, not part by part
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = _render(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        hits += [(node.lineno, text, m.group(0)) for m in LEDGER_NAME_RE.finditer(text)]
    for node in ast.walk(tree):
        hits += [(c.lineno, FOLDER, FOLDER) for c in _folder_uses(node)]
    return sorted(set(hits))


def _folder_uses(node: ast.AST) -> list[ast.Constant]:
    """The ``"ledger"`` constants ``node`` uses as a folder name."""
    def named(x: ast.AST | None) -> list[ast.Constant]:
        return [x] if isinstance(x, ast.Constant) and x.value == FOLDER else []

    if isinstance(node, ast.arguments):
        return [c for d in (*node.defaults, *node.kw_defaults) for c in named(d)]
    if isinstance(node, ast.Call):
        out = [c for k in node.keywords if k.arg == "default" for c in named(k.value)]
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) == 3:
            out += named(node.args[2])
        return out
    if isinstance(node, ast.Compare):
        return [c for x in (node.left, *node.comparators) for c in named(x)]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return named(node.value)
    return []


def _package_hits() -> list[tuple[str, int, str, str]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("titan_ledger/format/"):
            continue
        out += [(rel, line, text, what) for line, text, what in scan(path.read_text(), rel)]
    return out


def test_ledger_paths_are_spelled_in_format_only():
    hits = [h for h in _package_hits() if (h[0], h[3]) not in ALLOW]
    assert not hits, ("ledger paths spelled outside titan_ledger/format/ (use the "
                      "titan_ledger.format.records constants):\n"
                      + "\n".join(f"  {f}:{n}: {t!r} ({w})" for f, n, t, w in hits))


def test_allow_list_has_no_stale_entries():
    found = {(h[0], h[3]) for h in _package_hits()}
    stale = sorted(ALLOW - found)
    assert not stale, f"moved already: remove from ALLOW: {stale}"


def test_scan_finds_a_spelled_path():
    src = '''
"""A docstring may say spikes.jsonl and data_dp<r>.jsonl."""
import os


def f(folder, r, step, ledger_folder="ledger"):
    """So may this one: rank<r>.jsonl."""
    "and a bare string: signals.jsonl"
    # and a comment: signals.jsonl
    a = os.path.join(folder, "x/spikes.jsonl")
    b = f"{folder}/rank{r}.jsonl"
    c = f"{folder}/rerun/step{step}.json"
    d = getattr(folder, "folder", "ledger")
    e = getattr(folder, "ledger", None)  # an attribute's name, not a path
    return a, b, c, d, e
'''
    hits = scan(src)
    assert [(n, w) for n, _, w in hits] == [
        (6, "ledger"), (10, "spikes.jsonl"), (11, "rank{}.jsonl"), (12, "/rerun/"),
        (12, "step{}.json"), (13, "ledger")], hits
    assert (10, "x/spikes.jsonl", "spikes.jsonl") in hits
