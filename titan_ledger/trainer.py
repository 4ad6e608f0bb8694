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
