"""The README and docs/ say only what runs: their commands, flags, links and paths.

Design decision: the documentation is tested where it can go stale. Every fenced
```bash block of README.md and docs/*.md is split into commands (backslash
continuations joined, ``&&``/``||``/``|``/``;`` split, ``#`` comments dropped, leading
``VAR=value`` words taken as the environment). Then:

- **run as written** (fast set): the cheap ones -- ``python -m titan_ledger.<tool>
  [sub] --help``, ``python -m titan_ledger.train ... --help``, ``python -m
  titan_ledger.launch ... --print ...`` and ``python scripts/make_corpus.py --check``;
  a leading ``python``/``python3``/``.venv/bin/python`` becomes ``sys.executable``.
  In the slow set: the ``fake_backend`` dry runs whose tokenizer is in the repository.
- **checked, not run**: every other command that starts titan_ledger (``python -m
  titan_ledger.X``, ``torchrun ... -m titan_ledger.train``, ``launch/*.sh``,
  ``sbatch launch/slurm.sbatch``) and the repository's scripts: the module or script
  exists, and every flag it uses is accepted -- a tool's flags appear in that tool's
  ``--help`` (its subcommand's, for ``replay``), a training flag (on a training line, or
  after ``--`` of ``launch``/``replay``/``diagnose --rerun``) is an entry of
  ``python -m titan_ledger.train --job.config_file train_configs/debug_cpu.toml --help``
  or one of the front end's own flags (``--job.*``, the old torchtitan aliases), and a
  script's flag appears in its source. The flat ``[ledger]`` spellings of earlier
  releases still parse but are not in ``--help``, so documentation using them fails.
- placeholders (``D``, ``T``, ``N``, ``<...>``, ``[...]``, ``X.toml``, ``...``,
  ``a|b``) keep a command from running; its flags are still checked.

Also: every ``--section.key`` flag anywhere in the text (prose too) is a training flag;
relative links and their #anchors resolve; repository paths in backticks exist; the
README keeps the CI commands of ``.ci/run`` and stays within 300 lines.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAIN_HELP_ARGV = ("-m", "titan_ledger.train", "--job.config_file", "train_configs/debug_cpu.toml", "--help")
#: flags the TOML front end takes itself (toml_frontend.read_job), before tyro sees the rest
FRONT_END_FLAGS = {"--job.config_file", "--job.dump_folder", "--job.overlay", "--job.module", "--job.config",
                   "--module", "--config"}
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
TORCHRUNS = {"torchrun", ".venv/bin/torchrun"}
LAUNCH_SCRIPTS = {"launch/run.sh", "launch/multinode.sh", "launch/slurm.sbatch"}


# --------------------------------------------------------------------------- parsing


@dataclass
class Command:
    file: str
    line: int
    text: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def placeholder(self) -> bool:
        return any(_is_placeholder(t) for t in self.argv)


def _is_placeholder(tok: str) -> bool:
    return ("PLACEHOLDER" in tok or "..." in tok or "…" in tok or "[" in tok or "]" in tok or "|" in tok
            or "$" in tok or "*" in tok or re.fullmatch(r"[A-Z]{1,3}|[a-z]", tok) is not None
            or re.search(r"(^|/)X\.", tok) is not None)


def _bash_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of every ```bash block."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].strip().startswith("```bash"):
            start, body = i + 2, []
            i += 1
            while not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((start, "\n".join(body)))
        i += 1
    return out


def _commands(path: Path) -> list[Command]:
    out = []
    for start, block in _bash_blocks(path):
        logical, first = "", None
        for n, raw in enumerate(block.splitlines(), start):
            first = n if first is None else first
            if raw.rstrip().endswith("\\"):
                logical += raw.rstrip()[:-1] + " "
                continue
            logical += raw
            text, logical, line = logical.strip(), "", first
            first = None
            if not text or text.startswith("#"):
                continue
            lex = shlex.shlex(re.sub(r"<[^<>]*>", "PLACEHOLDER", text), posix=True, punctuation_chars=";&")
            lex.whitespace_split, lex.commenters = True, "#"
            tokens, part = list(lex), []
            for tok in [*tokens, "&&"]:
                if tok in ("&&", "||", "|", ";", "&"):
                    env = {}
                    while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", part[0]):
                        k, _, v = part.pop(0).partition("=")
                        env[k] = v
                    if part:
                        out.append(Command(str(path.relative_to(ROOT)), line, text, part, env))
                    part = []
                else:
                    part.append(tok)
    return out


COMMANDS = [c for p in DOCS for c in _commands(p)]


def _kind(cmd: Command) -> tuple[str, str | None]:
    """(kind, name): ("tool", "lookup"), ("train", None), ("script", "bench/zoo.py"), ("other", None)."""
    a = cmd.argv
    if a[0] in PYTHONS and len(a) > 2 and a[1] == "-m":
        if a[2] == "titan_ledger.train":
            return "train", None
        if a[2].startswith("titan_ledger."):
            return "tool", a[2].removeprefix("titan_ledger.")
        return "other", None
    if a[0] in PYTHONS and len(a) > 1 and a[1].endswith(".py"):
        return "script", a[1]
    if a[0] in TORCHRUNS:
        return "torchrun", None
    if a[0] == "sbatch":
        script = next((t for t in a[1:] if t in LAUNCH_SCRIPTS), None)
        return ("launch_script", script) if script else ("other", None)
    if a[0] in LAUNCH_SCRIPTS:
        return "launch_script", a[0]
    if a[0].startswith(("bench/", "scripts/", "launch/")):
        return "script", a[0]
    return "other", None


def _flags(tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        t = t.strip("[]")
        if "PLACEHOLDER" in t:  # --<section>.<key>: not a flag
            continue
        if re.match(r"--[A-Za-z]", t) or re.fullmatch(r"-[A-Za-z]", t):
            out.append(t.split("=", 1)[0])
    return out


def _norm(flag: str) -> str:
    """tyro prints ``--ledger.doc-loss.enable``; ``--ledger.doc_loss.enable`` is the same flag."""
    return flag[:2] + flag[2:].replace("-", "_") if flag.startswith("--") else flag


# --------------------------------------------------------------------------- running


def _run(argv: tuple[str, ...], env: tuple[tuple[str, str], ...] = (), timeout: int = 300):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **dict(env)}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def _key(cmd: Command) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    return tuple(cmd.argv[1:]), tuple(sorted(cmd.env.items()))


@functools.cache
def _prefetched() -> dict:
    """Every subprocess the fast tests need, started together: most of their time is
    importing torch/torchtitan, which two cores do side by side."""
    jobs = {(TRAIN_HELP_ARGV, ())}
    for c in COMMANDS:
        kind, name = _kind(c)
        if _cheap(c):
            jobs.add(_key(c))
        if kind == "tool":
            own = c.argv[3:c.argv.index("--")] if "--" in c.argv else c.argv[3:]
            sub = own[0] if name == "replay" and own and not own[0].startswith("-") else None
            jobs.add((("-m", f"titan_ledger.{name}", *([sub] if sub else []), "--help"), ()))
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {job: pool.submit(_run, *job) for job in jobs}
        return {job: f.result() for job, f in futures.items()}


def _run_cached(argv: tuple[str, ...], env: tuple[tuple[str, str], ...] = ()):
    done = _prefetched()
    if (argv, env) not in done:
        done[(argv, env)] = _run(argv, env)
    return done[(argv, env)]


@functools.cache
def _train_flags() -> frozenset[str]:
    p = _run_cached(TRAIN_HELP_ARGV)
    assert p.returncode == 0, p.stderr[-2000:]
    flags = set()
    for line in p.stdout.splitlines():
        m = re.match(r"^│ ((?:--?[A-Za-z][\w.-]*(?:, )?)+)", line)  # a tyro entry: "│ --a.b, --a.no-b"
        if m:
            flags |= {_norm(f) for f in re.findall(r"--?[A-Za-z][\w.-]*", m.group(1))}
    assert "--ledger.spike.window" in flags, "cannot read the training flags from --help"
    from titan_ledger.config.toml_frontend import ALIASES

    return frozenset(flags | {_norm(f) for f in FRONT_END_FLAGS} | {f"--{s}.{k}" for s, k in ALIASES})


@functools.cache
def _tool_help(tool: str, sub: str | None) -> str:
    p = _run_cached(("-m", f"titan_ledger.{tool}", *([sub] if sub else []), "--help"))
    assert p.returncode == 0, f"python -m titan_ledger.{tool} {sub or ''} --help: exit {p.returncode}\n{p.stderr[-2000:]}"
    return p.stdout


def _check_train_flags(flags: list[str], where: str) -> list[str]:
    known = _train_flags()
    return [f"{where}: training flag {f} is not in `python -m titan_ledger.train --help`"
            for f in flags if _norm(f) not in known and f not in ("-h", "--help")]


# --------------------------------------------------------------------------- tests


def test_docs_have_commands():
    assert len(COMMANDS) > 40
    assert {c.file for c in COMMANDS} >= {"README.md", "docs/tools.md", "docs/running.md"}


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _kind(c)[0] != "other"], ids=lambda c: c.id)
def test_command_module_and_flags(cmd: Command):
    kind, name = _kind(cmd)
    a, errors = cmd.argv, []
    if kind == "train":
        errors += _check_train_flags(_flags(a[3:]), cmd.id)
    elif kind == "tool":
        assert (ROOT / "titan_ledger" / f"{name}.py").is_file(), f"{cmd.id}: no module titan_ledger.{name}"
        rest = a[3:]
        own, train = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
        sub = own[0] if name == "replay" and own and not own[0].startswith("-") else None
        helptext = _tool_help(name, sub)
        for f in _flags(own):
            if f not in ("-h", "--help") and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helptext):
                errors.append(f"{cmd.id}: {f} is not in `python -m titan_ledger.{name} {sub or ''} --help`")
        errors += _check_train_flags(_flags(train), cmd.id)
    elif kind == "torchrun":
        assert "-m" in a and a[a.index("-m") + 1] == "titan_ledger.train", f"{cmd.id}: torchrun of what?"
        errors += _check_train_flags(_flags(a[a.index("-m") + 2:]), cmd.id)
    elif kind == "launch_script":
        assert (ROOT / name).is_file(), f"{cmd.id}: no {name}"
        errors += _check_train_flags(_flags(a[a.index(name) + 1:]), cmd.id)
    elif kind == "script":
        path = ROOT / name
        assert path.is_file(), f"{cmd.id}: no {name}"
        src = path.read_text()
        errors += [f"{cmd.id}: {f} is not in {name}" for f in _flags(a[2:] if a[0] in PYTHONS else a[1:])
                   if f not in src and f.replace("-", "_") not in src]
    assert not errors, "\n".join(errors)


def _cheap(cmd: Command) -> bool:
    kind, name = _kind(cmd)
    if cmd.placeholder:
        return False
    if kind in ("tool", "train") and ("--help" in cmd.argv or "-h" in cmd.argv):
        return "--" not in cmd.argv or cmd.argv.index("--help") < cmd.argv.index("--")
    if kind == "tool" and name == "launch":
        return "--print" in cmd.argv or "--dry-run" in cmd.argv
    return kind == "script" and name == "scripts/make_corpus.py" and cmd.argv[2:] == ["--check"]


def _dry_run(cmd: Command) -> bool:
    a = cmd.argv
    if _kind(cmd)[0] != "train" or cmd.placeholder or "fake_backend" not in a:
        return False
    return "--hf_assets_path" in a and (ROOT / a[a.index("--hf_assets_path") + 1]).exists()


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _cheap(c)], ids=lambda c: c.id)
def test_cheap_command_runs_as_written(cmd: Command):
    p = _run_cached(*_key(cmd))
    assert p.returncode == 0, f"{cmd.id}: `{cmd.text}` exited {p.returncode}\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), f"{cmd.id}: `{cmd.text}` printed nothing"
    if "--print" in cmd.argv:
        assert "-m titan_ledger.train" in p.stdout


def test_the_cheap_set_covers_every_tool():
    ran = {_kind(c)[1] for c in COMMANDS if _cheap(c)}
    assert ran >= {"lookup", "diagnose", "rollback", "replay", "plot", "report", "prepare", "launch",
                   "scripts/make_corpus.py"}, ran
    assert any(_kind(c)[0] == "train" and _cheap(c) for c in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _dry_run(c)], ids=lambda c: c.id)
def test_gpu_dry_run_runs_as_written(cmd: Command):
    p = _run(*_key(cmd), timeout=600)
    assert p.returncode == 0, f"{cmd.id}: `{cmd.text}` exited {p.returncode}\n{p.stderr[-3000:]}"
    assert "dry run: built LedgerTrainer" in p.stdout + p.stderr


def test_every_dotted_flag_in_the_text_is_a_training_flag():
    """Prose too: ``--ledger.skip.steps`` in a sentence is a flag someone will type."""
    errors = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for f in re.findall(r"(?<![\w-])--[a-z_]+\.[a-z_][\w.-]*", line):
                errors += _check_train_flags([f.rstrip(".")], f"{path.relative_to(ROOT)}:{n}")
    assert not errors, "\n".join(errors)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    out, fence = set(), False
    for line in path.read_text().splitlines():
        fence ^= line.lstrip().startswith("```")
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_links_and_anchors_resolve():
    errors = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                errors.append(f"{path.relative_to(ROOT)}: link {target}: no {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                errors.append(f"{path.relative_to(ROOT)}: link {target}: no heading #{anchor} in {file or path.name}")
    assert not errors, "\n".join(errors)


def test_repository_paths_in_backticks_exist():
    errors = []
    for path in DOCS:
        for theirs, p in re.findall(r"(torchtitan's )?`((?:titan_ledger|tests|bench|launch|train_configs|scripts|"
                                    r"docs|\.ci)/[\w./-]*)`", path.read_text()):
            p = p.rstrip("/")
            if theirs:  # torchtitan's `scripts/download_hf_assets.py`: in torchtitan's repository
                continue
            if not ((ROOT / p).exists() or (ROOT / f"{p}.py").exists()):
                errors.append(f"{path.relative_to(ROOT)}: `{p}` does not exist")
    assert not errors, "\n".join(errors)


def test_readme_is_the_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    ci = (ROOT / ".ci" / "run").read_text()
    readme_cmds = {c.text for c in COMMANDS if c.file == "README.md"}
    # the README's two commands: one trains, one runs what CI runs (install, lint, tests) in one line
    ci_line = ("python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/ruff check . && "
               ".venv/bin/lint-imports && .venv/bin/python -m pytest")
    assert ci_line in readme_cmds, f"README lost the CI command: {ci_line}"
    blocks = text.split("## Two commands", 1)[1].split("\n## ", 1)[0].count("```bash")
    assert blocks == 2, f"README's 'Two commands' holds {blocks} command blocks"
    for part in ("python3 -m venv .venv && .ci/install",
                 ".venv/bin/ruff check . && .venv/bin/lint-imports", ".venv/bin/python -m pytest"):
        assert part in ci, f".ci/run no longer runs what the README says: {part}"
    # .ci/install is the README's `pip install -e '.[dev]'` through uv, with pip as the fallback
    install = (ROOT / ".ci" / "install").read_text()
    assert "uv pip install \"${flags[@]}\" -e '.[dev]'" in install and "pip install -e '.[dev]'" in install
    for page in ("toml", "ledgers", "tools", "spike-response", "data", "benchmarks", "architecture", "development"):
        assert f"](docs/{page}.md" in text, f"README does not link docs/{page}.md"
