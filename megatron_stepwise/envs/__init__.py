"""Environments for multi-turn agent rollouts: protocol, registry and built-ins.

- base.py            the `Environment` protocol and the registry (`register_env`, `make_env`)
- custom.py          users' environments by dotted path (`module:Name`) and reward-function-only ones
- calculator.py      `calculator`: word problems with a <calc> tag, for small pretrained chat models
- echo.py            `echo`: "say D" over several turns, learnable by a tiny model on CPU
- math_tool.py       `math_tool`: arithmetic word problems solved with a sandboxed Python tool
- judge.py           `env.judge`: rewards from an LLM judge (a served model reads the trajectory)
- tool_calls.py      tool schemas (`tools=`), the Hermes/Qwen `<tool_call>` parser, tool-result messages
- sandbox.py         runs model-written Python in a subprocess with time, memory, network limits
- sandbox_command.py runs an agent command in the sandbox, its one way out a socket the gateway serves
- search.py          `search`: Search-R1-shaped retrieval QA over a small shipped corpus
- bm25.py            Okapi BM25 over an in-memory corpus (used by `search`)
- data/              problems, corpus and questions

The built-in environments register themselves on import; importing this package (or any module
of it: `envs.base`, where `register_env` and `make_env` are) imports them.
(The shipped tokenizers they name live in `megatron_stepwise.hf.tokenizers`.)
"""

from megatron_stepwise.envs import calculator, echo, math_tool, search  # noqa: F401  (register the built-ins)
