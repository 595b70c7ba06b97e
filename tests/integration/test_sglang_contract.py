"""Every request SGLangClient sends must exist in the pinned SGLang, read from its wheel.

sglang cannot be imported without a GPU stack, so its sources are read statically (ast) from the
wheel (`pip download --no-deps`, cached under ~/.cache/megatron-stepwise/): the request classes in
`sglang/srt/managers/io_struct.py`, the sampling params in `sglang/srt/sampling/sampling_params.py`,
the JSON contract of /generate in `sglang/api/v1/api_types.py`, and the routes in
`sglang/srt/entrypoints/http_server.py`. The client is run against a local capture server and each
captured request is checked: path and method exist, body fields exist in the handler's request
class, required fields are present. If the wheel cannot be downloaded the test FAILS (no skip).
"""

from __future__ import annotations

import ast
import asyncio
import os
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from aiohttp import web
from helpers import run_launch
from source_ast import parse_python  # ast.parse, past CPython 3.11's spurious SystemError

from megatron_stepwise.rollout.engines.embedded import generate_fields
from megatron_stepwise.rollout.engines.embedded.generate_response import generate_response
from megatron_stepwise.rollout.engines.embedded.server import OWN_ROUTES, EngineServer
from megatron_stepwise.rollout.engines.protocol import MEMORY_TAGS, GenerateResult, SamplingParams
from megatron_stepwise.rollout.engines.sglang import (
    SGLANG_VERSION,
    SGLangClient,
    TensorHandles,
    serialize_tensors_sglang,
)

# Longer than the suite's 600 s: fetching the pinned sglang wheel is allowed 900 s.
pytestmark = pytest.mark.timeout(1200)

CACHE = Path(os.environ.get("MEGATRON_STEPWISE_CACHE", "~/.cache/megatron-stepwise")).expanduser() / "sglang-wheel"
FILES = {
    "io_struct": "sglang/srt/managers/io_struct.py",
    "http_server": "sglang/srt/entrypoints/http_server.py",
    "sampling_params": "sglang/srt/sampling/sampling_params.py",
    "api_types": "sglang/api/v1/api_types.py",
    "constants": "sglang/srt/constants.py",
    "exec_args": "sglang/srt/arg_groups/fields/exec_.py",
    "scheduler": "sglang/srt/managers/scheduler.py",
    "schedule_batch": "sglang/srt/managers/schedule_batch.py",
    "logprob_results": "sglang/srt/managers/scheduler_components/logprob_result_processor.py",
    "logprob_processor": "sglang/srt/layers/logprob_processor.py",
}


def _download_wheel() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(CACHE)]
    attempts = [
        base + [f"sglang=={SGLANG_VERSION}"],
        # The wheel is CPython-3.11/manylinux specific: ask for that one explicitly from other interpreters.
        base
        + [
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_34_x86_64",
            f"sglang=={SGLANG_VERSION}",
        ],
    ]
    errors = []
    for cmd in attempts:
        proc = run_launch(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if found:
            return found[0]
        errors.append(proc.stderr[-1500:])
    pytest.fail(
        f"could not download the sglang=={SGLANG_VERSION} wheel from PyPI into {CACHE} (no network?); "
        f"the SGLang contract cannot be checked without it.\n" + "\n---\n".join(errors),
        pytrace=False,
    )


@pytest.fixture(scope="module")
def sglang():
    wheel = _download_wheel()
    with zipfile.ZipFile(wheel) as z:
        return {k: parse_python(z.read(p).decode("utf-8"), p) for k, p in FILES.items()}


# ---- static reading of the sources ------------------------------------------------------------


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def class_fields(tree: ast.Module, name: str) -> dict[str, bool]:
    """{field: has_default} of a dataclass / msgspec.Struct, including bases defined in the module."""
    classes = _classes(tree)
    if name not in classes:
        raise AssertionError(f"class {name} not found in SGLang sources")
    fields: dict[str, bool] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(tree, base.id))
    for node in classes[name].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            fields[node.target.id] = node.value is not None
    return fields


def routes(tree: ast.Module) -> dict[str, dict]:
    """{path: {"methods": set, "body": request class name or None, "params": handler arg names}}."""
    out: dict[str, dict] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_cls = None
        for arg in fn.args.args:
            ann = arg.annotation
            if ann is None:
                continue
            if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
                ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            if isinstance(ann, ast.Name) and (ann.id.endswith("ReqInput") or ann.id.endswith("Req")):
                body_cls = ann.id
        for dec in fn.decorator_list:
            if not (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and ast.unparse(dec.func.value) == "app"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                methods = next(ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods")
            elif kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            else:
                continue
            entry = out.setdefault(
                dec.args[0].value, {"methods": set(), "body": body_cls, "params": {a.arg for a in fn.args.args}}
            )
            entry["methods"].update(m.upper() for m in methods)
    return out


def dict_keys_returned(tree: ast.Module, function: str) -> set[str]:
    fn = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == function)
    return {k.value for d in ast.walk(fn) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}


# ---- capturing the client's requests ------------------------------------------------------------


async def capture_client_requests() -> list[dict]:
    captured: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        captured.append({"method": request.method, "path": request.path, "query": dict(request.query), "body": body})
        if request.path == "/generate" and body.get("logprob_start_len", -1) >= 0:  # a prompt scored
            ids = body["input_ids"][body["logprob_start_len"] :]
            entries = [[None if i == 0 else -0.5 * i, t, None] for i, t in enumerate(ids)]
            meta = {"id": "y", "finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": entries}
            return web.json_response({"text": "", "output_ids": [], "meta_info": {**meta, "output_token_logprobs": []}})
        if request.path == "/generate":
            return web.json_response(
                {
                    "text": "ab",
                    "output_ids": [5, 6],
                    "meta_info": {
                        "id": "x",
                        "finish_reason": {"type": "stop", "matched": 6},
                        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                        "weight_version": "3",
                        "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                    },
                }
            )
        if request.path == "/get_model_info":
            return web.json_response({"model_path": "m", "weight_version": "3"})
        if request.path == "/health":
            return web.Response()
        return web.json_response({"success": True, "message": ""})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = SGLangClient(f"http://127.0.0.1:{port}", tp_size=2)
    try:
        sampling = SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            max_new_tokens=16,
            stop=["</search>"],
            stop_token_ids=[2],
            no_stop_trim=True,
            skip_special_tokens=False,
        )
        result = await client.generate([1, 2, 3], sampling, rid="traj#0/turn0", session="traj#0")
        assert result.output_ids == [5, 6] and result.logprobs == [-0.5, -0.25]
        assert result.finish_reason == "stop" and result.weight_version == 3 and result.token_weight_versions == [3, 3]
        assert await client.score([1, 2, 3, 4], 2) == [-0.5, -1.0]  # a teacher's log-probs of [3, 4]
        await client.update_weights_from_disk("/ckpt/hf", weight_version=4)
        await client.update_weights_from_tensors({"lm_head.weight": torch.zeros(2, 2)}, weight_version=5)
        # colocated mode: release for training, then weights back, the update (as handles), KV cache back
        await client.release_memory_occupation(["weights", "kv_cache"])
        await client.resume_memory_occupation(["weights"])
        handles = TensorHandles(serialize_tensors_sglang({"lm_head.weight": torch.zeros(2, 2)}))
        await client.update_weights_from_tensors(handles, weight_version=5)
        await client.resume_memory_occupation(["kv_cache"])
        await client.release_memory_occupation()  # no tags: everything
        await client.resume_memory_occupation()
        await client.init_weights_update_group("127.0.0.1", 29500, rank_offset=1, world_size=3, backend="nccl")
        await client.update_weights_from_distributed(["lm_head.weight"], ["bfloat16"], [[2, 2]], weight_version=6)
        await client.destroy_weights_update_group()
        await client.pause()
        await client.flush_cache()
        await client.resume()
        await client.abort("traj#0/turn0")
        await client.abort()
        assert await client.health()
        assert await client.weight_version() == 3
    finally:
        await client.close()
        await runner.cleanup()
    return captured


@pytest.fixture(scope="module")
def captured():
    return asyncio.run(capture_client_requests())


# ---- the checks -------------------------------------------------------------------------------


def test_every_endpoint_and_method_exists(sglang, captured):
    table = routes(sglang["http_server"])
    used = {(c["method"], c["path"]) for c in captured}
    assert {p for _, p in used} == {
        "/generate",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/abort_request",
        "/health",
        "/get_model_info",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
    for method, path in sorted(used):
        assert path in table, f"SGLang {SGLANG_VERSION} has no endpoint {path}"
        assert method in table[path]["methods"], f"SGLang serves {path} with {table[path]['methods']}, not {method}"


def test_the_static_reader_finds_what_it_should(sglang):
    """Guards the checker itself: known facts of SGLang 0.5.x must be read back."""
    table = routes(sglang["http_server"])
    assert table["/generate"]["methods"] == {"POST", "PUT"}
    assert table["/update_weights_from_disk"]["body"] == "UpdateWeightFromDiskReqInput"
    assert table["/flush_cache"]["methods"] == {"GET", "POST"} and "timeout" in table["/flush_cache"]["params"]
    disk = class_fields(sglang["io_struct"], "UpdateWeightFromDiskReqInput")
    assert disk["model_path"] is False and disk["rid"] is True  # required; inherited from BaseReq


def test_every_body_field_exists_in_the_request_class(sglang, captured):
    table = routes(sglang["http_server"])
    checked = set()
    for c in captured:
        route = table[c["path"]]
        body = c["body"] or {}
        if c["path"] == "/generate":
            cls = "GenerateReqInput"
        else:
            cls = route["body"]
        if cls is None:
            assert not body, f"{c['path']} takes no JSON body in SGLang, the client sent {sorted(body)}"
            assert set(c["query"]) <= route["params"], f"{c['path']}: unknown query params {c['query']}"
            continue
        fields = class_fields(sglang["io_struct"], cls)
        unknown = set(body) - set(fields)
        assert not unknown, f"{c['path']}: fields {sorted(unknown)} are not in SGLang's {cls} ({sorted(fields)})"
        missing = {f for f, has_default in fields.items() if not has_default} - set(body)
        assert not missing, f"{c['path']}: required fields {sorted(missing)} of {cls} were not sent"
        checked.add(cls)
    assert {
        "GenerateReqInput",
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightsFromTensorReqInput",
        "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "DestroyWeightsUpdateGroupReqInput",
        "PauseGenerationReqInput",
        "ContinueGenerationReqInput",
        "AbortReq",
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
    } <= checked


def test_memory_occupation_requests_match_sglang(sglang, captured):
    """Colocated mode: the release/resume bodies carry SGLang's `tags`, with values among its memory
    types (constants.GPU_MEMORY_ALL_TYPES, which no tags means); the launcher's
    --enable-memory-saver and the resumed weights' missing values (no --enable-weights-cpu-backup)
    are the server options the wheel declares."""
    table = routes(sglang["http_server"])
    assert table["/release_memory_occupation"]["body"] == "ReleaseMemoryOccupationReqInput"
    assert table["/resume_memory_occupation"]["body"] == "ResumeMemoryOccupationReqInput"
    consts = {
        n.targets[0].id: n.value
        for n in sglang["constants"].body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
    }
    all_types = [ast.literal_eval(consts[e.id]) for e in consts["GPU_MEMORY_ALL_TYPES"].elts]
    assert set(all_types) == set(MEMORY_TAGS)
    bodies = [(c["path"], c["body"]) for c in captured if c["path"].endswith("_memory_occupation")]
    assert bodies == [
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {}),
    ]
    server_options = set(class_fields(sglang["exec_args"], "ExecFeatures"))
    assert {"enable_memory_saver", "enable_weights_cpu_backup"} <= server_options


def test_generate_payload_passes_the_json_contract(sglang, captured):
    """/generate bodies also pass SGLang's contract gate (api_types.GenerateRequest; unknown
    sampling_params keys are rejected there) and the server-side SamplingParams."""
    gen = next(c["body"] for c in captured if c["path"] == "/generate")
    assert set(gen) <= set(class_fields(sglang["api_types"], "GenerateRequest"))
    assert gen["input_ids"] == [1, 2, 3] and gen["return_logprob"] is True
    sp = gen["sampling_params"]
    assert set(sp) == {
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "no_stop_trim",
        "skip_special_tokens",
        "sampling_seed",
    }
    assert set(sp) <= set(class_fields(sglang["api_types"], "SamplingParams"))
    assert set(sp) <= set(class_fields(sglang["sampling_params"], "SamplingParams"))


def test_the_score_request_is_sglangs_prompt_scoring_request(sglang, captured):
    """`SGLangClient.score(ids, start)`: /generate with max_new_tokens 0 and logprob_start_len
    start - 1, its fields those of the JSON contract and of the server-side SamplingParams."""
    scored = [c["body"] for c in captured if c["path"] == "/generate" and "logprob_start_len" in c["body"]]
    assert scored == [
        {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 1,
        }
    ]
    assert set(scored[0]) <= set(class_fields(sglang["api_types"], "GenerateRequest"))
    sp = set(scored[0]["sampling_params"])
    assert sp <= set(class_fields(sglang["api_types"], "SamplingParams"))
    assert sp <= set(class_fields(sglang["sampling_params"], "SamplingParams"))


def _source(tree: ast.AST) -> set[str]:
    return {line.strip() for line in ast.unparse(tree).splitlines()}


def test_prompt_log_probs_are_laid_out_as_the_client_and_the_embedded_server_assume(sglang):
    """The wheel's semantics that `SGLangClient.score` and the embedded server
    (rollout/engines/embedded/prompt_logprobs.py) rest on: from position logprob_start_len on, each
    position's logits score the next token; the entries are the prompt's ids from logprob_start_len
    with the values shifted by one (the first entry has none); no temperature on prompt log-probs;
    logprob_start_len counts only with return_logprob and may not pass the prompt's length."""
    assert "logprob_token_ids = req.origin_input_ids[global_start_idx + 1:global_end_idx + 1]" in _source(
        sglang["schedule_batch"]
    )
    results = _source(sglang["logprob_results"])
    assert "req.logprob.input_token_logprobs_val = [None] + input_token_logprobs[:-1]" in results
    assert "input_token_logprobs_idx = req.origin_input_ids[req.logprob_start_len:]" in results
    processor = _classes(sglang["logprob_processor"])["InputLogprobProcessor"]
    assert "log_softmax" in ast.unparse(processor) and "temperature" not in ast.unparse(processor)
    scheduler = _source(sglang["scheduler"])
    assert "if not recv_req.return_logprob and recv_req.logprob_start_len != -1:" in scheduler
    assert "if req.logprob_start_len > len(req.origin_input_ids):" in scheduler


def test_response_fields_the_client_reads_exist(sglang):
    meta = set(class_fields(sglang["api_types"], "GenerateMetaInfo"))
    assert {"output_token_logprobs", "finish_reason", "weight_version", "weight_versions"} <= meta
    assert "input_token_logprobs" in meta  # read by SGLangClient.score
    assert {"version", "start", "end"} == set(class_fields(sglang["api_types"], "WeightVersionSpan"))
    assert "weight_version" in dict_keys_returned(sglang["http_server"], "model_info")
    assert {"text", "meta_info", "output_ids"} <= set(class_fields(sglang["api_types"], "GenerateResponse"))


def test_embedded_server_speaks_the_same_api(sglang):
    """Every route of `megatron-stepwise serve` is an SGLang route with that method, or one of the
    declared routes of our own (which SGLang must not have: a same-named route of SGLang's would
    mean another thing), and its /generate response uses only fields of SGLang's response schema."""
    table = routes(sglang["http_server"])
    # only the routes are read: an engine shaped enough to size the body limits
    sizes = SimpleNamespace(
        max_positions=1024, scheduler=SimpleNamespace(max_batch_size=4), model=torch.nn.Linear(2, 2)
    )
    app = EngineServer(engine=sizes).app()
    for route in app.router.routes():
        path, method = route.resource.canonical, route.method
        if method == "HEAD":
            continue
        if (method, path) in OWN_ROUTES:
            assert path not in table, f"{path} is declared our own, but SGLang has it"
            continue
        assert path in table and method in table[path]["methods"], f"embedded {method} {path} is not SGLang's"
    result = GenerateResult([5, 6], [-0.5, -0.25], "length", weight_version=2)
    resp = generate_response("r", 3, result, True, input_token_logprobs=[[None, 7, None], [-0.1, 8, None]])
    assert set(resp) <= set(class_fields(sglang["api_types"], "GenerateResponse"))
    assert set(resp["meta_info"]) <= set(class_fields(sglang["api_types"], "GenerateMetaInfo"))
    assert resp["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_the_embedded_server_classifies_every_generate_field(sglang):
    """Each field of SGLang's GenerateReqInput is honoured, ignored or refused-when-set by the
    embedded server (a request forwarded by sglang-router carries many of them); none is unknown."""
    fields = set(class_fields(sglang["io_struct"], "GenerateReqInput"))
    assert fields - generate_fields.KNOWN == set()
    ours = generate_fields.HONOURED | generate_fields.UNSUPPORTED | (set(generate_fields.IGNORED) - {"model"})
    assert ours - fields == set(), "fields SGLang does not have"
    tables = [generate_fields.HONOURED, set(generate_fields.IGNORED), generate_fields.UNSUPPORTED]
    assert sum(len(t) for t in tables) == len(generate_fields.KNOWN)  # disjoint
