"""A run on disk and in time: the run directory's record, the lifecycle (signals, locks, exits)."""
