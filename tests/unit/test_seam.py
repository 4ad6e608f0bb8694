"""The seam stays thin and the decision protocol stays one (issue 50): ``trainer.py`` is
at most 370 lines and asks ``Recovery`` only through its protocol (the table in
``components/response/recovery.py``); the late update, the redo, the rollback and the
drop are each one method with one caller; every execution of a step beyond the first
goes through ``Reexecution`` (no other module swaps ``step_record``/``ntokens_seen`` or
calls ``execute``)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "titan_ledger"
PROTOCOL = {"before_step", "no_tokens", "after_execute", "update", "at_data_end", "settle"}


def _calls(tree: ast.AST, owner: str | None = None) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            v = node.func.value
            base = v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else None
            if owner is None or base == owner:
                out.append(node.func.attr)
    return out


def test_the_trainer_is_a_thin_seam_that_asks_recovery_through_its_protocol():
    src = (PKG / "trainer.py").read_text()
    assert len(src.splitlines()) <= 370  # (issue 60: the step's tokens counted before its first execution)
    asked = _calls(ast.parse(src), "recovery")
    assert set(asked) <= PROTOCOL, f"trainer.py calls Recovery outside its protocol: {set(asked) - PROTOCOL}"
    assert {"before_step", "after_execute", "update"} <= set(asked)


def test_each_action_is_one_method_with_one_caller():
    tree = ast.parse((PKG / "components" / "response" / "recovery.py").read_text())
    calls = _calls(tree, "self")
    for action in ("_apply_late", "_redo", "_rollback", "_drop", "_skip_window"):
        assert calls.count(action) == 1, f"Recovery.{action} is called {calls.count(action)} times"


def test_only_reexecution_executes_a_step_again():
    executes, swaps = [], []
    for path in PKG.rglob("*.py"):
        if path.name in ("trainer.py", "reexecution.py"):
            continue
        tree = ast.parse(path.read_text())
        if "execute" in _calls(tree):
            executes.append(str(path.relative_to(PKG)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and e.attr in ("ntokens_seen",) and \
                                not (isinstance(e.value, ast.Name) and e.value.id == "self"):
                            swaps.append(str(path.relative_to(PKG)))
    assert not executes, f"modules that call execute themselves: {executes}"
    assert not swaps, f"modules that set a trainer's ntokens_seen: {swaps}"
