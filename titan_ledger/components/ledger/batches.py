"""The step's batches as the ledger takes them: :class:`Batches`.

Design decision: torchtitan's ``batch_generator`` stays the one source of batches; the
trainer's override wraps it so that each batch, as it is fetched, lands in the step's
``StepRecord`` -- fetch time, the label count torchtitan's throughput counters took,
provenance (the sample-id tags, ``Ledger.take_provenance``) -- after the rehearsal's
batch replacement (``--ledger.rehearsal.inject STEP:RANK:repeat|random``), which must
happen before the step counts its tokens.
"""

from __future__ import annotations

import time

from torchtitan.components.dataloader import DataloaderExhaustedError

from titan_ledger.rehearsal import faults


class Batches:
    """``LedgerTrainer.batch_generator``: torchtitan's generator (``generator``), and per batch the fetch
    time, provenance and rehearsal replacement of the step's record. An iterator object,
    not a generator: a generator that raised ``DataloaderExhaustedError`` is finished,
    and a rollback decided at the end of the data (``Recovery.at_data_end``) fetches
    again, from the checkpoint's position."""

    def __init__(self, trainer, data_iterable, generator):
        self.trainer, self.data, self.generator, self.inner = trainer, data_iterable, generator, None

    def __iter__(self):
        return self

    def __next__(self):
        t = self.trainer
        if self.inner is None:
            self.inner = self.generator(t, self.data)
        t0 = time.perf_counter()
        try:
            faults.data_runs_out(t)  # ADDED (rehearsal): --ledger.rehearsal.data_end N
            input_dict, labels = next(self.inner)
        except DataloaderExhaustedError:
            self.inner = None
            raise
        rec = t.step_record
        if rec is not None:
            rec.data_loading_s += time.perf_counter() - t0
            rec.fetched.append(labels.numel())  # what torchtitan's throughput counters took
            if rec.inject is not None:  # ADDED (repeat, random)
                labels = faults.replace_batch(input_dict, labels, rec.inject, t.tokenizer.get_vocab_size(),
                                              seed=t.step)
            t.ledger.take_provenance(rec, input_dict, labels)
        return input_dict, labels
