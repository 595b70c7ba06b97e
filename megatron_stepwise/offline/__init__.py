"""Work on a run's files outside training: `replay.py` trains a dumped iteration again
(checkpoint before it, same rounds, any layout) and compares; `evaluate.py` scores a checkpoint or
an HF directory on the eval sets (`megatron-stepwise eval`); `dump_trust.py` is what `view` and
`replay` take from a dump they did not write (its config validated, its tokenizer). Above the
loop: replay runs the loop's own `TrainingRound`, evaluation its `Evaluator`."""
