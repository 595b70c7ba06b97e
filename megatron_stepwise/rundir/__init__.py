"""A run on disk and in time: every path of the run directory (paths.py `RunDir`), what is written
there (the run's record, rollout dumps, metrics lines, safe writes) and the lifecycle (signals,
locks, exits). Files only: the viewer reads runs through this package alone."""
