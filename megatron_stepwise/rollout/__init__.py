"""Rollout: engines that generate tokens with log-probs, a Ray fleet of them, the agent loop.

- engine.py      the `Engine` protocol, `SamplingParams`, `GenerateResult` (log-prob convention)
- local.py       embedded CPU engine (HF transformers model, batched, KV cache)
- server.py      that engine over SGLang's HTTP API (`megatron-stepwise serve`)
- sglang.py      SGLang HTTP client + server launcher
- weight_sync.py trainer -> engine weight broadcast groups (gloo)
- fleet.py       Ray fleet: routing, concurrency, weight broadcast, fault handling
- agent_loop.py  the step-wise multi-turn loop emitting `Step`s
"""
