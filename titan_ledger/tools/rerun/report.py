"""``replay rerun``'s printed report: the table of variants at the spike step and the
verdict, and the number and step-range formatting the other modules' messages share."""

from __future__ import annotations


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    out, a = [], steps[0]
    prev = a
    for s in steps[1:] + [None]:
        if s is None or s != prev + 1:
            out.append(f"{a}" if a == prev else f"{a}-{prev}")
            if s is not None:
                a = s
        if s is not None:
            prev = s
    return ",".join(out)


def print_report(rep: dict) -> None:
    print(f"spike at step {rep['step']}: reruns from checkpoint step-{rep['load_step']} to step "
          f"{rep['stop']} ({rep['budget_steps']} training steps)")
    if rep.get("done"):
        print(f"the trainer: {rep['done']}")
    hdr = ("variant", "spike@T", "loss", "grad_norm", "max_logit", "spread", "lr", "bit-equal",
           "max rel diff", "data")
    table = [hdr]
    o = next((v["original_at_step"] for v in rep["variants"] if v.get("original_at_step")), None)
    if o:
        spike = next((v.get("original_spike") for v in rep["variants"] if v.get("original_spike") is not None), True)
        table.append(("original", _fmt(spike), *(_fmt(o.get(k)) for k in ("loss", "grad_norm", "max_logit",
                                                                      "loss_spread", "lr")), "", "", ""))
    for v in rep["variants"]:
        if not v["applicable"]:
            table.append((v["variant"], "n/a", "not applicable", "", "", "", "", "", "", ""))
            continue
        at = v["at_step"] or {}
        if at.get("skipped"):
            cells = ("skipped", "", "", "", "")
        else:
            cells = tuple(_fmt(at.get(k)) for k in ("loss", "grad_norm", "max_logit", "loss_spread", "lr"))
        steps = [s["step"] for s in v["steps"]]
        be = "all" if steps and v["bit_equal_steps"] == steps else (
            f"{_ranges(v['bit_equal_steps'])}" if v["bit_equal_steps"] else "none")
        table.append((v["variant"], _fmt(v["present"]), *cells, be, _fmt(v["max_rel_diff"]),
                      "equal" if v["data_equal"] else f"DIFFERS at {v['data_mismatch']['step']}"))
    widths = [max(len(str(r[i])) for r in table) for i in range(len(hdr))]
    for r in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    vd = rep["verdict"]
    print(f"verdict: {vd['cause']} ({vd.get('certainty') or 'not proven'})"
          + (f": {vd['certainty_rule']}" if vd.get("certainty_rule") else ""))
    for e in vd["evidence"]:
        print(f"  - {e}")
    if "heuristic" in vd:
        if vd.get("heuristic_confirmed"):
            print(f"  the heuristic verdict ({vd['heuristic']}) is confirmed")
        elif vd.get("heuristic_wrong"):
            print(f"  the heuristic verdict ({vd['heuristic']}) was WRONG: the reruns prove {vd['cause']}")
        else:
            print(f"  the heuristic verdict ({vd['heuristic']}) is neither confirmed nor refuted")
