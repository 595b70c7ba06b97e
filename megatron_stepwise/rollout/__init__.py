"""Rollout: engines that generate tokens with log-probs, a Ray fleet of them, the agent loop.

- engine.py      the `Engine` protocol, `SamplingParams`, `GenerateResult` (log-prob convention)
- sampling.py    next-token sampling (temperature / top-p / top-k) with SGLang's log-prob convention
- hf_model.py    HF causal LMs for the embedded engine: build from a config, checked weight loads
- local.py       `LocalEngine`: the embedded CPU engine (batched decode, KV cache, pause/abort)
- server.py      that engine behind SGLang's native HTTP endpoints (`megatron-stepwise serve`)
- sglang.py      `SGLangClient` (the `Engine` protocol over SGLang's HTTP API) + server launcher
- fleet.py       `RolloutFleet`: Ray engine actors, routing, concurrency, weight updates, faults
- agent_loop.py  `AgentLoop`: the step-wise multi-turn loop emitting one `Step` per turn
"""
