"""What runs in and around the training step, grouped by concern (docs/architecture.md):

* ``signals``    -- what a step measures: topology (who owns what), the recorder (one
  collective), the signal math, per-document loss, the attention max logit, precision,
  and the ``StepRecord`` a step's facts travel in;
* ``detection``  -- the spike rules and the guard that turns their flag into events and
  the device-side update guard;
* ``response``   -- what a flag makes happen: the recovery protocol (deferred decisions,
  rollback, skip, stop), the ladder, the proof at the alarm (the prover and its pure
  verdicts), the replay rerun's trainer side;
* ``prevention`` -- what keeps spikes from happening: QK-norm, QK-clip, the optimizer's
  parameter groups and weight-decay presets;
* ``ledger``     -- the ``[ledger]`` config that composes the above, the writers and the
  dashboards (every row and event leaves through it);
* ``run``        -- the run around the steps: the dump folder's run identity and lock,
  disk space, the torchtitan globals swapped for one call.

Layers (pyproject.toml, import-linter): ledger > response > detection | prevention >
signals | run. Never imports tools, the trainer or the config front end."""
