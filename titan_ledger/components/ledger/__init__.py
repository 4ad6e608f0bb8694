"""The ledger and its IO: ``ledger`` (the [ledger] config that composes the step's
components; every row, event and dashboard scalar leaves through it), ``start`` and
``resume`` (``Ledger``'s mixins: its setup; its segments and checkpointed state), ``data_writer``
(the data ledger), ``dashboards`` (W&B, TensorBoard: what the trainer and the ledger call),
``dashboard_writers`` (the W&B and TensorBoard loggers themselves), ``sections`` (the
[ledger.*] sub-sections)."""
