"""No module reaches into another object's private names.

``X._name`` where ``X`` is not ``self``/``cls`` and ``_name`` is defined in neither this
module nor a listed torch/torchtitan spot is a reach into someone else's internals (the
round-2 review found ``ledger._keep_ladder``, ``ledger._step_tags``, ``backend._sum_reduction``
used from the trainer). A component that needs another's state asks it through a public
method; a name torch or torchtitan keeps private but we must read is listed below, with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "titan_ledger"

#: private names of torch / torchtitan / our own markers we must touch, and why
ALLOWED = {
    "_foreach_norm": "torch's fused norm (what clip_grad_norm_ itself calls)",
    "_last_lr": "LR schedulers: scale_lr and the skip window keep torch's cached LR in step",
    "_post_metadata_inference_cleanup": "torchtitan PP schedule: the hook our attention recorders extend",
    "_fingerprint": "torchdata/our loader state key read back from a checkpoint",
    "_exit": "os._exit: a rank that must not run atexit handlers after a bad-input stop",
    "_titan_ledger_sum_reduction": "our own marker attribute on torchtitan's parallelize function",
    "_should_save": "torchtitan's CheckpointManager: its own checkpoint-due rule, asked, not copied (issue 69)",
    "_strings": "tyro's docstring helpers: --help dedents a field docstring before tyro joins its lines",
}


def _defined_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)  # this module's own objects' attributes (another's: a reach)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.split(".")[-1])
    return out


def _reaches(tree: ast.AST) -> list[ast.Attribute]:
    own = _defined_names(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own or name in ALLOWED:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append(node)
    return out


def _hits() -> list[str]:
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        hits += [f"{path.relative_to(PKG.parent)}:{n.lineno}: .{n.attr}" for n in _reaches(tree)]
    return hits


def test_no_module_reads_another_objects_private_names():
    hits = _hits()
    assert not hits, "private names read across objects (make them public or ask through a method):\n" + \
        "\n".join(hits)


def test_the_check_finds_the_reaches_round_2_removed():
    """What trainer.py did before round 2 (a reach written, a reach read, another module's
    private function) is found; a class's own private state is not."""
    src = ("class T:\n"
           "    def f(self):\n"
           "        self.ledger._keep_ladder = True\n"
           "        self._mine = self.ledger._step_tags\n"
           "        return backend._sum_reduction(self._mine)\n")
    assert sorted(n.attr for n in _reaches(ast.parse(src))) == ["_keep_ladder", "_step_tags", "_sum_reduction"]
