"""Detection: the spike rules (``spike_rules``, pure tensors), the detector that keeps
their histories and tiers (``spikes``), and the guard (``guard``) that turns its flag
into events and into the device-side update guard."""
