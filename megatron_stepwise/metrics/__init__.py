"""Metrics: trajectory-level rollout metrics and the run logger (`core`), every key (`keys`)."""
