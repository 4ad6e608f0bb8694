"""Response: what a flag makes happen. ``recovery`` (the one protocol the trainer calls:
deferred decisions, rollback, skip windows, stop), ``ladder`` (the escalating rungs),
``reexecution`` (one way to execute a step again), ``verdict`` (the proof's pure
decisions), ``prover`` (the flagged step re-executed before its update) and
``counterfactual`` (the replay rerun's trainer side)."""
