"""Stock torchtitan ``Trainer`` on the CPU rehearsal backend, for paired benchmarks.

``--module bench.stock_cpu --config debug_cpu_stock`` builds torchtitan's own
``Trainer`` (its unmodified ``train_step``) with only what CPU needs: the backend's
config adaptation and the dense document mask. No ledger. The comparison with
``LedgerTrainer`` on the same config is then exactly the ledger's cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_ledger.rehearsal import backend

backend.ensure_installed()

from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_ledger import config_registry  # noqa: E402
from titan_ledger.components.signals import attention  # noqa: E402
from titan_ledger.components.signals.attention import document_causal_mask  # noqa: E402


class StockCpuTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config):
        attention.adapt_config(config)
        super().__init__(config)

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        extra["attention_masks"] = document_causal_mask(extra["positions"])
        return inputs, labels, extra


def debug_cpu_stock() -> StockCpuTrainer.Config:
    """titan_ledger's ``debug_cpu`` with the stock trainer, torchtitan's own text
    dataloader (same documents and rows) and no ledger section."""
    base = config_registry.debug_cpu()
    config = StockCpuTrainer.Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    )
    config.dataloader = HuggingFaceTextDataLoader.Config(
        dataset=base.dataloader.dataset, dataset_path=base.dataloader.dataset_path)
    return config
