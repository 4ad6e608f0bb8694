"""TOML -> torchtitan flags: schema, precedence and one-line errors (no processes)."""

import textwrap

import pytest

from titan_ledger import config_registry
from titan_ledger.config.toml_frontend import (
    ConfigError,
    Job,
    assemble,
    check_world_size,
    parse,
    read_job,
    translate,
)
from titan_ledger.trainer import LedgerTrainer


def _write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def _job(tmp_path, text, *cli):
    return read_job(["--job.config_file", _write(tmp_path, text), *cli])


def test_sections_map_to_flags(tmp_path):
    job = _job(
        tmp_path,
        """
        hf_assets_path = "/tok"
        [job]
        dump_folder = "/out"
        print_config = true
        [training]
        steps = 7
        max_norm = 0.5
        [checkpoint]
        enable = false
        [compile]
        components = ["model", "loss"]
        [optimizer]
        lr = 1e-3
        [optimizer.param_groups.0.optimizer_kwargs]
        eps = 1e-6
        [activation_checkpoint]
        mode = "full"
        """,
    )
    tr = translate(job, config_registry.debug_cpu())
    args = assemble(tr, [])
    assert args[:2] == ["--hf_assets_path", "/tok"]
    for pair in (
        ["--dump_folder", "/out"],
        ["--training.steps", "7"],
        ["--training.max_norm", "0.5"],
        ["--compile.components", "model,loss"],
        ["--optimizer.param_groups.0.optimizer_kwargs.lr", "0.001"],
        ["--optimizer.param_groups.0.optimizer_kwargs.eps", "1e-06"],
    ):
        i = args.index(pair[0])
        assert args[i : i + 2] == pair
    assert "--debug.print_config" in args
    assert "--checkpoint.no_enable" in args
    assert args[-1] == "activation-checkpoint:full"  # tyro wants the subcommand last
    assert tr.origins["training.steps"].endswith("job.toml: [training] steps")


def test_precedence_cli_over_toml_over_base(tmp_path):
    base = config_registry.debug_cpu()
    job = _job(
        tmp_path,
        """
        [training]
        steps = 7
        seq_len = 128
        [activation_checkpoint]
        mode = "full"
        """,
        "--training.steps",
        "9",
    )
    config = parse(job)
    assert isinstance(config, LedgerTrainer.Config)
    assert config.training.steps == 9  # CLI
    assert config.training.seq_len == 128  # TOML
    assert config.training.local_batch_size == base.training.local_batch_size  # base fn
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"


def test_old_flags_work_on_the_command_line_too(tmp_path):
    job = _job(tmp_path, "[optimizer]\nlr = 1e-3\n", "--optimizer.lr=2e-3", "--training.dataset_path", "/d")
    config = parse(job)
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 2e-3
    assert config.dataloader.dataset_path == "/d"


def test_cli_subcommand_overrides_toml_mode(tmp_path):
    job = _job(tmp_path, '[activation_checkpoint]\nmode = "full"\n', "activation-checkpoint:none")
    assert parse(job).activation_checkpoint is None


def test_module_and_config_from_cli_without_toml():
    config = parse(read_job(["--module", "titan_ledger", "--config", "debug_cpu", "--training.steps", "3"]))
    assert config.training.steps == 3
    assert config._owner is LedgerTrainer  # build() makes a LedgerTrainer


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[trainin]\nsteps = 1\n", r"job.toml: \[trainin\] steps: unknown section 'trainin'.*did you mean 'training'"),
        ("[training]\nstepz = 1\n", r"job.toml: \[training\] stepz: unknown key 'stepz'.*did you mean 'steps'"),
        ('[training]\nsteps = "ten"\n', r"job.toml: \[training\] steps = 'ten': expected int, got str"),
        ("[training]\nmax_norm = true\n", r"\[training\] max_norm = True: expected float or int, got bool"),
        ('[training]\ndtype = "fp8"\n', r"\[training\] dtype = 'fp8': must be one of 'bfloat16', 'float32'"),
        ("[job]\nconfig = \"nope_9b\"\n", r"job.toml: \[job\] config: cannot load base config titan_ledger.nope_9b.*Available config functions: \[.*'debug_cpu'"),
        ("[job]\nconfigg = \"x\"\n", r"\[job\] configg: unknown key \(did you mean 'config'\?\)"),
        ('[activation_checkpoint]\nmode = "half"\n', r"\[activation_checkpoint\] mode = 'half': must be one of"),
        ("[training]\n[training.steps]\nx = 1\n", r"\[training.steps\] x: 'training.steps' is a value, not a section"),
    ],
)
def test_bad_toml_names_file_section_and_key(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        parse(_job(tmp_path, text))


def test_malformed_toml_gives_line(tmp_path):
    with pytest.raises(ConfigError, match=r"job.toml: malformed TOML: .*line 3"):
        _job(tmp_path, "[training]\nsteps = 1\nseq_len = \n")


def test_missing_file():
    with pytest.raises(ConfigError, match=r"nope.toml: no such config file .*--job.config_file"):
        read_job(["--job.config_file", "nope.toml"])


def test_cli_errors_come_from_tyro_and_name_the_flag(tmp_path):
    job = _job(tmp_path, "[training]\nsteps = 1\n", "--training.stepz", "3")
    with pytest.raises(ConfigError, match=r"command line: Unrecognized options: --training.stepz.*did you mean --training.steps"):
        parse(job)
    job = _job(tmp_path, "[training]\nsteps = 1\n", "--training.steps", "x")
    with pytest.raises(ConfigError, match=r"command line: Error parsing --training.steps: invalid literal"):
        parse(job)


def test_tyro_errors_on_toml_values_point_at_the_toml_key(tmp_path):
    # A list of floats where tyro wants floats: our pre-check lets it through,
    # tyro rejects it, and the message still names the TOML key.
    job = _job(tmp_path, '[optimizer]\nbetas = ["a", "b"]\n')
    with pytest.raises(ConfigError, match=r"job.toml: \[optimizer\] betas: Error parsing --optimizer.param-groups.0.optimizer-kwargs.betas"):
        parse(job)


def test_device_is_read_before_torchtitan(tmp_path):
    assert _job(tmp_path, '[ledger]\ndevice = "cpu"\n').device == "cpu"
    assert _job(tmp_path, '[ledger]\ndevice = "cpu"\n', "--ledger.device", "cuda").device == "cuda"
    with pytest.raises(ConfigError, match=r"\[ledger\] device: 'gpu' is not one of auto, cpu, cuda"):
        _job(tmp_path, '[ledger]\ndevice = "gpu"\n')


@pytest.mark.parametrize(
    "degrees,world,ok",
    [
        (dict(data_parallel_shard_degree=2), 2, True),
        (dict(data_parallel_shard_degree=-1, tensor_parallel_degree=2), 4, True),
        (dict(data_parallel_shard_degree=2, tensor_parallel_degree=2), 2, False),
        (dict(data_parallel_shard_degree=-1, pipeline_parallel_degree=3), 4, False),
    ],
)
def test_parallel_degrees_must_multiply_to_world_size(degrees, world, ok):
    config = config_registry.debug_cpu()
    for k, v in degrees.items():
        setattr(config.parallelism, k, v)
    if ok:
        check_world_size(config, world)
    else:
        with pytest.raises(ConfigError, match=r"--parallelism\..*world size"):
            check_world_size(config, world)


def test_job_defaults():
    job = Job()
    assert (job.module, job.config) == ("titan_ledger", "debug_cpu")


def test_overlays_merge_in_order_and_errors_name_the_overlay(tmp_path):
    base = _write(tmp_path, """
        [training]
        steps = 10
        [ledger.skip]
        steps = ["3"]
        """)
    o1 = _write(tmp_path, """
        [checkpoint]
        load_step = 16
        [ledger.skip]
        steps = ["17-24"]
        """, "o1.toml")
    o2 = _write(tmp_path, "[training]\nsteps = 30\n", "o2.toml")
    cfg = parse(read_job(["--job.config_file", base, "--job.overlay", o1, "--job.overlay=" + o2,
                          "--training.seq_len", "64"]))
    assert (cfg.training.steps, cfg.checkpoint.load_step, cfg.ledger.skip.steps) == (30, 16, ["17-24"])
    assert cfg.training.seq_len == 64
    bad = _write(tmp_path, "[ledger.skip]\nstepz = [\"1\"]\n", "bad.toml")
    with pytest.raises(ConfigError, match=r"bad.toml: \[ledger.skip\] stepz: unknown key"):
        parse(read_job(["--job.config_file", base, "--job.overlay", bad]))
    with pytest.raises(ConfigError, match=r"nope.toml: no such config file \(check --job.overlay;"):
        read_job(["--job.config_file", base, "--job.overlay", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match=r"nope.toml: no such config file \(check --job.config_file;"):
        read_job(["--job.config_file", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="cannot set \\[job\\]"):
        read_job(["--job.config_file", base, "--job.overlay", _write(tmp_path, "[job]\nconfig='x'\n", "j.toml")])


def test_help_renders_a_fields_docstring_as_paragraphs():
    """``--help`` (issue 69): an attribute docstring's hard line breaks are joined (tyro kept
    every one: its continuation lines start with the docstring's indentation), a blank line
    still ends a paragraph and a bullet still starts a line."""
    import tyro._docstrings as docstrings

    from titan_ledger.components.response.config import ResponseConfig
    from titan_ledger.config.toml_frontend import paragraphs_in_help

    paragraphs_in_help()
    paragraphs_in_help()  # (twice: installed once)
    text = docstrings._strings.remove_single_line_breaks(
        "First line of a field\n        continues here.\n\n        * a bullet\n        * another")
    assert text.split("\n")[0] == "First line of a field continues here." and "\n* a bullet\n* another" in text
    act = docstrings.get_field_docstring(ResponseConfig, "policy", ())
    assert "one contract for every automatic action." in act and "automatic\n" not in act
    # a blank line between paragraphs is one blank line (tyro's join left two)
    assert "automatic action.\n\n``observe`` (the default)" in act and "\n\n\n" not in act
