"""The gateway: OpenAI- and Anthropic-compatible HTTP endpoints whose every call is a `Step`.

An agent people already have (an OpenAI-SDK program, an agent framework, a harness speaking
Anthropic's messages API) points its `base_url` at `/trajectories/<id>/v1` and trains as it is.
The gateway renders each call with the policy's chat template, sends token ids to the fleet and
records what the engine received and sampled (docs/gateway.md).

- config.py          the `env.agent*` keys (`env.agent`, `env.agent_command`, caps) (declared here, taken by config/schema.py)
- errors.py          `GatewayError`, answered in the OpenAI or the Anthropic error shape
- messages.py        client messages -> the chat template's messages, and the keys that compare them
- openai_api.py      chat/completions and completions: requests, answers, server-sent events
- anthropic_api.py   messages: content blocks, tool_use / tool_result, streaming events
- recorder.py        one trajectory: each call's prompt (extended or a prefix break) and its `Step`
- server.py          the aiohttp app: routes, auth, body limits, the trajectories it serves
- outcome.py         what an agent run yields (reward, per-call rewards, info) or why it failed
- agents.py          your agent as the source of trajectory groups (the agent loop's interface): a function
- command_agent.py   ... or a command (`env.agent_command`), run per trajectory in the sandbox
"""
