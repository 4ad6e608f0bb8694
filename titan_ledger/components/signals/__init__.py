"""What a step measures: topology (who owns what), the recorder (one collective per
step), the signal math (``sums``), per-document loss and log Z, the attention max logit,
the precision audit, and ``StepRecord``, the one object a step's facts travel in."""
