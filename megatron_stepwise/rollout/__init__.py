"""Rollout: engines that generate tokens with log-probs, a Ray fleet of them, the agent loop.

- engine.py        the `Engine` protocol, `SamplingParams`, `GenerateResult` (log-prob convention)
- sglang.py        `SGLangClient` (the `Engine` protocol over SGLang's HTTP API) + server launcher
- fleet.py         `RolloutFleet`: Ray engine actors, routing, concurrency, weight updates, faults
- engine_router.py `EngineRouter` and an agent worker's `EngineView`
- session_routing.py the routing policies (`rollout.routing`): sticky, budget_sticky, round_robin
- agent_loop.py    `AgentLoop`: the step-wise multi-turn loop emitting one `Step` per turn
- context.py, env_calls.py, routing.py, auth.py: prompts per turn, env calls, routed experts, keys
- embedded/        the embedded CPU engine (`LocalEngine`) and its SGLang-compatible server
"""
