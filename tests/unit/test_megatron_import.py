"""megatron-core's torch.compile decorations are deferred to the first call (mcore/runtime/megatron_import.py)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_stepwise.mcore.runtime.megatron_import import deferred_compile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recording_compile(calls):
    def compile_fn(model, **options):
        calls.append((model, options))
        return lambda *a, **k: ("compiled", model(*a, **k))

    return compile_fn


def test_a_decorated_function_is_compiled_once_at_its_first_call_with_the_same_options():
    calls = []
    compile = deferred_compile(_recording_compile(calls))

    @compile
    def add(a, b=1):
        return a + b

    @compile(dynamic=False, mode="max-autotune")
    def double(x):
        return 2 * x

    assert calls == []  # decorating compiles nothing
    assert add(1, b=2) == ("compiled", 3) and add(5) == ("compiled", 6)
    assert double(4) == ("compiled", 8)
    assert [(fn.__name__, options) for fn, options in calls] == [
        ("add", {}),
        ("double", {"dynamic": False, "mode": "max-autotune"}),
    ]
    assert add.__name__ == "add" and add.__wrapped__.__name__ == "add"


def test_a_module_is_handed_to_torch_compile_at_once():
    calls = []
    module = torch.nn.Linear(2, 2)
    deferred_compile(_recording_compile(calls))(module, fullgraph=True)
    assert calls == [(module, {"fullgraph": True})]


@pytest.mark.timeout(120)
@pytest.mark.launches  # a fresh interpreter, to see what a training process's start imports
def test_a_training_process_starts_megatron_without_importing_the_compiler():
    code = (
        "import sys, torch\n"
        "compile = torch.compile\n"
        "from megatron_stepwise.mcore.runtime.runtime import init_distributed\n"
        "init_distributed()\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'the compiler was imported'\n"
        "assert torch.compile is compile, 'torch.compile was not restored'\n"
        "assert jit.jit_fuser is not compile\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100, env=env, cwd=REPO)
