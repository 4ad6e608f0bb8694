"""The CPU rehearsal backend (torchtitan on CPU/gloo) and fault injection (bitflip, swap)."""
