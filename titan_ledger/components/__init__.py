"""What runs inside the training step: topology, signal recorder and math, per-document
loss, attention max logit, spike rules and guard, data-ledger writer, dashboards, and the
``[ledger]`` config that composes them. Never imports tools, the trainer or the CPU shims."""
