"""replay rerun's pure logic: variants, planning, flags, comparison, presence, verdicts (``rr.verdict``)."""

from __future__ import annotations

import json
import math

import pytest

from titan_ledger.components.response import counterfactual
from titan_ledger.errors import ConfigError
from titan_ledger.tools import rerun as rr
from titan_ledger.tools.rerun import RerunError, Variant, VariantResult


def test_parse_variant():
    assert rr.parse_variant("same") == Variant("same")
    assert rr.parse_variant("lr=0.5") == Variant("lr", 0.5)
    assert rr.parse_variant("eps=1e-6").name == "eps=1e-06"
    assert rr.parse_variant("skip").slug(8) == "skip8"
    assert rr.parse_variant("clip=0.5").slug(8) == "clip_0.5"
    assert rr.parse_variant("swap") == Variant("swap")
    for bad in ("lr", "lr=-1", "eps=x", "same=1", "swap=1", "fp16"):
        with pytest.raises(RerunError):
            rr.parse_variant(bad)


def test_parse_overrides():
    assert counterfactual.parse_overrides("") == {}
    assert counterfactual.parse_overrides("stop=9,lr_scale=0.5,eps=1e-6") == {"stop": 9, "lr_scale": 0.5, "eps": 1e-6}
    for bad in ("stop=0", "stop=1.5", "lr=2", "lr_scale=-1", "eps=nan", "stop"):
        with pytest.raises(ConfigError):
            counterfactual.parse_overrides(bad)


def plan(**kw):
    args = dict(checkpoints=[4, 8, 12], trained=list(range(1, 13)), last_step=12)
    args.update(kw)
    return rr.make_plan("/d", kw.pop("step", 8), [Variant("same"), Variant("skip"), Variant("same")],
                        **{k: v for k, v in args.items() if k != "step"})


def test_plan_picks_the_last_checkpoint_before_the_spike_and_dedups_variants():
    p = plan()
    assert (p.load_step, p.stop, p.steps_per_variant) == (4, 9, 5)
    assert [v.name for v in p.variants] == ["same", "skip"]
    assert str(p.folder(Variant("skip"))) == "/d/rerun/skip8"
    assert "2 variant(s) x 5 steps = 10 training steps" in p.budget_line()
    assert plan(step=9).load_step == 8  # a checkpoint AT the spike step - 1 or before
    assert plan(after=10).stop == 12  # never past the original's last step


def test_plan_refusals():
    with pytest.raises(RerunError, match="no complete checkpoint"):
        plan(step=3)
    with pytest.raises(RerunError, match="not a complete checkpoint"):
        plan(load_step=5)
    with pytest.raises(RerunError, match="before the spike"):
        plan(load_step=8)
    with pytest.raises(RerunError, match="not a trained step"):
        plan(trained=[1, 2, 3, 4, 5, 6, 7, 9])
    with pytest.raises(RerunError, match="--after"):
        plan(after=-1)


def test_strip_train_args_drops_bitflip_dump_folder_and_load_step():
    got = rr.strip_train_args(["--job.config_file", "x.toml", "--ledger.rehearsal.inject", "8:1:repeat,11:0:bitflip",
                               "--job.dump_folder", "/a", "--checkpoint.load_step=4", "--training.steps", "12"])
    assert got == ["--job.config_file", "x.toml", "--ledger.rehearsal.inject", "8:1:repeat", "--training.steps", "12"]
    assert rr.strip_train_args(["--ledger.rehearsal.inject=3:0:bitflip", "--x"]) == ["--x"]
    assert rr.strip_train_args(["--ledger.rehearsal.rerun", "stop=3", "--x"]) == ["--x"]


class _Cfg:
    class ledger:
        device = "cpu"

        class skip:
            steps = ["2-3"]

        class rehearsal:
            inject = "8:1:repeat,11:0:bitflip"

    class training:
        mixed_precision_param = "bfloat16"


def test_variant_args():
    c = _Cfg()
    assert rr.variant_args(Variant("same"), 8, c) == ([], {})
    assert rr.variant_args(Variant("skip"), 8, c) == (["--ledger.skip.steps", "2-3,8"], {})
    assert rr.variant_args(Variant("lr", 0.5), 8, c) == ([], {"lr_scale": 0.5})
    assert rr.variant_args(Variant("eps", 1e-6), 8, c) == ([], {"eps": 1e-6})
    assert rr.variant_args(Variant("clip", 0.25), 8, c) == (["--training.max_norm", "0.25"], {})
    # bf16 computes on the CPU backend too (FSDP2's param dtype), so fp32 is a real rerun
    assert rr.variant_args(Variant("fp32"), 8, c) == (["--training.mixed_precision_param", "float32"], {})
    c.training = type("t", (), {"mixed_precision_param": "float32"})
    assert rr.variant_args(Variant("fp32"), 8, c) is None  # an fp32 run: not applicable
    assert rr.variant_args(Variant("logit_cap", 30.0), 8, c) == ([], {"logit_cap": 30.0})
    assert rr.variant_args(Variant("zloss", 1e-4), 8, c) == (["--loss.z_loss_weight", "0.0001"], {})
    assert rr.variant_args(Variant("skip", steps=(8, 9)), 8, c) == (["--ledger.skip.steps", "2-3,8,9"], {})
    assert rr.variant_args(Variant("swap"), 8, c) == (["--ledger.rehearsal.inject", "8:1:repeat,8:0:swap"], {})
    assert rr.strip_train_args(["--ledger.rehearsal.inject", "8:1:repeat", "--x"], drop_inject=True) == ["--x"]


def test_rel_diff_and_compare_rows():
    assert rr.rel_diff(1.0, 1.0) == 0.0 and rr.rel_diff(1.0, 1.1) == pytest.approx(0.1 / 1.1)
    assert rr.rel_diff("inf", 1.0) == math.inf and rr.rel_diff("nan", "nan") == 0.0
    o = {5: {"step": 5, "loss": 2.0, "grad_norm": 1.0}, 6: {"step": 6, "loss": 2.0, "grad_norm": 1.0},
         7: {"step": 7, "skipped": True}}
    r = {5: {"step": 5, "loss": 2.0, "grad_norm": 1.0}, 6: {"step": 6, "loss": 2.0, "grad_norm": 1.5},
         7: {"step": 7, "loss": 1.0}}
    rows = rr.compare_rows(o, r, 5, 8)
    assert rows[0]["bit_equal"] and rows[0]["max_rel_diff"] == 0
    assert not rows[1]["bit_equal"] and rows[1]["rel_diff"]["grad_norm"] == pytest.approx(1 / 3)
    assert rows[2]["skipped"] == {"original": True, "rerun": False} and not rows[2]["bit_equal"]
    assert rows[3]["missing"] == "original"


def test_spike_like_tolerance():
    orig = {"grad_norm": 10.0}
    assert rr.spike_like(orig, {"grad_norm": 9.2}, med=1.0)
    assert not rr.spike_like(orig, {"grad_norm": 8.9}, med=1.0)  # outside 10%
    assert not rr.spike_like(orig, {"grad_norm": 10.0}, med=6.0)  # not 2x the median
    assert not rr.spike_like(orig, {"skipped": True}, med=1.0)
    assert rr.spike_like({"grad_norm": "inf"}, {"grad_norm": "inf"}, med=1.0)
    rows = [{"step": s, "grad_norm": g} for s, g in ((1, 1.0), (2, 3.0), (3, 2.0), (4, 50.0))]
    assert rr.pre_median(rows, 4) == 2.0


def test_loss_like_and_same_numbers():
    orig = {"loss": 3.8}  # 1.6 over a median of 2.2: a loss spike without a grad-norm one
    assert rr.loss_like(orig, {"loss": 3.74}, med_loss=2.2)  # logit_cap kept it
    assert rr.loss_like(orig, {"loss": 3.0}, med_loss=2.2)  # half the excess kept
    assert not rr.loss_like(orig, {"loss": 1.95}, med_loss=2.2)  # lr=0.333 removed it
    assert not rr.loss_like({"loss": 2.25}, {"loss": 2.25}, med_loss=2.2)  # +2%: not a loss spike
    assert not rr.loss_like({"loss": 1.0}, {"loss": 1.0}, med_loss=2.2)  # a low loss is not this test's
    assert not rr.loss_like(orig, {"skipped": True}, med_loss=2.2)
    assert rr.loss_like({"loss": "nan"}, {"loss": "nan"}, med_loss=2.2)
    assert not rr.loss_like({"loss": "nan"}, {"loss": 2.0}, med_loss=2.2)
    assert rr.loss_like(orig, {"loss": "inf"}, med_loss=2.2) and not rr.loss_like(orig, {"loss": 3.8}, None)
    assert rr.same_numbers({"step": 5, "bit_equal": True})
    assert rr.same_numbers({"step": 5, "bit_equal": False, "max_rel_diff": 5e-4})
    assert not rr.same_numbers({"step": 5, "bit_equal": False, "max_rel_diff": 0.01})
    assert not rr.same_numbers({"step": 5, "missing": "rerun", "bit_equal": False})


def test_no_verdict_at_a_step_that_is_not_a_spike():
    quiet = dict(original_spike=False)
    v = rr.verdict([res("same", True, **quiet), res("skip", False, **quiet)], 8, heuristic="bad_data")
    assert v["cause"] == "unproven" and not v["proven"] and v["not_a_spike"], v
    assert not v["heuristic_confirmed"] and "not a spike" in v["evidence"][0]
    v = rr.verdict([res("same", True, original_spike=True), res("skip", False, original_spike=True),
                    res("control", True, "control:skip=7", original_spike=True)], 8)
    assert v["cause"] == "bad_data" and v["certainty"] == "evidence" and not v["proven"] and "not_a_spike" not in v


def res(kind, present, name=None, **kw):
    return VariantResult(name or kind, kind, "/f", present=present,
                         at_step={"grad_norm": 1.0}, original_at_step={"grad_norm": 10.0},
                         steps=[{"step": 5, "bit_equal": True}], bit_equal_steps=[5], **kw)


def test_verdicts():
    v = rr.verdict([res("same", False)], 8)
    assert v["cause"] == "hardware" and v["proven"] and "NOT reproduced" in v["evidence"][0]
    ctl = res("control", True, "control:skip=7")  # as many other steps skipped: still there
    v = rr.verdict([res("same", True), res("skip", False), ctl], 8, heuristic="bad_data")
    assert v["cause"] == "bad_data" and v["certainty"] == "evidence" and v["heuristic_confirmed"]
    assert not v["proven"]  # a skip shows "something in this step", not which documents
    v = rr.verdict([res("same", True), res("skip", True), res("lr", False, "lr=0.5")], 8, heuristic="bad_data")
    assert v["cause"] == "lr" and v["proven"] and v.get("heuristic_wrong")
    v = rr.verdict([res("same", True), res("eps", False, "eps=1e-06")], 8)
    assert v["cause"] == "optimizer_state"
    v = rr.verdict([res("same", True), res("skip", True)], 8)
    assert v["cause"] == "unproven" and not v["proven"]
    v = rr.verdict([res("skip", False), ctl], 8)  # without `same` nothing is proven
    assert v["cause"] == "bad_data" and not v["proven"]
    na = VariantResult("fp32", "fp32", None, applicable=False, note="fp32 already")
    v = rr.verdict([res("same", True), na], 8, heuristic="bf16")
    assert v["cause"] == "unproven" and "not applicable" in v["evidence"][0] and not v["heuristic_confirmed"]
    v = rr.verdict([res("same", False)], 8, heuristic="bad_data")
    assert v["cause"] == "hardware" and v["heuristic_wrong"]


def test_plan_for_heuristic_causes():
    assert rr.PLAN_FOR["bad_data"] == ["same", "quarantine", "skip"]  # quarantine: the sharp one
    assert rr.PLAN_FOR["lr"] == ["same", "lr"]  # the scale comes from the ledger
    assert rr.PLAN_FOR["optimizer_state"] == ["same", "beta2", "eps=1e-6"]  # beta2 from the run
    assert rr.PLAN_FOR["bf16"] == ["same", "fp32"]
    assert rr.PLAN_FOR["logit_growth"] == ["same", "fp32", "logit_cap", "qk_clip"]  # fp32 first: bf16 runs
    assert rr.PLAN_FOR["hardware"] == rr.PLAN_FOR["transient"] == ["same"]
    for plan_ in [*rr.PLAN_FOR.values(), rr.ESCALATION]:
        [rr.parse_variant(x, allow_open=True) for x in plan_]


def test_print_report(capsys):
    r = res("same", True)
    rep = {"step": 8, "load_step": 4, "stop": 9, "budget_steps": 5, "variants": [r.to_json()],
           "verdict": rr.verdict([r], 8)}
    r.data_equal = True
    rep["variants"][0]["data_equal"] = True
    rr.print_report(rep)
    out = capsys.readouterr().out
    assert "original" in out and "verdict: unproven" in out


def test_swap_verdicts():
    sw = res("swap", True, swap={"original_rank": 0, "rerun_rank": 1, "data_moved_to": 1, "follows": "data"})
    v = rr.verdict([res("same", True), sw], 8)
    assert v["cause"] == "bad_data" and v["certainty"] == "evidence" and "followed the data" in v["evidence"][-1]
    sw = res("swap", True, swap={"original_rank": 0, "rerun_rank": 0, "data_moved_to": 1, "follows": "rank"})
    v = rr.verdict([res("same", True), sw], 8)
    assert v["cause"] == "hardware" and "stayed on DP rank 0" in v["evidence"][-1]


def test_write_summary_is_one_line_the_incident_page_finds(tmp_path):
    r = res("same", False)
    rep = {"step": 8, "load_step": 4, "stop": 9, "budget_steps": 5, "variants": [r.to_json()],
           "verdict": rr.verdict([r], 8)}
    p = rr.write_summary(tmp_path / "ledger", rep)
    assert p == tmp_path / "ledger" / "rerun" / "step8.json" and not list(p.parent.glob("*.tmp"))
    (line,) = p.read_text().splitlines()
    assert '"step": 8' in line and json.loads(line)["verdict"]["cause"] == "hardware"
    assert "steps" not in json.loads(line)["variants"][0]  # the per-step table stays in the report


def test_cli_usage_errors_are_one_line(capsys):
    from titan_ledger.tools import replay

    for argv, needle in (
            # no flags and no recorded launch to reuse (titan_ledger.tools.recorded)
            (["rerun", "--dump-folder", "/nonexistent", "--step", "8"],
             "needs the original run's training flags after `--`"),
            (["rerun", "--dump-folder", "/nonexistent", "--step", "8", "--variant", "swapp", "--",
              "--job.config_file", "x.toml"], "--variant 'swapp'"),
            (["rerun", "--step", "8", "--", "--job.config_file", "x.toml"], "--dump-folder")):
        with pytest.raises(SystemExit) as e:
            rc = replay.main(argv)
            raise SystemExit(rc)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_help_has_examples(capsys):
    from titan_ledger.tools import replay

    with pytest.raises(SystemExit):
        replay.main(["rerun", "--help"])
    out = capsys.readouterr().out
    assert "Examples:" in out and "--variant same --variant skip" in out and "hardware" in out


def test_parse_variant_forms_and_ledger_values():
    assert rr.parse_variant("skip=28-29") == Variant("skip", steps=(28, 29))
    assert rr.parse_variant("skip=28-29").name == "skip=28-29"
    assert rr.parse_variant("logit_cap=50") == Variant("logit_cap", 50.0)
    assert rr.parse_variant("zloss=1e-4") == Variant("zloss", 1e-4) and rr.CAUSE_OF["zloss"] == "output_logits"
    assert rr.parse_variant("zloss=1e-4").name == "zloss=0.0001"
    with pytest.raises(rr.RerunError, match="zloss=X"):
        rr.parse_variant("zloss=-1")
    with pytest.raises(rr.RerunError):
        rr.parse_variant("lr")  # a value is needed on the command line
    assert rr.parse_variant("lr", allow_open=True) == Variant("lr")
    rows = [{"step": s, "lr": 1e-3, "max_logit": 40.0, "grad_norm": 1.0} for s in range(1, 21)]
    rows[-1] = {"step": 21, "lr": 3e-2, "max_logit": 120.0, "grad_norm": 5.0}
    # a jump: the scale that undoes it; no jump: 0.5
    assert rr.ledger_values(Variant("lr"), rows, 21) == Variant("lr", float("%.3g" % (1e-3 / 3e-2)))
    assert rr.ledger_values(Variant("lr"), rows, 20) == Variant("lr", 0.5)
    assert rr.ledger_values(Variant("logit_cap"), rows, 21) == Variant("logit_cap", 60.0)
    assert rr.ledger_values(Variant("lr", 0.25), rows, 21) == Variant("lr", 0.25)  # a given value stays
    # a linear warmup doubles the LR from step 1 to 2 and sits at 2x its median: not a jump
    warm = [{"step": s, "lr": 1e-4 * s, "max_logit": 40.0} for s in range(1, 31)]
    assert rr.ledger_values(Variant("lr"), warm, 30) == Variant("lr", 0.5)
    # below the danger level there is no growth to cap: not applicable
    capless = rr.ledger_values(Variant("logit_cap"), rows, 20)
    assert capless == Variant("logit_cap", 0.0) and rr.variant_args(capless, 20, _Cfg()) is None
    cfg = _Cfg()
    cfg.optimizer = type("o", (), {"param_groups": [type("g", (), {"optimizer_kwargs": {"betas": (0.9, 0.95)}})]})
    assert rr.ledger_values(Variant("beta2"), rows, 21, cfg) == Variant("beta2", 0.9)  # torchtitan's 0.95
    cfg.optimizer.param_groups[0].optimizer_kwargs = {"betas": (0.9, 0.999)}
    assert rr.ledger_values(Variant("beta2"), rows, 21, cfg) == Variant("beta2", 0.95)
    with pytest.raises(rr.RerunError):
        rr.parse_variant("beta2=1.5")


def test_escalation_order_and_verdict_priority():
    # the most specific counterfactual first, lr (damps anything) last
    assert rr.ESCALATION[:2] == ("quarantine", "skip") and rr.ESCALATION[-1] == "lr"
    same = rr.VariantResult("same", "same", None, present=True, at_step={}, original_at_step={})
    fp32 = rr.VariantResult("fp32", "fp32", None, present=False, at_step={})
    cap = rr.VariantResult("logit_cap=50", "logit_cap", None, present=False, at_step={})
    v = rr.verdict([same, cap, fp32], 30, heuristic="logit_growth")
    assert v["cause"] == "bf16" and v["proven"] and v["heuristic_wrong"]  # fp32 alone removes it too
    v = rr.verdict([same, rr.VariantResult("fp32", "fp32", None, present=True, at_step={}), cap], 30)
    assert v["cause"] == "logit_growth" and v["proven"]


def test_set_beta2_keeps_the_bias_corrected_second_moment():
    import torch

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999))
    for i in range(5):
        p.grad = torch.full((4,), 0.1 * (i + 1))
        opt.step()
    t = float(opt.state[p]["step"])
    before = opt.state[p]["exp_avg_sq"] / (1 - 0.999 ** t)
    counterfactual.set_beta2(opt, 0.95)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"] / (1 - 0.95 ** t), before)
    assert counterfactual.parse_overrides("beta2=0.95") == {"beta2": 0.95}
    with pytest.raises(ConfigError, match="beta2"):
        counterfactual.parse_overrides("beta2=1.5")


def test_beta2_variant_applies_only_above_its_value():
    c = _Cfg()
    c.optimizer = type("o", (), {"param_groups": [type("g", (), {"optimizer_kwargs": {"betas": (0.9, 0.999)}})]})
    assert rr.variant_args(Variant("beta2", 0.95), 8, c) == ([], {"beta2": 0.95})
    c.optimizer.param_groups[0].optimizer_kwargs = {"betas": (0.9, 0.95)}
    assert rr.variant_args(Variant("beta2", 0.95), 8, c) is None


def test_not_applicable_variants_say_why(tmp_path):
    """run_variant returns before any launch for a variant that does not apply; its note
    must name the reason for each kind (fp32 has no value to format)."""
    plan = rr.Plan(tmp_path, 8, 4, 9, [])
    c = _Cfg()
    c.training = type("t", (), {"mixed_precision_param": "float32"})
    c.optimizer = type("o", (), {"param_groups": [type("g", (), {"optimizer_kwargs": {"betas": (0.9, 0.95)}})]})
    notes = {v.kind: rr.run_variant(plan, v, [], c, 2).note
             for v in (Variant("fp32"), Variant("beta2", 0.95), Variant("logit_cap", 0.0))}
    assert "float32" in notes["fp32"] and "0.95" in notes["beta2"] and "danger level" in notes["logit_cap"]


def test_bad_data_is_proven_only_by_the_quarantine_variant():
    """Issue 24: a skip of the whole step that removes the spike shows "something in this
    step" (certainty evidence); masking only the named documents proves bad data."""
    same = rr.VariantResult("same", "same", None, present=True, at_step={}, original_at_step={})
    skip = rr.VariantResult("skip", "skip", None, present=False, at_step={"skipped": True})
    ctl = rr.VariantResult("control:skip=7", "control", None, present=True, at_step={})
    v = rr.verdict([same, skip, ctl], 8, heuristic="bad_data")
    assert v["cause"] == "bad_data" and v["removed_by"] == "skip" and v["certainty"] == "evidence"
    assert "something in step 8's data" in v["certainty_rule"]
    q = rr.VariantResult("quarantine=stdlib_docs:7", "quarantine", None, present=False, at_step={"loss": 2.0})
    qc = rr.VariantResult("control:quarantine=stdlib_docs:9", "qcontrol", None, present=True, at_step={})
    v = rr.verdict([same, q, qc, skip], 8, heuristic="bad_data")
    assert v["removed_by"] == "quarantine" and v["certainty"] == "proven" and v["proven"]
    assert any("only the named documents masked (stdlib_docs:7)" in e for e in v["evidence"])
    q_kept = rr.VariantResult("quarantine=stdlib_docs:7", "quarantine", None, present=True, at_step={})
    v = rr.verdict([same, q_kept, skip, ctl], 8)  # the named documents were not it; the step's data was
    assert v["removed_by"] == "skip" and v["certainty"] == "evidence"
    v = rr.verdict([rr.VariantResult("same", "same", None, present=False, at_step={}, original_at_step={})], 8)
    assert v["cause"] == "hardware" and v["certainty"] == "proven" and v["removed_by"] == "same"


def test_the_quarantine_variant_masks_only_the_named_documents(tmp_path):
    from types import SimpleNamespace

    v = rr.parse_variant("quarantine=stdlib_docs:236,stdlib_docs:7")
    assert v.docs == (("stdlib_docs", 7), ("stdlib_docs", 236)) and v.name == "quarantine=stdlib_docs:7,stdlib_docs:236"
    assert rr.parse_variant("quarantine").docs == ()
    with pytest.raises(rr.RerunError, match="quarantine=SOURCE:DOC"):
        rr.parse_variant("quarantine=7")
    cfg = SimpleNamespace(ledger=SimpleNamespace(filter=SimpleNamespace(quarantine=["old.jsonl"])))
    assert rr.variant_args(rr.Variant("quarantine"), 8, cfg) is None  # none named: not applicable
    extra, over = rr.variant_args(v, 8, cfg, tmp_path)
    assert extra == ["--ledger.filter.quarantine", f"old.jsonl,{tmp_path}/quarantine.jsonl"] and over == {}
    rr.write_quarantine(v, tmp_path)
    from titan_ledger.data.filters import Quarantine

    assert Quarantine([str(tmp_path / "quarantine.jsonl")]).docs == {("stdlib_docs", 7), ("stdlib_docs", 236)}


def test_a_skip_convicts_the_data_only_against_its_same_size_control():
    """Issue 51: a tiny-model run whose LR spiked it in the warm-up (nothing injected):
    skip=6-19 removed the spike and the rerun printed "bad_data". A skip removes updates
    (the LR frozen over them), not only data: skipping as many OTHER steps is its control."""
    same = res("same", True)
    skip = res("skip", False, "skip=6-19")
    gone = res("control", False, "control:skip=2-5")
    v = rr.verdict([same, skip, gone], 20, heuristic="bad_data")
    assert v["cause"] == "unproven" and not v["proven"] and v.get("certainty") is None, v
    assert any("control:skip=2-5: gone as well" in e and "not bad_data" in e for e in v["evidence"])
    # a cause the LR variant proves is still found behind the uncontrolled skip
    v = rr.verdict([same, skip, gone, res("lr", False, "lr=0.5")], 20)
    assert v["cause"] == "lr" and v["proven"] and v["removed_by"] == "lr"
    # no control fitted the window: nothing is convicted, and the verdict says why
    na = VariantResult("control:skip", "control", None, applicable=False, note="no same-size control fits")
    for extra in ([na], []):
        v = rr.verdict([same, skip, *extra], 20)
        assert v["cause"] == "unproven", v
        assert any("the data is not convicted" in e for e in v["evidence"]), v["evidence"]
    kept = res("control", True, "control:skip=2-5")
    v = rr.verdict([same, skip, kept], 20)
    assert v["cause"] == "bad_data" and v["removed_by"] == "skip" and v["certainty"] == "evidence"
    assert any("the skipped steps' data removed it, not their number" in e for e in v["evidence"])


def test_a_skips_control_skips_as_many_other_steps_nearest_the_spike():
    from titan_ledger.tools.rerun.plan import skip_control

    trained = list(range(1, 31))
    c = skip_control(Variant("skip"), 8, 4, trained)  # skip 8 alone, checkpoint 4: skip 7 instead
    assert c == Variant("control", steps=(7,)) and c.name == "control:skip=7" and c.slug(8) == "control_skip7"
    assert rr.variant_args(c, 8, _Cfg()) == (["--ledger.skip.steps", "2-3,7"], {})
    # the skip's steps after the spike stay skipped in the control (both runs lose them)
    c = skip_control(Variant("skip", steps=(9, 10, 12)), 10, 4, trained)
    assert c.steps == (7, 8, 12)
    # the issue's case: checkpoint 5, skip=6-19, spike 20 -- no other step before it
    c = skip_control(Variant("skip", steps=tuple(range(6, 20))), 20, 5, trained)
    assert c == Variant("control") and rr.variant_args(c, 20, _Cfg()) is None
    # a later spike leaves room: the 14 trained steps nearest it, outside the skip
    assert skip_control(Variant("skip", steps=tuple(range(6, 20))), 40, 0, list(range(1, 41))).steps == tuple(range(26, 40))


def test_a_quarantine_convicts_its_documents_only_against_as_much_other_text():
    from titan_ledger.tools.rerun.plan import quarantine_control

    same = res("same", True)
    q = res("quarantine", False, "quarantine=zoo:32")
    gone = res("qcontrol", False, "control:quarantine=zoo:30")
    v = rr.verdict([same, q, gone], 28, heuristic="bad_data")
    assert v["cause"] == "unproven" and any("not these documents" in e for e in v["evidence"]), v
    kept = res("qcontrol", True, "control:quarantine=zoo:30")
    v = rr.verdict([same, q, kept], 28, heuristic="bad_data")
    assert v["cause"] == "bad_data" and v["proven"] and v["removed_by"] == "quarantine"
    v = rr.verdict([same, q], 28)
    assert v["cause"] == "unproven" and any("the documents are not convicted" in e for e in v["evidence"])
    # the control: other documents of the same steps, at least as many tokens, at most 2x
    tokens = {("zoo", 32): 768, ("zoo", 30): 900, ("zoo", 31): 500, ("zoo", 33): 400, ("zoo", 90): 5000}
    steps = {("zoo", 32): {28}, ("zoo", 30): {27, 28}, ("zoo", 31): {28}, ("zoo", 33): {28}, ("zoo", 90): {20}}
    c = quarantine_control(Variant("quarantine", docs=(("zoo", 32),)), tokens, steps)
    assert c.docs == (("zoo", 30),) and c.name == "control:quarantine=zoo:30" and c.slug(28) == "control_quarantine_30"
    from types import SimpleNamespace

    cfg = SimpleNamespace(ledger=SimpleNamespace(filter=SimpleNamespace(quarantine=[])))
    args, over = rr.variant_args(c, 28, cfg, "/f")
    assert args[0] == "--ledger.filter.quarantine" and args[1].startswith("/f/") and over == {}
    tokens[("zoo", 30)] = 2000  # too large alone (> 2x): the next ones fill it
    assert quarantine_control(Variant("quarantine", docs=(("zoo", 32),)), tokens, steps).docs == \
        (("zoo", 31), ("zoo", 33))
    lone = quarantine_control(Variant("quarantine", docs=(("zoo", 32),)), {("zoo", 32): 768}, {("zoo", 32): {28}})
    assert lone == Variant("qcontrol") and rr.variant_args(lone, 28, cfg) is None
