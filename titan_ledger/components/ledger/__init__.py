"""The ledger and its IO: ``ledger`` (the [ledger] config that composes the step's
components; every row, event and dashboard scalar leaves through it), ``data_writer``
(the data ledger), ``dashboards`` (W&B, TensorBoard), ``sections`` (the [ledger.*]
sub-sections)."""
