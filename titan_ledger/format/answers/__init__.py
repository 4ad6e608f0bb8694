"""The answer, in one room: what an incident (and a run) is answered, built once, rendered
by every view.

Design decision: a flagged step used to be explained by three judges -- the proof at the
alarm, the window proof's fixes and ``diagnose``'s tree -- and its answer was built in
detection, written as JSON, rebuilt by the reader, the tree and ``diagnose``, and amended
on read. Here each concept has one table and the answer one builder:

* :mod:`.causes` -- THE table of causes and of the fixes that prove them (words, the window's
  defaults, the rerun's plan, a fix as a change to a run);
* :mod:`.records` -- the record types and their JSON (:class:`Answer`, :class:`Fix`,
  :class:`Context`);
* :mod:`.build` -- THE builder: typed inputs (the event, the :class:`ProofRecord`, a rerun's
  finding, the run's context) -> one :class:`Answer`; the trainer calls it when it decides,
  a rerun when it proves, :mod:`.of_run` for a ledger written before answers;
* :mod:`.window` (the window's re-runs as ranked fixes), :mod:`.command` (a fix as the
  relaunch that applies it), :mod:`.words` (numbers, titles, what was done);
* :mod:`.render` -- every view's words (three lines, detail, headline, columns, console);
* :mod:`.of_run` -- which answer of a step stands, read from a run's ledger.
"""

from titan_ledger.format.answers.build import RerunFinding, build, tree_candidates
from titan_ledger.format.answers.causes import CAUSES, FIXES, Change, Knobs, derive
from titan_ledger.format.answers.command import fix_command, new_dump_folder
from titan_ledger.format.answers.records import EFFECTS, ESTABLISHED, REMOVED_SHARE, Answer, Context, Fix
from titan_ledger.format.answers.words import num, times, title_of

__all__ = ["CAUSES", "EFFECTS", "ESTABLISHED", "FIXES", "REMOVED_SHARE", "Answer", "Change", "Context", "Fix", "Knobs",
           "RerunFinding", "build", "derive", "fix_command", "new_dump_folder", "num", "tree_candidates", "times",
           "title_of"]
