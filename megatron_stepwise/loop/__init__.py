"""The training loop: one loop fed by a mini-batch source, built from an experiment config.

- `trainer.py`: `Trainer`, the loop (take -> prepare -> score -> train -> push, metrics, checkpoints).
- `sources.py`: the synchronous source (`SyncRollouts`), `Round`, `Driver`, `rollout_seed`.
- `async_source.py`: the asynchronous source (`AsyncRollouts`): rollouts overlap training.
- `group_buffer.py`: finished prompt groups of the async source and their staleness bound.
- `handoff.py`: rank 0 produces, every rank receives (result, data position, errors).
- `checkpointer.py`: `Checkpointer` over explicit stateful parts; `TrainerState`.
- `components.py`: builders from the config (runtime, model, optimizer, plugin, fleet, agent loop).
"""
