"""``LedgerTrainer``: torchtitan 0.3.0's ``Trainer`` with the ledger attached.

Design decision: subclass, do not fork. The subclass redeclares the nested
``Config`` (otherwise ``config.build()`` would silently build a plain ``Trainer``),
adds the ``ledger`` section, and overrides only the hooks torchtitan exposes:
``__init__`` (adapt the config to the CPU backend before the model is built) and
``post_dataloading_process`` (dense document mask for the CPU attention). Any
torchtitan code copied here is marked ``# CHANGED from torchtitan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import contextlib

import torch

from titan_ledger import backend

backend.ensure_installed()

from torchtitan.trainer import Trainer  # noqa: E402

from titan_ledger.cpu_attention import document_causal_mask  # noqa: E402
from titan_ledger.ledger import Ledger  # noqa: E402


class LedgerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's training config plus the ``ledger`` section."""

        ledger: Ledger.Config = field(default_factory=Ledger.Config)
        """titan_ledger settings: signals, data ledger, spike response."""

    config: Config
    ledger: Ledger

    def __init__(self, config: Config):
        backend.check(config.ledger.device)
        backend.adapt_config(config)
        self._dense_masks = backend.uses_cpu_attention(config.model_spec.model)
        self.ledger = config.ledger.build()
        dry_run = config.comm.mode == "fake_backend"
        if dry_run and config.debug.seed is None:
            # torchtitan would broadcast rank 0's random seed; a fake PG returns none.
            config.debug.seed = 0
        with _meta_materialization() if dry_run else contextlib.nullcontext():
            super().__init__(config)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self._dense_masks:
            positions = extra_kwargs.get("positions")
            if positions is None:
                raise ValueError(
                    "the CPU attention needs per-document 'positions' from the dataloader"
                )
            extra_kwargs["attention_masks"] = document_causal_mask(positions)
        return inputs, labels, extra_kwargs


@contextlib.contextmanager
def _meta_materialization():
    """Dry run: build every shard on the meta device instead of allocating it.

    torchtitan's fake backend moves no data, so real weights would only cost time
    (initialising 70B / 64 ranks of fp32 takes many minutes on a CPU). Trainer
    reads ``utils.device_type`` when it picks the init device; pointing it at
    "meta" for the duration of ``__init__`` keeps every other step real: meshes,
    TP/FSDP/PP wrapping, init functions, optimizer, dataloader, checkpointer.
    """
    import torchtitan.tools.utils as tt_utils

    saved = tt_utils.device_type
    tt_utils.device_type = "meta"
    try:
        yield
    finally:
        tt_utils.device_type = saved
