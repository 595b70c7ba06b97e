"""The trajectory viewer: self-contained HTML pages of a dumped iteration (`megatron-stepwise view`).

`page.paginate` walks a rollout dump (rundir/dumps.py) one trajectory at a time into pages of at
most `page.PAGE_TOKENS` tokens: trajectories, their turns (prompt delta and response), every
token with its role (trained, appended EOS, observation/prompt), advantage and engine-vs-trainer
log-prob gap. `page.write_pages` adds the run's reward and length curves and writes one file, or an
index and numbered pages, each `template.html` (CSS and JavaScript, no external resource) with the
data inlined, opening from disk without a server.
"""
