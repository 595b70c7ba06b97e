"""The rollout side of the loop, off the training ranks: agent workers (Ray actors running the
agent loop, `agent_workers.py`), the prepared rows they keep until the ranks fetch them
(`worker_rows.py`) and the rollout bank, finished groups on disk until trained (`rollout_bank.py`; a resume's
reuse of them: `bank_recovery.py`; the files' format: `rundir/bank_files.py`).
No training loop: the loop's sources call these."""
