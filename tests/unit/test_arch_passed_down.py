"""The model architecture is parsed once, where a run (or a command, a public builder) starts,
and travels as a `GPTArch`: nothing below an entry point parses an HF config again or takes
"a GPTArch or a dict" (docs/architecture.md, 'The parsed architecture travels')."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from source_ast import parse_python

from megatron_stepwise.hf import arch as A
from megatron_stepwise.hf.presets import tiny_config
from megatron_stepwise.mcore.weights import hf_mapping as H

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {"arch_from_hf", "model_spec", "as_arch"}
# The only places an HF config becomes a GPTArch: the run's composition root, config validation,
# and the public API documented with an HF config (each parses once, then passes the GPTArch on).
ENTRY_POINTS = {
    ("megatron_stepwise/compose/components.py", "policy_model"),
    ("megatron_stepwise/config/model_checks.py", "check_parallel"),  # validation (no run composed yet)
    ("megatron_stepwise/config/model_checks.py", "_check_against_checkpoint"),  # the checkpoint's own config
    ("megatron_stepwise/hf/arch.py", "model_spec"),
    ("megatron_stepwise/mcore/train/model.py", "build_gpt_model"),
    ("megatron_stepwise/mcore/train/model.py", "model_provider"),
    ("megatron_stepwise/mcore/train/model.py", "build_model_chunks"),
    ("megatron_stepwise/mcore/weights/convert.py", "export_hf"),
    ("megatron_stepwise/mcore/weights/convert.py", "import_hf"),  # the checkpoint directory's config.json
    ("megatron_stepwise/mcore/weights/sync.py", "WeightSync.__init__"),
    ("tools/bench/bench_weight_sync.py", "bench_model"),
    ("tools/bench/bench_bf16_gap.py", "run"),
}
# Modules below the entry points: every `arch` parameter is a GPTArch, never a config.
BELOW_ROOT = [
    "megatron_stepwise/mcore/weights/hf_mapping.py",
    "megatron_stepwise/mcore/weights/convert.py",
    "megatron_stepwise/mcore/train/model.py",
    "megatron_stepwise/compose/components.py",
    "megatron_stepwise/offline/replay.py",
    "megatron_stepwise/config/model_checks.py",
]


def _functions(tree: ast.AST):
    """(qualified name, function node) of every function and method, nested ones included."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _outer_scopes(tree: ast.Module):
    """(name, node) of each top-level function, each method (`Class.method`) and the module's own
    code (`<module>`): a call inside a nested function counts as its outer function's."""
    loose = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item
        else:
            loose.append(node)
    yield "<module>", ast.Module(body=loose, type_ignores=[])


def _parse_sites() -> set[tuple[str, str]]:
    """(file, function) of every call that turns an HF config into a GPTArch."""
    sites = set()
    files = sorted((ROOT / "megatron_stepwise").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for name, scope in _outer_scopes(parse_python(path.read_text())):
            for node in ast.walk(scope):
                called = node.func if isinstance(node, ast.Call) else None
                if (getattr(called, "id", None) or getattr(called, "attr", None)) in PARSERS:
                    sites.add((rel, name))
    return sites


def test_the_architecture_is_parsed_only_at_entry_points():
    sites = _parse_sites()
    below = sorted(sites - ENTRY_POINTS)
    assert not below, f"an HF config is parsed below the entry points (pass the GPTArch down): {below}"
    assert sites == ENTRY_POINTS, f"entry points that no longer parse (update ENTRY_POINTS): {ENTRY_POINTS - sites}"


@pytest.mark.parametrize("rel", BELOW_ROOT)
def test_arch_parameters_are_typed_gptarch(rel):
    tree = parse_python((ROOT / rel).read_text())
    untyped = []
    for name, fn in _functions(tree):
        for arg in fn.args.args + fn.args.kwonlyargs:
            if arg.arg == "arch":
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if annotation not in ("GPTArch", "Optional[GPTArch]"):
                    untyped.append(f"{name}(arch: {annotation})")
    assert not untyped, f"{rel}: arch parameters that are not a GPTArch: {untyped}"


def test_a_dict_where_a_gptarch_is_expected_fails_at_once():
    """Below the entry points a config dict is a caller's mistake, not something to convert."""
    cfg = tiny_config(num_layers=1)
    qkv_name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(AttributeError, match=r"'dict' object has no attribute"):
        H.canonical_names(cfg)
    with pytest.raises(AttributeError, match=r"'dict' object has no attribute"):
        H.to_hf(qkv_name, torch.zeros(1, 1), cfg)
    with pytest.raises(AttributeError, match=r"'dict' object has no attribute"):
        H.hf_names_for("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", cfg)
    assert not hasattr(H, "as_arch")  # no "GPTArch or dict" converter left to hide the mistake


def test_an_already_parsed_arch_given_to_a_parser_says_so():
    """A GPTArch has some HF keys as attributes; parsing it again used to report a missing key."""
    arch = A.arch_from_hf(tiny_config())
    with pytest.raises(TypeError, match=r"already parsed: pass it to the \*_from_arch builders"):
        A.arch_from_hf(arch)


def test_model_spec_parses_once_and_keeps_the_config_verbatim():
    cfg = tiny_config(num_layers=2)
    spec = A.model_spec(cfg)
    assert isinstance(spec, A.ModelSpec) and spec.hf_config is cfg
    assert isinstance(spec.arch, A.GPTArch) and spec.arch == A.arch_from_hf(cfg)
    assert H.canonical_names(spec.arch) == H.canonical_names(A.arch_from_hf(cfg))
