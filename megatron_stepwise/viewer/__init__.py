"""The trajectory viewer: one self-contained HTML page of a dumped iteration (`megatron-stepwise view`).

`page.build_data` turns a rollout dump (loop/dumps.py) and the run's metrics.jsonl into plain
JSON: trajectories, their turns (prompt delta and response), every token with its role
(trained, appended EOS, observation/prompt), advantage and engine-vs-trainer log-prob gap, and
the run's reward and length curves. `page.render` inlines that JSON and `template.html` (CSS and
JavaScript, no external resource) into one file that opens from disk without a server.
"""
