"""Detection: the spike rules (``spikes``, pure tensors) and the guard (``guard``) that
turns their flag into events and into the device-side update guard."""
