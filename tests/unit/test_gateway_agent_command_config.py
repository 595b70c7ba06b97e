"""`env.agent_command` in the config: a command line or a list, never beside `env.agent`, a program that exists."""

from __future__ import annotations

import pytest

from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.options import OptionError


def test_a_string_is_split_as_a_shell_would_and_a_list_taken_as_it_is():
    assert AgentConfig(agent_command="python -m my_agent --name 'a b'").argv() == [
        "python",
        "-m",
        "my_agent",
        "--name",
        "a b",
    ]
    assert AgentConfig(agent_command=["bash", "-c", "echo hi"]).argv() == ["bash", "-c", "echo hi"]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"agent": "m:f", "agent_command": "python x.py"}, ["env.agent_command", "env.agent", "set only one"]),
        ({"agent_command": []}, ["env.agent_command", "non-empty list"]),
        ({"agent_command": ["python", ""]}, ["env.agent_command", "non-empty strings"]),
        ({"agent_command": 3}, ["env.agent_command", "got 3"]),
    ],
)
def test_a_bad_agent_command_names_the_key(fields, words):
    with pytest.raises(OptionError) as e:
        AgentConfig(**fields)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["env.agent=tests.unit.test_gateway_agents:sync_agent", "env.agent_command=python x.py"],
            ["env.agent_command", "set only one"],
        ),
        (["env.agent_command=no-such-program-here --flag"], ["env.agent_command", "no program 'no-such-program-here'"]),
    ],
)
def test_validate_refuses_both_agents_and_a_missing_program(tmp_path, overrides, words):
    from config_fakes import FakeProbes

    from megatron_stepwise.config import load_config
    from megatron_stepwise.config.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text("name: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(config), overrides, probes=FakeProbes(modules=()))
    problems = [str(p) for p in e.value.problems]
    assert any(all(w in p for w in words) for p in problems), problems


def test_a_runnable_command_passes_validate(tmp_path):
    from config_fakes import FakeProbes

    from megatron_stepwise.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("name: x\n")
    cfg = load_config(
        str(config), ["env.agent_command=python examples/echo_agent_command.py"], probes=FakeProbes(modules=())
    )
    assert cfg.env.own_agent and AgentConfig.from_section(cfg.env).argv() == [
        "python",
        "examples/echo_agent_command.py",
    ]
