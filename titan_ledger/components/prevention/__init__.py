"""Prevention: what keeps spikes from happening. ``qk_norm`` ([model] qk_norm),
``qk_clip`` (QK-clip after the update), ``optimizer`` (parameter groups, the no_decay
presets, LR scaling)."""
