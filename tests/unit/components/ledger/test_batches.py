"""titan_ledger.components.ledger.batches: each fetched batch lands in the step's record
(fetch time, the label count torchtitan's throughput counters took, provenance) after
the rehearsal's replacement, and a generator that ran out is built again (a rollback
decided at the end of the data fetches from the checkpoint's position)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.dataloader import DataloaderExhaustedError

from titan_ledger.components.ledger.batches import Batches
from titan_ledger.components.signals.step_record import StepRecord


def _trainer(batches_per_generator: int):
    taken = []
    t = SimpleNamespace(step=4, step_record=None, tokenizer=SimpleNamespace(get_vocab_size=lambda: 50),
                        config=SimpleNamespace(ledger=SimpleNamespace(rehearsal=SimpleNamespace(data_end=None))),
                        ledger=SimpleNamespace(take_provenance=lambda rec, d, labels: taken.append(labels.clone())))
    built = []

    def generator(trainer, data):
        built.append(data)
        for i in range(batches_per_generator):
            yield {"input": torch.full((2, 3), i)}, torch.full((2, 3), i)
        raise DataloaderExhaustedError()

    return t, taken, built, generator


def test_each_batch_lands_in_the_steps_record_after_the_rehearsal_replacement():
    t, taken, built, generator = _trainer(3)
    it = Batches(t, "the dataloader", generator)
    next(it)  # no step record (the validator's fetch): nothing recorded
    t.step_record = rec = StepRecord(step=4, start=0.0, inject="repeat")
    input_dict, labels = next(it)
    assert rec.fetched == [6] and rec.data_loading_s > 0
    assert torch.equal(labels, torch.full((2, 3), 49)) and torch.equal(taken[-1], labels)  # vocab - 1, recorded
    assert torch.equal(input_dict["input"], torch.full((2, 3), 49))
    assert len(taken) == 1 and built == ["the dataloader"]


def test_a_generator_that_ran_out_is_built_again_at_the_next_fetch():
    t, taken, built, generator = _trainer(1)
    it = Batches(t, "the dataloader", generator)
    next(it)
    with pytest.raises(DataloaderExhaustedError):
        next(it)
    next(it)  # (a rollback reloaded the data position): a new generator
    assert len(built) == 2
