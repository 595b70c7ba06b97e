"""The run's parts built from an experiment config: `components.py` (runtime, tokenizer, model,
optimizer, scheduler, plugin, dataset, fleet, agent loop, weight sync), `placement.py` (the log
line of where the Ray actors landed). No loop: the trainer, the evaluator, the offline replay and
each agent worker build what they need here."""
