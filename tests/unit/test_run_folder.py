"""titan_ledger.components.run.run_folder: the config digest every segment header
records is stable across processes and across titan_ledger's module layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_ledger.components.run.run_folder import config_digest


def _config(attention: str, address: str = "0x7f00"):
    @dataclass
    class Config:
        attention: str = f"<class '{attention}'>"
        hook: str = f"<function build at {address}>"
        steps: list = field(default_factory=lambda: [1, 2])

        def to_dict(self):
            return {"attention": self.attention, "hook": self.hook, "steps": self.steps}

    return Config()


def test_the_digest_ignores_object_addresses_and_where_our_classes_live():
    a = config_digest(_config("titan_ledger.components.attention.CpuAttention"))
    assert a == config_digest(_config("titan_ledger.components.signals.attention.CpuAttention", "0x7e12"))
    assert a != config_digest(_config("titan_ledger.components.signals.attention.FlexAttention"))
    assert a != config_digest(_config("torchtitan.models.attention.CpuAttention"))  # not ours: its path counts
