"""The step-wise agent loop: prompts per turn, continued turns, environment calls; drives any engine."""
