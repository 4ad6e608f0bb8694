"""What every titan_ledger tool does the same way: the dump-folder argument, errors, exit codes.

Design decision: each tool (lookup, diagnose, plot, rollback, replay) is a thin
``main(argv) -> int`` over library functions; this module gives them one way to
name the run (``DUMP`` positionally, ``--dump-folder`` or the trainer's own
spelling ``--dump_folder``; ``--ledger-folder`` for a non-default
``--ledger.folder``) and one way to fail: a :class:`TitanLedgerError` becomes one
line on stderr and its exit code (:mod:`titan_ledger.errors`), a closed pipe
(``| head``) ends quietly. Library code never exits, and never prints a warning:
it ``warnings.warn``s a :class:`LedgerWarning` (a torn last line), and a tool that
answers prints them all as one ``warning:`` line (none with an error line).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable

from titan_ledger.errors import EXIT_BAD_INPUT, LedgerWarning, TitanLedgerError, fail_line, os_error_line
from titan_ledger.format import records


class ToolParser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE stderr line (``prog: error: ... (see --help)``)
    and exit 2, like every other bad input; ``--help`` is unchanged."""

    @classmethod
    def for_tool(cls, module_name: str, doc: str | None, **kwargs) -> ToolParser:
        """The parser of the tool in module ``module_name`` (pass ``__name__``), built from
        its docstring ``doc`` the one way every tool's is: prog ``python -m titan_ledger.<tool>``;
        description: the docstring's first paragraph, less the lead naming the command;
        epilog: its ``Examples::`` section, as written. ``kwargs`` (``epilog=``, ...)
        override any of these."""
        tool = module_name.rsplit(".", 1)[-1]
        prog = f"python -m titan_ledger.{tool}"
        doc = doc or ""
        kwargs.setdefault("description", doc.split("\n\n")[0].removeprefix(f"``{prog}``: "))
        if "Examples::" in doc:
            kwargs.setdefault("epilog", "Examples:" + doc.split("Examples::", 1)[1])
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        return cls(prog=prog, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        prog = self.prog.removeprefix("python -m ").split()[0]
        sub = self.prog.split()[-1] if " " in self.prog.removeprefix("python -m ") else ""
        hint = f"python -m {prog}{' ' + sub if sub else ''} --help"
        print(f"{prog}: error: {message} (see {hint})", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def add_dump_folder(ap: argparse.ArgumentParser, positional: bool = True) -> None:
    """``[DUMP] | --dump-folder DUMP | --dump_folder DUMP`` and ``--ledger-folder``."""
    if positional:
        ap.add_argument("dump_pos", nargs="?", metavar="DUMP", help="the run's dump folder")
    ap.add_argument("--dump-folder", "--dump_folder", dest="dump_opt", metavar="DUMP",
                    help="the run's dump folder (the trainer's --dump_folder)")
    ap.add_argument("--ledger-folder", default=records.LEDGER_FOLDER,
                    help="ledger folder inside the dump folder (the trainer's --ledger.folder)")


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None):
    """Parse, then settle ``a.dump_folder`` from whichever form was given."""
    a = ap.parse_args(argv)
    pos, opt = getattr(a, "dump_pos", None), getattr(a, "dump_opt", None)
    if pos and opt and os.path.normpath(pos) != os.path.normpath(opt):
        ap.error(f"two dump folders given ({pos} and --dump-folder {opt}); give one")
    a.dump_folder = opt or pos
    if a.dump_folder is None and hasattr(a, "dump_opt"):
        ap.error("give the run's dump folder (DUMP or --dump-folder DUMP)")
    return a


def run_tool(prog: str, body: Callable[[], int]) -> int:
    """Run a tool's body: errors become one stderr line and an exit code; the
    :class:`LedgerWarning` s of an answer become one ``warning:`` line after it."""
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", LedgerWarning)
            show = warnings.showwarning

            def collect(message, category, *args, **kwargs):
                if issubclass(category, LedgerWarning):
                    notes.append(str(message))
                else:
                    show(message, category, *args, **kwargs)

            warnings.showwarning = collect
            code = body()
        if notes:  # a file read twice is one note
            print(f"{prog}: warning: {'; '.join(dict.fromkeys(notes))}", file=sys.stderr)
        return code
    except TitanLedgerError as e:
        print(fail_line(prog, e), file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        # the reader went away (``| head``): not an error; keep Python from
        # printing another one while flushing stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # a path that cannot be read or written: one line naming it
        line = os_error_line(e)
        if line is None:
            raise
        print(fail_line(prog, line), file=sys.stderr)
        return EXIT_BAD_INPUT
