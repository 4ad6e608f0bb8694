"""The precision audit (design article §3.5): what the live model, optimizer and FSDP
policy compute in, checked once at start.

Design decision: read the objects that train, not the TOML. A config says
``mixed_precision_param = "bfloat16"``; what matters is the dtype of every sharded
parameter (the master weights), of Adam's moments, the FSDP policy each parameter
group actually holds (gradient reduction), the attention kernel, the loss's upcast,
what the norms accumulate in (probed: each norm module of the model run once on a
small input in the compute dtype and compared with a float32 reference), and which
linears float8 converted (never the first and last layers). Each check is a row
``{check, want, found, ok}``; rank 0 prints the table, every deviation is one warning,
and the rows go into the signals header (``precision``) where ``diagnose``'s bf16
question reads them.

The FSDP policy has no public getter in torch 2.14 (``FSDPModule`` offers setters
only): it is read from ``_get_fsdp_state()._fsdp_param_groups[i].mp_policy``, the one
private read here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_ledger.components.signals.sums import local

FP32 = torch.float32


def _names(dtypes) -> str:
    return ", ".join(sorted({str(d).replace("torch.", "") for d in dtypes})) or "none"


def _row(check: str, want: str, found: str, ok: bool | None, how: str) -> dict[str, Any]:
    """``ok`` None: not applicable here (e.g. no float8 in this model)."""
    return {"check": check, "want": want, "found": found, "ok": ok, "how": how}


def fsdp_policies(model_parts: list[nn.Module]) -> list[tuple[str, torch.dtype | None, torch.dtype | None]]:
    """(module fqn, param_dtype, reduce_dtype) of every FSDP parameter group."""
    out = []
    for part in model_parts:
        for name, m in part.named_modules():
            get = getattr(m, "_get_fsdp_state", None)
            if get is None:
                continue
            for group in getattr(get(), "_fsdp_param_groups", []):  # PRIVATE: no public getter
                mp = group.mp_policy
                out.append((name or "<root>", mp.param_dtype, mp.reduce_dtype))
    return out


def compute_dtype(model_parts: list[nn.Module]) -> torch.dtype:
    """What the forward computes in: the FSDP policy's param dtype, else the params'."""
    for _, param_dtype, _ in fsdp_policies(model_parts):
        if param_dtype is not None:
            return param_dtype
    for part in model_parts:
        for p in part.parameters():
            return local(p).dtype
    return FP32


def norm_accumulates_in_fp32(norm: nn.Module, dim: int, dtype: torch.dtype, device) -> tuple[bool, float]:
    """Run ``norm``'s computation on a probe in ``dtype`` and compare with a float32
    reference: float32 statistics leave only the output's rounding (relative error
    within a few units of ``dtype``'s epsilon); statistics accumulated in ``dtype`` over
    ``dim`` elements do not. torch's own norms (``nn.RMSNorm``, ``nn.LayerNorm`` and
    subclasses such as torchtitan's) run as an unsharded replica of the same class (the
    model's may hold a DTensor shard); any other norm module is called itself. Returns
    (ok, max relative error in units of eps)."""
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    # a large mean and a small spread: a low-precision running sum of squares stagnates,
    # and a low-precision variance cancels
    x = (30.0 + torch.randn(4, dim, generator=g)).to(device)
    layer = isinstance(norm, nn.LayerNorm)
    eps = getattr(norm, "eps", None) or 1e-6
    w = None
    if isinstance(norm, (nn.RMSNorm, nn.LayerNorm)):
        replica = (nn.LayerNorm if layer else nn.RMSNorm)(dim, eps=eps, elementwise_affine=False).to(device)
        run = type(norm).forward.__get__(replica)  # the model's class's forward, on the replica
    else:
        run = norm
        weight = getattr(norm, "weight", None)
        w = local(weight).float() if weight is not None and tuple(local(weight).shape) == (dim,) else None
    with torch.no_grad():
        if layer:
            ref = F.layer_norm(x.float(), (dim,), w, None, eps)
        else:
            ref = F.rms_norm(x.float(), (dim,), w, eps)
        got = run(x.to(dtype)).float()
    err = ((got - ref).abs() / ref.abs().clamp(min=1e-3)).max().item() / torch.finfo(dtype).eps
    return err <= 4.0, err


def attention_backend(model_parts: list[nn.Module]) -> str:
    """The inner attention modules' kind: cpu (titan_ledger's), flex, sdpa, varlen."""
    kinds = set()
    for part in model_parts:
        for m in part.modules():
            name = type(m).__name__
            if name == "CpuAttention":
                kinds.add("cpu")
            elif name.endswith("FlexAttention"):
                kinds.add("flex")
            elif name == "ScaledDotProductAttention":
                kinds.add("sdpa")
            elif name == "VarlenAttention":
                kinds.add("varlen")
    return ", ".join(sorted(kinds)) or "none found"


def audit(model_parts: list[nn.Module], optimizers, loss_fn, n_layers: int | None = None) -> list[dict[str, Any]]:
    """The checks, from the live objects (see the module docstring)."""
    rows = []
    backend = attention_backend(model_parts)
    params = [(n, local(p)) for part in model_parts for n, p in part.named_parameters()]
    master = {p.dtype for _, p in params}
    rows.append(_row("master weights", "float32", _names(master), master <= {FP32},
                     "dtype of every (sharded) parameter"))
    # Adam's moments: torch creates them like the parameter at the first step; read them
    # if they exist (a resumed run), else what they will be
    moments, created = set(), False
    for opt in getattr(optimizers, "optimizers", [optimizers]):
        for st in getattr(opt, "state", {}).values():
            for k in ("exp_avg", "exp_avg_sq"):
                if isinstance(st.get(k), torch.Tensor):
                    moments.add(local(st[k]).dtype)
                    created = True
    # torchtitan's implementation="fused_opt_states_bf16" creates them in bf16 from a step
    # pre-hook: look for that hook on the live optimizers
    bf16_hook = any("bf16" in getattr(h, "__name__", "")
                    for opt in [optimizers, *getattr(optimizers, "optimizers", [])]
                    for h in getattr(opt, "_optimizer_step_pre_hooks", {}).values())
    how = "exp_avg / exp_avg_sq"
    if not created and bf16_hook:
        moments, how = {torch.bfloat16}, "created in bfloat16 by a step pre-hook (fused_opt_states_bf16)"
    elif not created:
        moments = {p.dtype for _, p in params if p.is_floating_point()}
        how = "created like the parameters at the first step"
    rows.append(_row("Adam moments", "float32", _names(moments), moments <= {FP32}, how))
    pols = fsdp_policies(model_parts)
    compute = compute_dtype(model_parts)
    if pols:
        # reduce_dtype None: gradients reduce in the compute dtype (FSDP clamps an equal one to None)
        reduce = {r or pd or FP32 for _, pd, r in pols}
        rows.append(_row("gradient reduction", "float32", _names(reduce), reduce <= {FP32},
                         f"FSDP MixedPrecisionPolicy of {len(pols)} parameter groups"))
    else:
        grads = {p.dtype for _, p in params if p.requires_grad}
        rows.append(_row("gradient reduction", "float32", _names(grads), grads <= {FP32},
                         "no FSDP: gradients reduce in the parameters' dtype"))
    rows.append(_row("compute dtype", "(informative)", _names({compute}), None,
                     "FSDP param_dtype, else the parameters'"))
    fp32_softmax = backend != "none found" and set(backend.split(", ")) <= {"flex", "sdpa", "cpu", "varlen"}
    rows.append(_row("attention softmax / accumulation", "float32", backend, fp32_softmax,
                     "Flex, SDPA and varlen kernels accumulate in float32; titan_ledger's CPU attention "
                     "upcasts the scores (softmax in float32)"))
    from torchtitan.components.loss import CrossEntropyLoss

    inner = getattr(loss_fn, "loss_fn", loss_fn)
    ce = isinstance(inner, CrossEntropyLoss)
    rows.append(_row("logits into the loss", "float32", type(inner).__name__ + (" (.float())" if ce else ""), ce,
                     "torchtitan's cross-entropy and titan_ledger's per-document loss cast the logits "
                     "to float32; another loss is not checked"))
    norms = [(n, m) for part in model_parts for n, m in part.named_modules()
             if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None]
    if norms:
        name, m = norms[0]
        shape = getattr(m, "normalized_shape", None) or tuple(m.weight.shape)  # global (a DTensor's too)
        dim = int(shape[-1]) if shape else 0
        device = local(m.weight).device
        try:
            ok, err = norm_accumulates_in_fp32(m, dim, compute, device) if dim else (None, float("nan"))
        except Exception as e:  # a norm this probe cannot call: say so, do not guess
            ok, err = None, float("nan")
            found = f"{type(m).__name__}: probe failed ({type(e).__name__})"
        else:
            found = f"{type(m).__name__}, {err:.1f} eps from a float32 reference"
        rows.append(_row("norm statistics", "float32", found, ok,
                         f"{len(norms)} norm modules; probed {name} in {_names({compute})}"))
    f8 = [n for part in model_parts for n, m in part.named_modules() if "float8" in type(m).__name__.lower()]
    if f8:
        # "the first and last layers stay bf16" (Megatron's --first-last-layers-bf16): the
        # first and last transformer blocks and the output head. Under PP a stage sees its
        # own blocks only, so the model's block count (``n_layers``) decides; the fqns keep
        # the model's indices.
        import re

        blocks = sorted({int(m.group(1)) for part in model_parts for n, _ in part.named_modules()
                         if (m := re.match(r"(?:.*\.)?layers\.(\d+)$", n))})
        edge_blocks = {0, n_layers - 1} if n_layers else ({blocks[0], blocks[-1]} if blocks else set())
        edge = sorted(n for n in f8 if n.split(".")[-1] in ("output", "lm_head")
                      or ((m := re.search(r"layers\.(\d+)\.", n)) and int(m.group(1)) in edge_blocks))
        rows.append(_row("float8 GEMMs", "inner blocks' linears only (not the first/last block, not the head)",
                         f"{len(f8)} float8 linears" + (f"; {len(edge)} at the edge, e.g. {edge[0]}" if edge else ""),
                         not edge, "torchao Float8Linear casts only the GEMM inputs; edge blocks from the "
                         "module names"))
    return rows


def deviations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["ok"] is False]


def table(rows: list[dict[str, Any]]) -> str:
    w = max(len(r["check"]) for r in rows)
    out = [f"{'precision check':<{w}}  {'ok':<4} found (want)"]
    for r in rows:
        mark = {True: "ok", False: "NO", None: "-"}[r["ok"]]
        out.append(f"{r['check']:<{w}}  {mark:<4} {r['found']} ({r['want']})")
    return "\n".join(out)


def audit_trainer(trainer, is_rank0: bool) -> list[dict] | None:
    """The §3.5 checklist from the live model, optimizer and FSDP policy
    (:func:`audit`): rank 0 prints the table, each deviation
    is a warning; the rows go into every segment header. An audit that cannot run is
    said once and never stops training."""
    from torchtitan.tools.logging import logger

    try:
        n_layers = len(getattr(trainer.config.model_spec.model, "layers", None) or []) or None
        rows = audit(trainer.model_parts, trainer.optimizers, trainer.loss_fn, n_layers=n_layers)
    except Exception as e:  # a model this audit does not know: record why, train on
        if is_rank0:
            logger.warning(f"titan_ledger: precision audit skipped ({type(e).__name__}: {e})")
        return None
    if is_rank0:
        logger.info("titan_ledger: precision (design article §3.5), checked on the live objects:\n"
                    + table(rows))
        for r in deviations(rows):
            logger.warning(f"titan_ledger: precision: {r['check']} is {r['found']}, want {r['want']} ({r['how']})")
    return rows
