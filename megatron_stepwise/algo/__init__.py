"""The step-wise batch pipeline: pure Python/torch, no Megatron or Ray imports.

- validate.py    `validate_steps`: reject malformed batches, naming the step and the field
- advantages.py  outcome estimators (GRPO, Dr.GRPO, RLOO, MAXRL; registry), broadcast per step
- turn_credit.py turn-level estimators (return-to-go baselines, turn-discounted outcome)
- distill.py     on-policy distillation: per-token advantage from a teacher's log-probs (`opd`)
- merge.py       `merge_trajectories` (a group's trajectories), `merge_steps` (a flat list): prefix merge
- groups.py      `RolloutGroup`, the `PromptGroup` protocol (prompt_id, summary()), `groups_of` (a flat list grouped once)
- prepare.py     `prepare`: whole groups -> advantages, merge, the StepBatch the plugin trains on
- batching.py    DP padding and prompt-based mini-batches
- planner.py     `plan_microbatches`: cost-balanced DP split into token-budget micro-batches
- reductions.py  loss reductions as per-token weights with a global denominator
- losses.py      PPO clip / dual-clip, GSPO, CISPO, TIS, IcePop, KL, entropy; loss registry

The public names are exported from the package root, `megatron_stepwise`; see docs/architecture.md.
"""

from megatron_stepwise.algo import distill, turn_credit  # noqa: F401  (they register opd and the turn-level estimators)
