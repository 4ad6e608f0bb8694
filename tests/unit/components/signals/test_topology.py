"""Topology: who owns the loss, the tokens and the data ledger, for every layout."""

from titan_ledger.components.signals.topology import Topology


def test_ownership_rules():
    assert Topology.single().owns_loss and Topology.single().owns_tokens and Topology.single().data_writer
    tp1 = Topology(world=2, rank=1, tp_rank=1, dp_rank_of=(0, 0))
    assert not tp1.owns_loss and not tp1.owns_tokens and not tp1.data_writer
    cp1 = Topology(world=2, rank=1, cp_rank=1, dp_rank_of=(0, 0))
    assert cp1.owns_loss and not cp1.owns_tokens and not cp1.data_writer  # every CP rank adds its loss piece
    first = Topology(world=2, rank=0, pp_size=2, first_stage=True, last_stage=False, dp_rank_of=(0, 0))
    last = Topology(world=2, rank=1, pp_size=2, first_stage=False, last_stage=True, dp_rank_of=(0, 0))
    assert first.data_writer and not first.owns_loss and last.owns_loss and not last.data_writer
