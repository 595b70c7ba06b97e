"""Work on a finished run's files, after training: `replay.py` trains a dumped iteration again
(checkpoint before it, same rounds, any layout) and compares; `dump_trust.py` is what `view` and
`replay` take from a dump they did not write (its config validated, its tokenizer). Above the
loop: replay runs the loop's own `TrainingRound`."""
