"""How a ``Ledger`` starts: :class:`LedgerStart`, its binding to the built trainer.

Design decision: what the ledger builds from the trainer is built once, while
``LedgerTrainer`` is constructed (``attach_loss``, then ``setup`` once the model, optimizer
and dataloader exist, before any checkpoint load), and lives here, apart from the per-step
fan-out in :mod:`titan_ledger.components.ledger.ledger`: the dump folder claimed and the
run's identity agreed across ranks; the writers and the spike guard built from a
:class:`Topology`; QK-clip bound to the live model; the facts every segment header records
(config digest, precision audit, parameter groups) and the settings an incident's answer
reads (``knobs_of``, ``answer_context``). ``LedgerStart`` is a mixin of ``Ledger``, not a
component of its own: it fills the attributes ``Ledger.__init__`` declares, and the
response keeps asking the ledger, not it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from titan_ledger.components.detection.guard import SpikeGuard
from titan_ledger.components.detection.spikes import is_note
from titan_ledger.components.ledger.data_writer import DataLedgerWriter
from titan_ledger.components.run.run_folder import agree_identity, claim_dump_folder, config_digest
from titan_ledger.components.signals.adam_level import AdamLevel
from titan_ledger.components.signals.attention import MaxLogitRecorder, forget_pp_metadata_inference
from titan_ledger.components.signals.doc_loss import DocLossTracker, LogZStats, find_doc_loss
from titan_ledger.components.signals.recorder import SignalRecorder
from titan_ledger.components.signals.sums import ParamPlan, natural_key
from titan_ledger.components.signals.topology import Topology
from titan_ledger.data.content import ContentMemory
from titan_ledger.data.layout import parse_skip_steps
from titan_ledger.errors import ConfigError
from titan_ledger.format import answers
from titan_ledger.format.reader import RunLedger

#: the content memory's slots (two int32 stamps each: 16 MiB a rank): data/content.py
CONTENT_SLOTS = 1 << 21


class LedgerStart:
    """``Ledger.setup`` and what it builds; ``attach_loss``, called before it."""

    def setup(self, trainer) -> None:
        """Bind to a built trainer (after model, optimizer and dataloader exist). The
        launch checks ran before (``config.validate``); this claims the run folder, agrees
        the run's identity and builds the writers."""
        from titan_ledger.components.prevention.optimizer import describe_groups
        from titan_ledger.components.signals.precision import audit_trainer
        from titan_ledger.data.loader import LedgerDataLoader

        cfg, tcfg = self.config, trainer.config
        self.enabled = cfg.signals
        self.topo = topo = Topology.from_trainer(trainer)
        self.device = trainer.device
        self.loader = trainer.dataloader if isinstance(trainer.dataloader, LedgerDataLoader) else None
        self.folder = Path(tcfg.dump_folder) / cfg.folder
        self.global_batch = tcfg.training.local_batch_size * topo.dp_size * trainer.gradient_accumulation_steps
        if cfg.skip.auto:
            rejected = RunLedger(tcfg.dump_folder, cfg.folder).rejected_steps() if self.folder.exists() else []
            self.skip_windows = parse_skip_steps(
                [f"{a}-{b}" for a, b in self.skip_windows] + [str(t) for t in rejected])
        identity = agree_identity(self.folder, topo.is_rank0, self._claim(tcfg) if topo.is_rank0 else None)
        self.run_id, self._seq = identity.run_id, identity.next_seq - 1
        self.config_digest = config_digest(tcfg)
        # the compute dtype of the parameters: diagnose's precision question needs it
        # (a one-step glitch in an fp32 run cannot be bf16 rounding)
        self.param_dtype = str(tcfg.training.mixed_precision_param)
        self.precision = audit_trainer(trainer, topo.is_rank0)
        # the optimizer's parameter groups and their weight decay (the no_decay presets)
        self.param_groups = describe_groups(trainer.optimizers)
        betas = next((g.get("betas") for o in getattr(trainer.optimizers, "optimizers", []) for g in o.param_groups
                      if g.get("betas") is not None), None)
        if betas is not None:  # Adam: its second moment's level, for the proof's optimizer-state test
            self.adam_level = AdamLevel(float(betas[1]), int(cfg.adam_check.horizon))
        if self.loader is not None and self.loader.tagging:
            self.data = DataLedgerWriter(topo, self.loader, global_batch=self.global_batch, skip_lr=cfg.skip.lr,
                                         tokenizer=str(Path(tcfg.hf_assets_path).resolve()))
        if self.enabled:
            self._build_recorder(trainer)
        if cfg.proof.scope != "off" and self.loader is not None and self.loader.tagging:
            self.content = ContentMemory(CONTENT_SLOTS, int(cfg.conviction.lookback))
        self.knobs = knobs_of(tcfg)
        self.checkpoint_folder = tcfg.checkpoint.folder  # (the run's episodes name its checkpoints)
        if self.guard is not None:
            self.guard.answer_context = lambda: self.answer_context(tcfg)
        self._apply_state()

    def answer_context(self, tcfg) -> answers.Context:
        """What an incident's answer needs of the run (``format.answers.Context``): its
        settings, its launch, the checkpoints on disk now (rank 0, once per incident)."""
        from titan_ledger.format.reader import checkpoints

        ck = tcfg.checkpoint
        launch = self.launch.header()
        return answers.Context(
            knobs=self.knobs, dump=str(tcfg.dump_folder), argv=tuple(launch["argv"]) if "argv" in launch else None,
            cwd=launch.get("cwd", ""), python=launch.get("python") or "python", world_size=self.topo.world,
            checkpoints=tuple(checkpoints(tcfg.dump_folder, ck.folder)) if ck.enable else (),
            checkpoint_folder=ck.folder, policy=self.config.response.policy, loss_jump=self.config.spike.loss_jump)

    def attach_loss(self, loss_fn, *, per_document: bool, cp_enabled: bool, seq_len: int) -> DocLossTracker | None:
        """Hook the step's signals into the trainer's loss when it is titan_ledger's
        (``doc_loss.find_doc_loss``): log Z (the output-logit drift signal) and, with
        ``per_document`` and no context parallelism (CP splits documents over ranks), the
        per-document loss tracker, which is returned."""
        ours = find_doc_loss(loss_fn)
        if ours is not None and self.config.signals:
            self.logz = ours.logz = LogZStats()
        if ours is not None and per_document and not cp_enabled:
            dl = self.config.doc_loss
            self.doc_loss = ours.tracker = DocLossTracker(dl.k, dl.min_tokens, seq_len)
        return self.doc_loss

    def _claim(self, tcfg) -> str | None:
        """Rank 0: the dump folder holds this run (or, ``--ledger.new_run``, another run is
        moved aside); the refusal, if any, for every rank to raise."""
        cfg = self.config
        layout = {"seq_len": tcfg.training.seq_len, "global_batch": self.global_batch}
        if self.loader is not None:
            layout["fingerprint"] = self.loader.fingerprint
        try:
            moved = claim_dump_folder(tcfg.dump_folder, cfg.folder, layout, new_run=cfg.new_run,
                                      allow_data_change=cfg.allow_data_change,
                                      checkpoint_folder=tcfg.checkpoint.folder,
                                      checkpoint_enabled=tcfg.checkpoint.enable)
        except ConfigError as e:
            return str(e)
        if moved:
            from torchtitan.tools.logging import logger

            logger.warning(f"titan_ledger: --ledger.new_run: the earlier run of another layout "
                           f"was moved aside to {', '.join(moved)}")
        return None

    def _build_recorder(self, trainer) -> None:
        """The signal recorder (and QK-clip, which reads its per-head maxima) for the live model."""
        cfg, topo = self.config, self.topo
        named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
        groups = None
        if cfg.per_layer:
            local_groups = ParamPlan.build(named, topo.world, topo.pp_size).groups
            gathered: list[list[str]] = [None] * topo.world  # type: ignore[list-item]
            if dist.is_initialized():
                dist.all_gather_object(gathered, local_groups)  # once, at setup
            else:
                gathered = [local_groups]
            groups = sorted({g for gs in gathered for g in gs}, key=natural_key)
        plan = ParamPlan.build(named, topo.world, topo.pp_size, groups)
        plan.group_index = plan.group_index.to(self.device)  # no H2D copy per step
        attn = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, MaxLogitRecorder)]
        for m in attn:
            m.record_max_logit = cfg.max_logit
        qk_cfg = getattr(trainer.config, "qk_clip", None)
        if qk_cfg is not None and qk_cfg.enable:
            from torchtitan.models.common.attention import GQAttention

            from titan_ledger.components.prevention.qk_clip import QKClip

            pd = trainer.parallel_dims
            self.qk_clip = QKClip(qk_cfg, trainer.model_parts,
                                  n_layers=sum(1 for _ in trainer.config.model_spec.model.traverse(GQAttention.Config)),
                                  tp_rank=topo.tp_rank, tp_size=pd.tp if pd.tp_enabled else 1)
        if trainer.parallel_dims.pp_enabled:
            forget_pp_metadata_inference(trainer.pp_schedule, attn,
                                         also=[x.rewind_step for x in (self.doc_loss, self.logz) if x])
        self.recorder = SignalRecorder(
            topo, device=self.device, plan=plan, attn=attn, per_layer=cfg.per_layer,
            max_logit=cfg.max_logit, max_norm=float(trainer.config.training.max_norm),
            global_batch=self.global_batch, seq_len=trainer.config.training.seq_len,
            doc_loss=self.doc_loss, logz=self.logz, qk_clip=self.qk_clip, note_of=is_note)
        if cfg.spike.enable:
            self.guard = SpikeGuard(topo, cfg.spike, cfg.response.action, self.device)


def knobs_of(tcfg) -> answers.Knobs:
    """The run's settings an answer's fix changes, read from its config (the first
    parameter group's optimizer kwargs: ``--optimizer.lr``/``eps``/``betas`` alias them)."""
    groups = getattr(getattr(tcfg, "optimizer", None), "param_groups", None) or []
    kw = dict(groups[0].optimizer_kwargs) if groups else {}
    betas = kw.get("betas")
    qk = getattr(tcfg, "qk_clip", None)
    model = getattr(tcfg, "model", None)
    z = getattr(getattr(tcfg, "loss", None), "z_loss_weight", None)

    def f(v):
        return float(v) if isinstance(v, (int, float)) else None

    return answers.Knobs(
        lr=f(kw.get("lr")), eps=f(kw.get("eps")),
        betas=(float(betas[0]), float(betas[1])) if isinstance(betas, (list, tuple)) and len(betas) == 2 else None,
        warmup_steps=int(tcfg.lr_scheduler.warmup_steps) if hasattr(tcfg, "lr_scheduler") else None,
        qk_norm=bool(getattr(model, "qk_norm", False)) if model is not None else None,
        qk_clip=float(qk.threshold) if qk is not None and qk.enable else None,
        z_loss=f(z), steps=int(tcfg.training.steps), dtype=str(getattr(tcfg.training, "dtype", "float32")),
        snapshots=int(tcfg.ledger.snapshots.every) if hasattr(tcfg, "ledger") else None)
