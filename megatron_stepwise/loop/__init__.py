"""The training loop: one loop fed by a mini-batch source, wired from an experiment config.

- `trainer.py`: `Trainer`, the loop (take -> prepare -> score -> train -> push, metrics, checkpoints).
- `training_round.py`: `TrainingRound`, one round's old / ref log-probs and optimizer steps (also replay's).
- `sources.py`: the synchronous source (`SyncRollouts`), `Driver`, `rollout_seed`.
- `rounds.py`: making a round, one path for rows on rank 0 or in the workers (`Round`, `decide_round`, `hand_off`).
- `async_source.py`: the asynchronous source (`AsyncRollouts`): rollouts overlap training.
- `group_buffer.py`: finished prompt groups of the async source and their staleness bound.
- `handoff.py`: rank 0 produces, every rank receives (result, data position, errors).
- `checkpointer.py`: `Checkpointer` over explicit stateful parts; `TrainerState`.
- `colocate.py`, `divergence.py`, `evaluation.py`: colocated engines' memory, the finite check, eval sets.

Its neighbours: the parts are built in `compose/`, the agent workers live in `workers/`, replay and
dump trust in `offline/` (docs/architecture.md, Layers).
"""
