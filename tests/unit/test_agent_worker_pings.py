"""A frozen agent worker is given up `rollout.agent_worker_timeout_s` after its last answer, as the
key's help says (issue 58, item 6: it took up to twice that). The frozen-worker runs themselves
are tests/integration/test_worker_loss.py and test_async_worker_rows.py."""

import pytest

from megatron_stepwise.workers.agent_workers import START_TIMEOUT_S, ping_schedule


@pytest.mark.parametrize("timeout_s", [0.5, 3.0, 300.0])
def test_a_started_worker_is_given_up_exactly_the_timeout_after_its_last_answer(timeout_s):
    interval, bound = ping_schedule(timeout_s, started=True)
    # frozen right after answering a ping: the next ping goes out `interval` later and is waited on `bound`
    assert interval + bound == pytest.approx(timeout_s)
    assert 0 < interval < timeout_s and bound > 0


def test_a_worker_that_never_answered_gets_the_start_allowance():
    interval, bound = ping_schedule(3.0, started=False)
    assert bound == START_TIMEOUT_S and interval == pytest.approx(0.75)
