"""Weights: HF conversion, distributed checkpoints, crash-safe files, the push to the fleet."""
