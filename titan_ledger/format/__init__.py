"""The on-disk format: record schemas and the supersession rule (records), the run's
reader (RunLedger), fast column reads. Imports only ``errors`` and ``data`` (sample ids are data's)."""
