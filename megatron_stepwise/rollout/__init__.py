"""Rollout: engines that generate tokens with log-probs, a Ray fleet of them, the agent loop.

Three rooms, each importing only the rooms below it (import-linter contract `rollout-rooms`):
- fleet/    N engine actors on Ray behind one `generate` (`RolloutFleet`, fleet.py): the engine
            actor, the router and its session policies, Ray start, placement and room checks
- agent/    the step-wise multi-turn agent loop (`AgentLoop`, loop.py): each turn's prompt
            (context.py), continued turns, environment calls and their checked results
- engines/  the `Engine` protocol (protocol.py), `SGLangClient` (sglang.py), API keys (auth.py),
            routed experts (routed_experts.py) and the embedded CPU engine (embedded/)
"""
