"""TOML front end for torchtitan 0.3.0's Python-function configs.

Design decision: TOML is *translated into command-line flags*, never applied to the
config object directly. torchtitan 0.3.0 has no TOML; its configs are Python
functions (``--module M --config fn``) whose result tyro then overrides from
``--section.field`` flags. We read the TOML, check each key against the base
config's dataclasses (to name the file, section and key in errors), turn it into
flags, and hand ``[toml flags] + [command-line flags]`` to torchtitan's
``ConfigManager``. tyro therefore validates every key and type exactly as it would
on the command line, and "CLI > TOML > base function" is just argparse's
last-flag-wins.

The schema: a TOML table path is a config field path (``[training] steps = 10`` is
``--training.steps 10``; ``[optimizer.param_groups.0.optimizer_kwargs] lr = 3e-4`` is
``--optimizer.param_groups.0.optimizer_kwargs.lr 3e-4``); keys outside any table
are top-level fields (``hf_assets_path``). ``[job]`` holds what is not a config
field: ``module``/``config`` (the base function), ``description``, and the old
torchtitan keys ``dump_folder`` and ``print_config``. A few other torchtitan
TOML-era keys are accepted as aliases (see ``ALIASES``).

This module imports no torchtitan at module level: ``read_job`` runs before the
device backend is installed (the backend must precede torchtitan's import).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli

DEFAULT_MODULE = "titan_ledger"
DEFAULT_CONFIG = "debug_cpu"

#: ``[job]`` keys. Values are the config path they set, or None for job-only keys.
JOB_KEYS: dict[str, str | None] = {
    "module": None,
    "config": None,
    "description": None,
    "dump_folder": "dump_folder",
    "print_config": "debug.print_config",
    # the W&B run's identity (titan_ledger.components.ledger.dashboards); WANDB_RUN_* variables win
    "name": None,
    "tags": None,
    "notes": None,
    "group": None,
}

#: Old torchtitan TOML keys (section, key) -> config path in torchtitan 0.3.0.
ALIASES: dict[tuple[str, str], str] = {
    ("model", "hf_assets_path"): "hf_assets_path",
    ("model", "tokenizer_path"): "hf_assets_path",
    ("training", "dataset"): "dataloader.dataset",
    ("training", "dataset_path"): "dataloader.dataset_path",
    ("optimizer", "lr"): "optimizer.param_groups.0.optimizer_kwargs.lr",
    ("optimizer", "eps"): "optimizer.param_groups.0.optimizer_kwargs.eps",
    ("optimizer", "weight_decay"): "optimizer.param_groups.0.optimizer_kwargs.weight_decay",
    ("optimizer", "betas"): "optimizer.param_groups.0.optimizer_kwargs.betas",
    ("optimizer", "name"): "optimizer.param_groups.0.optimizer_name",
}

#: ``[activation_checkpoint] mode`` values -> torchtitan's tyro subcommand names.
AC_MODES = {"selective": "selective", "full": "full", "memory_budget": "memory-budget",
            "none": "none"}
AC_SUBCOMMAND_PREFIX = "activation-checkpoint:"


from titan_ledger.errors import ConfigError  # noqa: E402  (one error hierarchy)


@dataclass
class Job:
    """What the command line and the TOML file say, before torchtitan is imported."""

    module: str = DEFAULT_MODULE
    config: str = DEFAULT_CONFIG
    config_file: str | None = None
    description: str | None = None
    doc: dict[str, Any] = field(default_factory=dict)
    cli_args: list[str] = field(default_factory=list)
    device: str | None = None
    device_origin: str = ""
    overlays: list[str] = field(default_factory=list)
    #: (section, key) -> the overlay file that set it (errors name the right file)
    key_files: dict[tuple[str | None, str], str] = field(default_factory=dict)

    def where(self, section: str | None, key: str) -> str:
        sec = f"[{section}] " if section else ""
        return f"{self.key_files.get((section, key), self.config_file)}: {sec}{key}"


# --------------------------------------------------------------------------- #
# Stage 1: command line + TOML file, no torchtitan.
# --------------------------------------------------------------------------- #


def _take_flag(args: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """Remove ``--name V`` / ``--name=V`` (last one wins) from args."""
    values, rest = _take_all(args, names)
    return (values[-1] if values else None), rest


def _peek_flag(args: list[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _take_all(args: list[str], names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Remove every ``--name V`` / ``--name=V`` (a repeatable flag); values in order."""
    values, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        hit = next((n for n in names if a == n or a.startswith(n + "=")), None)
        if hit is None:
            rest.append(a)
        elif a == hit:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"command line: {hit} needs a value")
            values.append(args[i + 1])
            i += 1
        else:
            values.append(a.split("=", 1)[1])
        i += 1
    return values, rest


def _merge(base: dict, over: dict, origins: dict, path: str, section: str | None) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, origins, path, f"{section}.{key}" if section else key)
        else:
            base[key] = value
            origins[(section, key)] = path


def load_toml(path: str, flag: str = "--job.config_file") -> dict[str, Any]:
    """Read one TOML file; errors name ``flag``, the flag that gave the path (a config
    file, or an ``--job.overlay``)."""
    p = Path(path)
    if not p.is_file():
        where = "configs live in train_configs/" if flag == "--job.config_file" else \
            "an overlay is a TOML file of config sections, e.g. the one rollback --write wrote"
        raise ConfigError(f"{path}: no such config file (check {flag}; {where})")
    try:
        with p.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e} (check {flag})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (TOML is UTF-8 text); check "
                          f"{flag}") from None


def read_job(argv: list[str]) -> Job:
    """Split the command line, read the TOML file, pick base config and device."""
    job = Job()
    config_file, args = _take_flag(list(argv), ("--job.config_file", "--job.config-file"))
    module_cli, args = _take_flag(args, ("--module", "--job.module"))
    config_cli, args = _take_flag(args, ("--config", "--job.config"))
    dump_cli, args = _take_flag(args, ("--job.dump_folder", "--job.dump-folder"))
    overlays, args = _take_all(args, ("--job.overlay",))
    if dump_cli is not None:
        args = ["--dump_folder", dump_cli] + args
    job.cli_args = args
    if config_file is not None:
        job.config_file = config_file
        job.doc = load_toml(config_file)
        if not job.doc:  # a truncated or placeholder file must not train the base config silently
            raise ConfigError(f"{config_file}: holds no settings (empty, or only comments); write the "
                              f"keys to set (at least [job] config = \"...\"), or drop --job.config_file "
                              f"to train the base config {DEFAULT_MODULE}.{DEFAULT_CONFIG}")
        jsec = job.doc.get("job", {})
        if not isinstance(jsec, dict):
            raise ConfigError(f"{config_file}: 'job' must be a table ([job])")
        for key, value in jsec.items():
            if key not in JOB_KEYS:
                raise ConfigError(
                    f"{job.where('job', key)}: unknown key{_suggest(key, JOB_KEYS)}; "
                    f"[job] takes {', '.join(JOB_KEYS)}"
                )
        for key in ("module", "config", "description"):
            if key in jsec and not isinstance(jsec[key], str):
                raise ConfigError(f"{job.where('job', key)}: must be a string")
        job.module = jsec.get("module", job.module)
        job.config = jsec.get("config", job.config)
        job.description = jsec.get("description")
    for path in overlays:  # e.g. titan_ledger.rollback --write: later files win
        over = load_toml(path, "--job.overlay")
        if "job" in over:
            raise ConfigError(f"{path}: an overlay cannot set [job]; it only overrides config sections")
        _merge(job.doc, over, job.key_files, path, None)
        job.overlays.append(path)
        if job.config_file is None:
            job.config_file = path
    job.module = module_cli or job.module
    job.config = config_cli or job.config

    # The backend has to be chosen before torchtitan is imported, so the device is
    # read here; tyro still validates --ledger.device later.
    cli_device = _peek_flag(args, "--ledger.device")
    toml_device = job.doc.get("ledger", {}).get("device") if isinstance(
        job.doc.get("ledger"), dict) else None
    if cli_device is not None:
        job.device, job.device_origin = cli_device, "command line: --ledger.device"
    elif toml_device is not None:
        job.device, job.device_origin = toml_device, job.where("ledger", "device")
    elif os.environ.get("TITAN_LEDGER_DEVICE"):
        job.device = os.environ["TITAN_LEDGER_DEVICE"]
        job.device_origin = "environment: TITAN_LEDGER_DEVICE"
    if job.device is not None and job.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{job.device_origin}: {job.device!r} is not one of auto, cpu, cuda")
    return job


# --------------------------------------------------------------------------- #
# Stage 2: TOML -> flags, checked against the base config's dataclasses.
# --------------------------------------------------------------------------- #


def _suggest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.init and not f.name.startswith("_")]


def _annotation(obj: Any, name: str) -> Any:
    try:
        return typing.get_type_hints(type(obj)).get(name)
    except Exception:  # forward refs torchtitan never resolves; tyro still checks
        return None


def _is_str_list(ann: Any) -> bool:
    ann = _strip_optional(ann)
    return typing.get_origin(ann) is list and typing.get_args(ann) == (str,)


def _strip_optional(ann: Any) -> Any:
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    args = typing.get_args(ann)
    if args and type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return ann


_SIMPLE = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


def _check_type(value: Any, ann: Any, where: str) -> None:
    """Catch the common TOML type slips early with a TOML-shaped message."""
    ann = _strip_optional(ann)
    if typing.get_origin(ann) is typing.Literal:
        choices = typing.get_args(ann)
        if value not in choices:
            raise ConfigError(f"{where} = {value!r}: must be one of {', '.join(map(repr, choices))}")
        return
    members = [a for a in typing.get_args(ann) if a is not type(None)] if _is_union(ann) else [ann]
    if not members or not all(m in _SIMPLE for m in members):
        return  # containers, nested unions: tyro decides
    ok = tuple(t for m in members for t in _SIMPLE[m])
    if isinstance(value, bool) and bool not in members:
        ok = ()
    if not isinstance(value, ok):
        expected = " or ".join(m.__name__ for m in members)
        raise ConfigError(
            f"{where} = {value!r}: expected {expected}, got {type(value).__name__}"
            + (" (quote strings, e.g. key = \"value\")" if str in members else "")
        )


def _is_union(ann: Any) -> bool:
    import types as _types

    return typing.get_origin(ann) in (typing.Union, _types.UnionType)


def _flag_tokens(path: str, value: Any, ann: Any) -> list[str]:
    flag = "--" + path
    if isinstance(value, bool):
        if value:
            return [flag]
        head, _, last = path.rpartition(".")
        return ["--" + (f"{head}.no_{last}" if head else f"no_{last}")]
    if isinstance(value, (list, tuple)):
        if _is_str_list(ann):
            return [flag, ",".join(str(v) for v in value)]
        return [flag, *(_scalar(v) for v in value)]
    return [flag, _scalar(value)]


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


@dataclass
class Translation:
    """TOML translated to flags; ``origins`` maps each flag to where it came from."""

    args: list[str] = field(default_factory=list)
    ac_subcommand: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)


def translate(job: Job, base: Any, ac_configs: dict[str, Any] | None = None) -> Translation:
    """Turn ``job.doc`` into flags for ``base`` (a Trainer config instance).

    ``ac_configs`` maps ``[activation_checkpoint] mode`` names to a default config
    instance of that policy (None for "none"), used to check the section's keys.
    """
    out = Translation()
    doc = job.doc
    for key, value in doc.items():
        if key == "job":
            for jkey, jval in value.items():
                target = JOB_KEYS[jkey]
                if target is not None:
                    _emit(out, job, base, target, jval, job.where("job", jkey))
        elif key == "activation_checkpoint" and isinstance(value, dict) and "mode" in value:
            _translate_ac(out, job, value, ac_configs or {})
        elif isinstance(value, dict):
            _walk(out, job, base, key, value, section=key)
        else:
            _emit(out, job, base, key, value, job.where(None, key))
    return out


def _walk(out: Translation, job: Job, base: Any, path: str, table: dict, section: str) -> None:
    from titan_ledger.format.spellings import renamed_table

    for key, value in table.items():
        if section.startswith("ledger.") and not isinstance(value, dict):
            new = renamed_table(section[len("ledger."):], key)
            if new is not None:  # an old spelling of the response's sections: refused, the new one named
                raise ConfigError(f"{job.where(section, key)} was renamed: write {new} (docs/toml.md)")
        # an old torchtitan key ([model] tokenizer_path) is an alias of its 0.3.0 path
        alias = None if isinstance(value, dict) else ALIASES.get((section, key))
        sub = alias or f"{path}.{key}"
        if isinstance(value, dict) and alias is None:
            _walk(out, job, base, sub, value, section=f"{section}.{key}")
        else:
            _emit(out, job, base, sub, value, job.where(section, key))


def _resolve(base: Any, path: str, where: str) -> tuple[Any, Any]:
    """Follow ``path`` through dataclasses/lists/dicts; return (parent, annotation)."""
    obj, ann = base, None
    parts = path.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            names = _field_names(obj)
            if part not in names:
                what = "section" if (i == 0 and not last) else "key"
                scope = ".".join(parts[:i]) or "the top level"
                raise ConfigError(
                    f"{where}: unknown {what} '{part}' in {scope}{_suggest(part, names)}"
                )
            ann = _annotation(obj, part)
            child = getattr(obj, part)
        elif isinstance(obj, (list, tuple)):
            if not part.isdigit() or int(part) >= len(obj):
                raise ConfigError(f"{where}: '{part}' is not an index of a {len(obj)}-element list")
            child, ann = obj[int(part)], None
        elif isinstance(obj, dict):
            if part not in obj:
                raise ConfigError(
                    f"{where}: unknown key '{part}'{_suggest(part, obj)}; known: {', '.join(obj)}"
                )
            child, ann = obj[part], None
        else:
            raise ConfigError(f"{where}: '{'.'.join(parts[:i])}' is a value, not a section")
        if last:
            return child, ann
        obj = child
    return obj, ann


def _emit(out: Translation, job: Job, base: Any, path: str, value: Any, where: str) -> None:
    current, ann = _resolve(base, path, where)
    if isinstance(value, dict):
        raise ConfigError(f"{where}: is a value, not a table")
    if dataclasses.is_dataclass(current) and not isinstance(current, type):
        raise ConfigError(f"{where}: is a section; write [{path}] and its keys")
    if ann is not None:
        _check_type(value, ann, where)
    elif current is not None and not isinstance(current, (list, tuple, dict)):
        _check_type(value, type(current), where)
    tokens = _flag_tokens(path, value, ann)
    out.args += tokens
    out.origins[tokens[0].lstrip("-")] = where


def _translate_ac(out: Translation, job: Job, table: dict, ac_configs: dict[str, Any]) -> None:
    mode = table["mode"]
    where = job.where("activation_checkpoint", "mode")
    if mode not in AC_MODES:
        raise ConfigError(f"{where} = {mode!r}: must be one of {', '.join(map(repr, AC_MODES))}")
    out.ac_subcommand = [AC_SUBCOMMAND_PREFIX + AC_MODES[mode]]
    policy = ac_configs.get(mode)
    for key, value in table.items():
        if key == "mode":
            continue
        kwhere = job.where("activation_checkpoint", key)
        if policy is None:
            raise ConfigError(f"{kwhere}: mode {mode!r} takes no other keys")
        names = _field_names(policy)
        if key not in names:
            raise ConfigError(f"{kwhere}: unknown key for mode {mode!r}{_suggest(key, names)}")
        ann = _annotation(policy, key)
        _check_type(value, ann, kwhere)
        tokens = _flag_tokens(f"activation_checkpoint.{key}", value, ann)
        out.ac_subcommand += tokens
        out.origins[tokens[0].lstrip("-")] = kwhere


def alias_cli(args: list[str]) -> list[str]:
    """Rewrite old torchtitan flags (``--optimizer.lr``) to their 0.3.0 paths."""
    flat = {f"--{sec}.{key}": "--" + target for (sec, key), target in ALIASES.items()}
    out = []
    for a in args:
        name, eq, value = a.partition("=")
        key = "--" + name[2:].replace("-", "_") if name.startswith("--") else name  # tyro takes both
        out.append(flat[key] + eq + value if key in flat else a)
    return out


def assemble(tr: Translation, cli_args: list[str]) -> list[str]:
    """TOML flags, then CLI flags (CLI wins), then the AC subcommand (tyro wants it last)."""
    from titan_ledger.format.spellings import refuse_renamed

    refuse_renamed(cli_args)  # an old spelling of the response's flags: one line naming the new one
    cli_args = alias_cli(cli_args)
    cut = next((i for i, a in enumerate(cli_args) if a.startswith(AC_SUBCOMMAND_PREFIX)), None)
    if cut is None:
        return tr.args + cli_args + tr.ac_subcommand
    return tr.args + cli_args[:cut] + cli_args[cut:]


# --------------------------------------------------------------------------- #
# Stage 3: torchtitan's ConfigManager (needs the backend installed).
# --------------------------------------------------------------------------- #


def parse(job: Job) -> Any:
    """Build the final config through torchtitan's ConfigManager/tyro."""
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    # [dataloader] source on a base built around torchtitan's own loader: LedgerDataLoader.Config
    # in its place, for the key checks here and in the config tyro parses
    manager = _config_manager(swap_loader=wants_ledger_dataloader(job))
    where = job.where("job", "config") if job.config_file else "command line: --config"
    try:
        with _quiet_default_warning():
            base = manager.load_base(job.module, job.config)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{where}: cannot load base config {job.module}.{job.config}: {e}") from None

    tr = translate(job, base, {"selective": SelectiveAC.Config(), "full": FullAC.Config(),
                               "memory_budget": MemoryBudgetAC.Config(), "none": None})
    argv = ["--module", job.module, "--config", job.config] + assemble(tr, job.cli_args)
    if any(a in ("-h", "--help") for a in job.cli_args):
        paragraphs_in_help()
        return manager.parse_args(argv)  # tyro prints help (TOML values as defaults) and exits
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), _wide_terminal(), _quiet_default_warning():
            return manager.parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        # A flag given on the command line too is the command line's doing.
        cli = {a.split("=")[0].lstrip("-").replace("-", "_") for a in job.cli_args if a.startswith("--")}
        origins = {k: v for k, v in tr.origins.items() if k.replace("-", "_") not in cli}
        raise ConfigError(_explain_tyro(err.getvalue(), origins)) from None


def _config_manager(swap_loader: bool) -> Any:
    """torchtitan's ``ConfigManager``; with ``swap_loader`` every base config it loads
    (``--module M --config fn``) has ``LedgerDataLoader.Config`` in place of its loader
    config (``as_ledger_dataloader``) before tyro parses the flags against it.

    tyro takes the loaded config's runtime types (``Trainer.Config.dataloader`` is
    annotated ``BaseDataLoader.Config``), so the swap cannot wait until after
    ``parse_args``: ``--dataloader.source`` and the other LedgerDataLoader fields would
    be unknown flags. torchtitan's ``@override`` mechanism (``--override.imports``)
    swaps a Configurable's Config too, but in ``Trainer.__init__``, after parsing.
    """
    from torchtitan.config import ConfigManager

    class LedgerConfigManager(ConfigManager):
        def load_base(self, module: str, config: str) -> Any:
            """The base config ``parse_args`` starts from (the TOML keys are checked on it)."""
            return self._load_config(["--module", module, "--config", config])[0]

        # CHANGED from torchtitan (no public hook: ConfigManager.parse_args resolves
        # --module/--config in _load_config and hands the result to tyro.cli as type and
        # default in the same call; _load_config is the only step between the two)
        def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
            config, rest = super()._load_config(args)
            if swap_loader:
                from titan_ledger.data.loader import as_ledger_dataloader

                as_ledger_dataloader(config)
            return config, rest

    return LedgerConfigManager()


def wants_ledger_dataloader(job: Job) -> bool:
    """``[dataloader] source`` in the TOML/overlays or ``--dataloader.source`` on the
    command line: the run asks for titan_ledger's loader, whatever the base config."""
    sec = job.doc.get("dataloader")
    return ((isinstance(sec, dict) and "source" in sec)
            or _peek_flag(job.cli_args, "--dataloader.source") is not None)


@contextlib.contextmanager
def _quiet_default_warning():
    # torchtitan's CheckpointManager.Config warns about its own default
    # (initial_load_model_only=True) every time a config is built: noise, not news.
    import logging

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("initial_load_model_only=True has no effect")

    loggers = [logging.getLogger(), logging.getLogger("torchtitan")]
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def paragraphs_in_help() -> None:
    """``--help`` renders a field's docstring as paragraphs, as written. CHANGED from tyro
    1.0: ``get_field_docstring`` joins a docstring's single line breaks before it dedents
    it, and joins a line only when it starts with a letter -- an attribute docstring's
    continuation lines start with its indentation, so every hard line break was kept and
    each wrapped again ("one contract for every automatic / action."). Dedenting first
    (``inspect.cleandoc``) lets tyro's own rule join them: a blank line still ends a
    paragraph, a line that starts with ``-``, ``*`` or a digit still starts a new one."""
    import inspect

    import tyro._docstrings as docstrings

    strings = docstrings._strings
    if getattr(strings.remove_single_line_breaks, "titan_ledger", False):
        return
    original = strings.remove_single_line_breaks

    def dedented_first(helptext: str) -> str:
        # (tyro's join leaves three line breaks at a blank line: one blank line between paragraphs)
        return re.sub(r"\n{3,}", "\n\n", original(inspect.cleandoc(helptext)))

    dedented_first.titan_ledger = True  # type: ignore[attr-defined]
    strings.remove_single_line_breaks = dedented_first
    docstrings.get_field_docstring.cache_clear() if hasattr(docstrings.get_field_docstring, "cache_clear") else None


@contextlib.contextmanager
def _wide_terminal():
    # tyro wraps its error box at the terminal width; a wide one keeps lines whole.
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "400"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


_BOX = re.compile(r"^[\s│╭╮╰╯─┃]+|[\s│╭╮╰╯─┃]+$")


def _explain_tyro(text: str, origins: dict[str, str]) -> str:
    """Condense tyro's boxed error into one line naming the TOML key or CLI flag."""
    lines = [_BOX.sub("", ln) for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("For full helptext", "Argument helptext"))]
    lines = lines[1:]  # the box title only repeats the kind of error
    body = next((ln for ln in lines if ln.startswith(("Error parsing", "Unrecognized", "invalid choice",
                                                       "Missing", "Expected"))), None)
    if body is None:
        body = lines[1] if len(lines) > 1 else (lines[0] if lines else "invalid arguments")
    hint = ""
    if body.startswith("Unrecognized"):
        idx = lines.index(body)
        if body.rstrip().endswith(":") and idx + 1 < len(lines):
            body = f"{body} {lines[idx + 1]}"
        close = next((lines[i + 1] for i, ln in enumerate(lines[:-1]) if ln.startswith("Perhaps you meant")), None)
        if close:
            hint = f" (did you mean {close.split()[0].rstrip(',')}?)"
    for flag in re.findall(r"--([A-Za-z0-9_.\-]+)", body):
        key = flag.split("=")[0]
        origin = origins.get(key) or origins.get(key.replace("-", "_"))
        if origin:
            return f"{origin}: {body}{hint}"
    return f"command line: {body}{hint}"


def check_world_size(config: Any, world_size: int) -> None:
    """Parallel degrees must multiply to the world size (before any process group)."""
    p = config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    fixed = 1
    for name, d in degrees.items():
        if name == "data_parallel_shard_degree" and d == -1:
            continue
        if d < 1:
            raise ConfigError(f"--parallelism.{name} {d}: degrees must be >= 1 (or -1 for dp_shard)")
        fixed *= d
    shown = " x ".join(f"{k.replace('_degree', '')}={v}" for k, v in degrees.items() if v != 1)
    if degrees["data_parallel_shard_degree"] == -1:
        if world_size % fixed:
            raise ConfigError(
                f"--parallelism.*: {shown or 'degrees'} (product {fixed}) does not divide the "
                f"world size {world_size}; change the degrees or --nproc_per_node/--nnodes"
            )
        return
    if fixed != world_size:
        raise ConfigError(
            f"--parallelism.*: {shown or 'all degrees 1'} multiply to {fixed}, but the world size is "
            f"{world_size}; make them multiply to {world_size} (or set "
            f"--parallelism.data_parallel_shard_degree -1 to fill), or launch {fixed} processes"
        )


def world_size_from_env(config: Any) -> int:
    if getattr(config.comm, "mode", "default") in ("fake_backend", "local_tensor"):
        return int(os.environ.get("NGPU", "1"))
    return int(os.environ.get("WORLD_SIZE", "1"))

