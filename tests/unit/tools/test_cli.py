"""titan_ledger.tools.cli: one way to name the run, one way to fail."""

from __future__ import annotations

import argparse
import importlib

import pytest

from titan_ledger.errors import LedgerError
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool


def _ap(positional=True):
    ap = argparse.ArgumentParser(prog="t")
    add_dump_folder(ap, positional)
    return ap


@pytest.mark.parametrize("argv", [["d"], ["--dump-folder", "d"], ["--dump_folder", "d"], ["d", "--dump-folder", "d/"]])
def test_every_spelling_of_the_dump_folder(argv):
    assert parse_args(_ap(), argv).dump_folder.rstrip("/") == "d"


def test_two_different_folders_or_none_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        parse_args(_ap(), ["a", "--dump-folder", "b"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(_ap(positional=False), [])


def test_a_tool_parser_is_built_from_its_module_and_docstring():
    doc = "``python -m titan_ledger.plot``: does a thing.\n\nMore.\n\nExamples::\n\n    python -m titan_ledger.plot d\n"
    ap = ToolParser.for_tool("titan_ledger.tools.plot", doc)
    assert ap.prog == "python -m titan_ledger.plot"
    assert ap.description == "does a thing."
    assert ap.epilog == "Examples:\n\n    python -m titan_ledger.plot d\n"
    assert ap.formatter_class is argparse.RawDescriptionHelpFormatter
    assert ToolParser.for_tool("titan_ledger.tools.plot", doc, epilog="e").epilog == "e"
    assert ToolParser.for_tool("titan_ledger.tools.plot", "no lead.").epilog is None


@pytest.mark.parametrize("tool", ["replay", "diagnose", "report", "plot", "export", "lookup", "prepare", "rollback"])
def test_every_tool_help_names_its_command_once_and_says_what_it_does(tool, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"titan_ledger.tools.{tool}").main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert usage.startswith(f"usage: python -m titan_ledger.{tool} ")
    description = rest.split("\n\n")[0]
    assert description and "python -m" not in description and not description.startswith(("positional", "options"))


def test_errors_are_one_line_and_their_exit_code(capsys):
    def body():
        raise LedgerError("x.jsonl: torn; do y")

    assert run_tool("titan_ledger.t", body) == 2
    assert capsys.readouterr().err == "titan_ledger.t: error: x.jsonl: torn; do y\n"


def test_ledger_warnings_are_one_line_after_an_answer_and_none_with_an_error(capsys):
    """Issue 26: library code warns (LedgerWarning); run_tool prints them as ONE line."""
    import warnings

    from titan_ledger.errors import LedgerWarning

    def answer():
        for msg in ("a.jsonl:9: torn last line skipped", "b.jsonl:3: torn last line skipped",
                    "a.jsonl:9: torn last line skipped"):  # a file read twice: one note
            warnings.warn(LedgerWarning(msg), stacklevel=1)
        print("the answer")
        return 0

    assert run_tool("titan_ledger.t", answer) == 0
    out, err = capsys.readouterr()
    assert out == "the answer\n"
    assert err == ("titan_ledger.t: warning: a.jsonl:9: torn last line skipped; "
                   "b.jsonl:3: torn last line skipped\n")

    def fails():
        warnings.warn(LedgerWarning("a.jsonl:9: torn last line skipped"), stacklevel=1)
        raise LedgerError("c.jsonl:4: not a ledger row (not JSON)")

    assert run_tool("titan_ledger.t", fails) == 2
    assert capsys.readouterr().err == "titan_ledger.t: error: c.jsonl:4: not a ledger row (not JSON)\n"
