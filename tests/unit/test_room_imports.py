"""The training side's rooms (docs/architecture.md, Layers) keep their heavy imports lazy: importing
the builders (compose/), the agent workers (workers/) or the loop loads no Megatron, Ray or SGLang
(each builder, actor or fleet call imports them when it runs)."""

import subprocess
import sys

import pytest

ROOMS = [
    "megatron_stepwise.compose.components",
    "megatron_stepwise.workers.agent_workers",
    "megatron_stepwise.loop.trainer",
    "megatron_stepwise.offline.dump_trust",
]
HEAVY = ["megatron", "ray", "sglang", "transformer_engine"]


@pytest.mark.launches  # a fresh interpreter: this one has imported everything already
def test_importing_the_rooms_loads_no_megatron_ray_or_sglang():
    code = (
        "import importlib, sys\n"
        f"for m in {ROOMS!r}: importlib.import_module(m)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
