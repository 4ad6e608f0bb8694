"""diagnose: the decision tree on synthetic ledgers, and the CLI on real files."""

from __future__ import annotations

import json
import random

import pytest

from titan_ledger.format import records
from titan_ledger.tools.decision import classify
from titan_ledger.tools.diagnose import main

T = 80  # the spike step of every synthetic ledger


def q(got, label):
    """The check of question ``label`` ("Q3", "F2", ...)."""
    return next(c for c in got["checks"] if c["question"].startswith(label + " "))


def ledger(n=100, seed=0):
    rnd = random.Random(seed)
    rows = []
    for s in range(1, n + 1):
        loss = 2.5 - 0.002 * s + rnd.gauss(0, 0.01)
        rows.append({"step": s, "loss": loss, "loss_max": loss + 0.05 + rnd.gauss(0, 0.005),
                     "loss_max_rank": rnd.randrange(4), "grad_norm": 1.0 + rnd.gauss(0, 0.03),
                     "param_norm": 100 + 0.05 * s + rnd.gauss(0, 0.001), "max_logit": 20 + rnd.gauss(0, 0.5),
                     "num_zeros": 1000 + rnd.randrange(-20, 20), "lr": 3e-4, "skipped": False})
    return rows


def spike(rows, loss=4.8, gn=6.0, recover=True):
    r = rows[T - 1]
    r["loss"], r["loss_max"], r["grad_norm"] = loss, loss + 0.05, gn
    if not recover:
        for x in rows[T:]:
            x["loss"] = loss + 0.01 * (x["step"] - T)
            x["loss_max"] = x["loss"] + 0.05
    return rows


def make(cause):
    rows = ledger()
    if cause == "divergence":
        return spike(rows, recover=False)
    if cause == "logit_growth":
        for r in rows[T - 40:T]:
            r["max_logit"] = 40 + 2.0 * (r["step"] - (T - 40))  # 40 -> 118, steadily
        return spike(rows)
    if cause == "lr":
        for r in rows[T - 50:T]:
            k = r["step"] - (T - 50)
            r["param_norm"] = rows[T - 51]["param_norm"] + 0.05 * k + 0.01 * k * k  # accelerating
            r["grad_norm"] = 1.0 + 0.01 * k  # creeping up
        return spike(rows)
    if cause == "bad_data":
        spike(rows)
        rows[T - 1].update(loss_max=9.5, loss_max_rank=3)
        return rows
    if cause == "optimizer_state":
        for r in rows[T - 10:T]:
            r["grad_norm"] = 0.4 + random.Random(r["step"]).gauss(0, 0.01)
        return spike(rows)
    if cause == "bf16":
        spike(rows)
        rows[T - 1]["num_zeros"] = 50000
        return rows
    return spike(rows)  # transient: nothing else stands out


@pytest.mark.parametrize("cause", ["divergence", "logit_growth", "lr", "bad_data",
                                   "optimizer_state", "bf16", "transient"])
def test_each_cause_is_named_with_its_numbers(cause):
    rows = make(cause)
    got = classify(rows, T)
    assert got["cause"] == cause, got
    assert got["grad_norm_ratio"] > 3
    assert [c["question"][:2] for c in got["checks"]] == ["Q0", "F1", "F2", "F3", "Q1", "Q2", "Q3", "Q4", "Q5", "Q6"]
    if cause == "bad_data":
        assert got["rank"] == 3
        q3 = q(got, "Q3")
        assert q3["loss_max_rank"] == 3 and q3["rank_loss"] == 9.5
    if cause == "logit_growth":
        assert q(got, "Q1")["max_logit"] >= 100 and q(got, "Q1")["max_logit_slope"] > 1


def test_a_linear_warmup_is_not_an_lr_jump():
    rows = ledger()
    for r in rows:
        r["lr"] = 3e-4 * min(r["step"], 200) / 200  # torchtitan's default 200 warmup steps
    from titan_ledger.tools.decision import Thresholds

    got = classify(spike(rows), T, th=Thresholds(pre=100))  # the window reaches step 1
    assert q(got, "Q2")["lr_ratio"] == pytest.approx(2.0, rel=0.03)  # 2x its median ...
    assert q(got, "Q2")["lr_step_jump"] == pytest.approx(1.5) and got["cause"] != "lr"  # ... no jump


def test_an_lr_jump_is_read_from_the_lr_column():
    rows = ledger()
    for r in rows[T - 2:]:
        r["lr"] = 30 * 3e-4  # a relaunch with another --optimizer.lr, two steps before the spike
    got = classify(spike(rows), T)
    assert got["cause"] == "lr" and q(got, "Q2")["lr_ratio"] == pytest.approx(30)


def test_the_run_precision_decides_bf16_against_logit_growth_and_hardware():
    rows = make("logit_growth")
    assert classify(rows, T, param_dtype="bfloat16")["cause"] == "bf16"
    assert classify(rows, T, param_dtype="float32")["cause"] == "logit_growth"
    # a grad-norm glitch that falls back with the loss unmoved: hardware in fp32, bf16 in bf16
    rows = ledger()
    rows[T - 1]["grad_norm"], rows[T - 1]["num_zeros"] = 40.0, 50000
    assert classify(rows, T, param_dtype="float32")["cause"] == "hardware"
    assert classify(rows, T, param_dtype="bfloat16")["cause"] == "bf16"
    rows[T - 1]["grad_norm"] = float("inf")
    assert classify(rows, T, param_dtype="float32")["cause"] == "hardware"
    assert classify(make("transient"), T, param_dtype="float32")["cause"] == "transient"  # the loss moved




def test_the_precision_audit_decides_the_run_precision_and_its_deviations_are_q5s_numbers():
    rows = ledger()
    rows[T - 1]["grad_norm"], rows[T - 1]["num_zeros"] = 40.0, 50000
    fp32 = [{"check": "compute dtype", "found": "float32", "ok": None}]
    bf16 = [{"check": "compute dtype", "found": "bfloat16", "ok": None},
            {"check": "gradient reduction", "found": "bfloat16", "ok": False}]
    # the config said bf16; the live model computed in fp32: a glitch in fp32 is hardware
    assert classify(rows, T, param_dtype="bfloat16", precision=fp32)["cause"] == "hardware"
    got = classify(rows, T, param_dtype="float32", precision=bf16)
    assert got["cause"] == "bf16"
    q5 = next(c for c in got["checks"] if c["question"].startswith("Q5"))
    assert q5["precision_deviations"] == ["gradient reduction: bfloat16"] and q5["param_dtype"] == "bfloat16"


def _write(folder, rows):
    w = records.RecordWriter(folder / "signals.jsonl", {"schema": records.SIGNALS.id, "run_id": "a",
                                                       "resumed_from": 0, "seq": 1})
    for r in rows:
        w.write({**{k: None for k in records.SIGNAL_KEYS}, **r})
    w.close()


def test_cli_finds_the_spike_offline_and_names_the_rank(tmp_path, capsys):
    (tmp_path / "ledger").mkdir()
    _write(tmp_path / "ledger", make("bad_data"))
    assert main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in out["spikes"]] == [T] and out["spikes"][0]["rank"] == 3


@pytest.mark.parametrize("content", [b"", b'{"schema": "titan_ledger.signals/1", "run_id": "a"}\n'])
def test_a_run_that_died_before_its_first_step_is_an_error(tmp_path, capsys, content):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "signals.jsonl").write_bytes(content)
    assert main(["--dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "signals.jsonl" in err and "no spikes detected" not in err


def test_documents_are_ranked_against_the_median_document_not_the_median_segment():
    """A degenerate document cut into most of a step's rows is the segment median (the
    zoo's repeated token at step 46: 0.99x), but it is one document among few: against
    the median over distinct documents it is the outlier (0.69x) and is named first."""
    from types import SimpleNamespace

    from titan_ledger.tools.diagnose import offending_documents
    from titan_ledger.tools.incident import document_scores, extreme_document_rank

    def seg(rank, doc, loss, tokens=256):
        return {"dp_rank": rank, "row": 0, "segment": 0, "sample_id": 0, "source": "zoo", "doc": doc,
                "start": 0, "end": tokens, "loss": loss, "loss_sum": loss * tokens, "tokens": tokens}

    docs = [seg(0, 62, 4.35), seg(0, 62, 4.35), seg(1, 62, 4.35), seg(1, 62, 4.35), seg(1, 62, 4.35),
            seg(1, 63, 6.64), seg(1, 63, 6.51, 118), seg(0, 61, 6.39), seg(0, 61, 6.32, 217)]
    led = SimpleNamespace(data=SimpleNamespace(doc_losses=lambda step: (docs, 4.38)))
    scores = document_scores(led, 46)
    assert [d["doc"] for d in scores] == [62, 63, 61]
    assert scores[0]["dp_rank"] == 1 and scores[0]["segments"] == 5 and scores[0]["tokens"] == 5 * 256
    assert scores[0]["vs_median"] == pytest.approx(4.35 / ((6.39 * 256 + 6.32 * 217) / 473), rel=1e-6)  # doc 61
    assert extreme_document_rank(led, 46) == 1
    assert [d["doc"] for d in offending_documents(led, 46, rank=0, n=2)] == [61]  # rank 0's only
    assert [d["doc"] for d in offending_documents(led, 46, rank=3, n=2)] == [62, 63]  # none there: all
    empty = SimpleNamespace(data=SimpleNamespace(doc_losses=lambda step: ([], None)))
    assert document_scores(empty, 1) == [] and extreme_document_rank(empty, 1) is None


def test_a_finite_grad_jump_with_an_extreme_document_is_bad_data_not_hardware():
    rows = ledger()
    rows[T - 1]["grad_norm"] = 6.0  # loss unmoved, grad norm 6x, fp32: Q6's signature ...
    ev = {"rules": ["grad_jump"], "doc_high_y": 0.134, "doc_y_median_high": 0.033,
          "doc_low_y": 0.07, "doc_y_median_low": 0.036}
    got = classify(rows, T, evidence=ev, param_dtype="float32")
    assert got["cause"] == "bad_data" and q(got, "Q3")["document_vs_usual"] == pytest.approx(4.06, abs=0.01)
    ev.update(doc_high_y=0.05)  # ... with every document as usual: hardware
    assert classify(rows, T, evidence=ev, param_dtype="float32")["cause"] == "hardware"
    rows[T - 1]["grad_norm"] = float("inf")  # a document does not make a non-finite grad norm
    ev.update(doc_high_y=0.134)
    assert classify(rows, T, evidence=ev, param_dtype="float32")["cause"] == "hardware"


def test_a_stall_is_listed_and_named_and_its_window_proof_proves_the_fix(tmp_path, capsys):
    """The stall rule's flag is a finding diagnose lists; ``stalled`` (the logits past 1e4)
    is logit growth on the evidence, and the window proof the trainer ran at the next step
    (a forced proof naming the stall) proves the fix that lowered the loss."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.incident import judge

    from ..bad_input_ledgers import signal_row

    led = tmp_path / "run" / "ledger"
    led.mkdir(parents=True)
    hdr = {"run_id": "a", "seq": 1, "resumed_from": 0, "time": 1.0, "world_size": 1, "dp_size": 1}
    records.append_segment(led, records.Header(schema="", run_id="a", seq=1, resumed_from=0, time=1.0))
    w = records.RecordWriter(led / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, **hdr})
    for s in range(1, 401):
        w.write(signal_row(s, loss=6.3 + 0.01 * (s % 3), max_logit=2e4))
    w.close()
    stall = {"kind": "stalled", "best": 6.28, "windows": [[350, 6.34, 2.3e4]], "window": 50, "max_logit": 2.3e4,
             "since": 150}
    e = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, **hdr, "rules": {}})
    e.write({"step": 350, "stall": stall})
    e.close()
    run = RunLedger(tmp_path / "run")
    res = judge(run, 350)
    assert res["cause"] == "logit_growth" and res["certainty"] == "evidence" and "STALL at step 350" in \
        res["certainty_rule"] and "--model.qk_norm" in res["prevention"]["flags"]
    # the answer, not proven: the stall rule's reading as a candidate fix, never as the cause
    a = res["answer"]
    assert (a["kind"], a["cause"], a["established"], a["fix"]) == ("stall", "", "none", None)
    assert a["candidates"][0]["variant"] == "logit_cap" and "host snapshots" in a["not_proven"]
    window = {"cause": "logit_growth", "variant": "logit_cap", "stall": True, "from_step": 280, "steps": 71,
              "why": "the stall: ... the logit_cap variant lowered the loss (loss -0.2 ...)",
              "fixes": [{"variant": "logit_cap", "cause": "logit_growth", "cost": -0.2}],
              "runs": [{"variant": "same", "normal": True, "grad_norm": 1.7, "cost": 0.0},
                       {"variant": "logit_cap", "normal": True, "grad_norm": 1.2, "cost": -0.2}]}
    e = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, **hdr, "rules": {}})
    e.write({"step": 351, "forced": True, "proof": {"verdict": "not_data", "applied": "original", "window": window,
                                                    "stall": {"step": 350, "kind": "stalled"}}})
    e.close()
    res = judge(RunLedger(tmp_path / "run"), 350)
    assert (res["cause"], res["certainty"]) == ("logit_growth", "proven")
    assert res["certainty_rule"].startswith("proven in process: logit_growth proven by the window")
    a = res["answer"]
    assert (a["cause"], a["established"], a["fix"]["variant"], a["fix"]["effect"]) == \
        ("logit_growth", "window", "logit_cap", "lowered")
    from titan_ledger.format.answers import Answer, render  # the record diagnose renders, read back whole

    assert render.lines(Answer.of(a))[0] == "stall at step 350: attention-logit growth -- proven by its fix in the window"
    assert main([str(tmp_path / "run")]) == 0  # listed without --step: the stall is a finding
    out = capsys.readouterr().out
    # the run's answer first: the stall is its one episode, the incident's own answer after it
    assert out.startswith("episodes: 1\nepisode 1, step 350: stall: attention-logit growth -- proven by its fix in "
                          "the window\n  fix: --qk_clip.enable --qk_clip.threshold 30 (now off): lowered"), out[:300]
    assert "\nstall at step 350: attention-logit growth -- proven by its fix in the window\n" \
           "  fix: --qk_clip.enable --qk_clip.threshold 30 (now off): lowered" in out
