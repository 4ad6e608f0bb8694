"""The command-line tools (lookup, diagnose, rollback, replay, rerun, plot, report,
prepare, launch): the top layer; they read the format and may run training."""
