"""Environments for multi-turn agent rollouts: protocol, registry and built-ins."""

from megatron_stepwise.envs.base import EnvSpec, Environment, get_env_spec, list_envs, make_env, register_env

__all__ = ["EnvSpec", "Environment", "get_env_spec", "list_envs", "make_env", "register_env"]
