"""The run around the steps: ``run_folder`` (which run a dump folder holds, the
launch), ``run_lock`` (one live run per dump folder), ``disk_space`` (what the run will
write against the free space), ``patches`` (torchtitan globals swapped for one call)."""
