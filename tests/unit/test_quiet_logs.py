"""Warnings that are ours to silence stay silent: transformers' past_key_values deprecation from
the embedded engine, and Ray's token-auth notice for the private local instance."""

import asyncio
import logging
import warnings

from helpers import tiny_lm

from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams

TOK, CONFIG = tiny_lm("tiny_char")


def test_the_embedded_engine_decodes_without_a_kv_cache_deprecation_warning(caplog):
    engine = LocalEngine(CONFIG, tokenizer=TOK, seed=0)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        result = asyncio.run(engine.generate(TOK.encode("hello"), SamplingParams(max_new_tokens=6, temperature=1.0)))
    assert len(result.output_ids) >= 1
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "past_key_values" in m], messages


def test_rays_token_auth_notice_is_dropped_and_other_ray_warnings_are_not(caplog):
    from megatron_stepwise.rollout.fleet.ray_start import quiet_ray_token_notice

    quiet_ray_token_notice()
    quiet_ray_token_notice()  # idempotent: one filter
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Token authentication is disabled for thi"]
