"""titan_ledger.cli: one way to name the run, one way to fail."""

from __future__ import annotations

import argparse

import pytest

from titan_ledger.errors import LedgerError
from titan_ledger.tools.cli import add_dump_folder, parse_args, run_tool


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


def test_errors_are_one_line_and_their_exit_code(capsys):
    def body():
        raise LedgerError("x.jsonl: torn; do y")

    assert run_tool("titan_ledger.t", body) == 2
    assert capsys.readouterr().err == "titan_ledger.t: error: x.jsonl: torn; do y\n"
