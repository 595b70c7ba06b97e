"""Model configs, tokenizers and checkpoints named by a Hugging Face hub id, without any network.

Every test runs against a fake hub cache built under a temporary HF_HOME, with HF_HUB_OFFLINE=1
and sockets refused: a lookup that tried the network would fail loudly.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import run_launch

from megatron_stepwise.cli import main as cli_main
from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.hf import hub
from megatron_stepwise.hf.errors import ModelSourceError
from megatron_stepwise.hf.hub import CHECKPOINT_FILES, TOKENIZER_FILES, locate_offline, resolve_model_dir
from megatron_stepwise.hf.presets import resolve_hf_config, tiny_config
from megatron_stepwise.hf.tokenizers import load_tokenizer, tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "Org/Name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = tiny_config(
    vocab_size=len(json.loads((tokenizer_dir("tiny_word") / "tokenizer.json").read_text())["model"]["vocab"]),
    max_position_embeddings=4096,  # a window the default rollout lengths fit (validate checks it)
)


def add_to_cache(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Write files into the hub cache layout: models--Org--Name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A hub cache holding Org/Name (a tiny Qwen2 config + the tiny_word tokenizer), offline."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    for var in ("HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    files = {"config.json": json.dumps(CONFIG)}
    files.update({p.name: p.read_text() for p in tokenizer_dir("tiny_word").iterdir()})
    add_to_cache(cache, REPO_ID, files)
    load_tokenizer.cache_clear()
    yield cache
    load_tokenizer.cache_clear()


def test_resolve_hf_config_reads_a_cached_hub_id(hf_cache):
    assert resolve_hf_config(REPO_ID) == CONFIG
    assert resolve_hf_config(REPO_ID, vocab_size=7) == CONFIG  # only presets take the tokenizer's vocabulary
    assert resolve_hf_config("tiny", vocab_size=7)["vocab_size"] == 7


def test_load_tokenizer_reads_a_cached_hub_id(hf_cache):
    tok = load_tokenizer(REPO_ID)
    shipped = load_tokenizer("tiny_word")
    assert len(tok) == len(shipped) and tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>"
    # same vocabulary (not the same encode(): next to a qwen2 config.json transformers picks
    # Qwen2Tokenizer, whose pre-tokenizer differs from the shipped word-level one)
    assert tok.get_vocab() == shipped.get_vocab()


def test_local_paths_still_resolve(hf_cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    assert resolve_hf_config(str(model)) == CONFIG
    assert resolve_hf_config(str(model / "config.json")) == CONFIG
    assert locate_offline(str(model / "config.json")) == model
    shutil.copytree(tokenizer_dir("tiny_char"), tmp_path / "tok")
    assert len(load_tokenizer(str(tmp_path / "tok"))) == len(load_tokenizer("tiny_char"))


def test_absent_ids_raise_naming_the_key(hf_cache):
    with pytest.raises(ModelSourceError) as e:
        resolve_hf_config("Org/Absent")
    text = str(e.value)
    assert text.startswith(
        "model.hf_config='Org/Absent': not a preset (tiny, tiny_qwen3, tiny_qwen3_moe, tiny_mixtral), not a local path"
    )
    assert "HF_HUB_OFFLINE=1" in text and str(hf_cache) in text
    with pytest.raises(ModelSourceError, match=r"^model.hf_checkpoint='Org/Absent': not a preset"):
        resolve_hf_config("Org/Absent", key="model.hf_checkpoint")
    with pytest.raises(ModelSourceError, match=r"^model.tokenizer='Org/Absent': not a shipped tokenizer"):
        load_tokenizer("Org/Absent")
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        resolve_hf_config("./no/such/model")
    with pytest.raises(ValueError):  # ModelSourceError is a ValueError
        resolve_model_dir("not/a/valid/id", key="model.hf_config")


def test_a_checkpoint_needs_its_weights_in_the_cache(hf_cache):
    # Org/Name has a config and a tokenizer but no weights: fine as a config, not as a checkpoint.
    assert locate_offline(REPO_ID) == locate_offline(REPO_ID, TOKENIZER_FILES)
    assert locate_offline(REPO_ID, CHECKPOINT_FILES) is None
    with pytest.raises(ModelSourceError, match=r"^model.hf_checkpoint='Org/Name': not a local path"):
        resolve_model_dir(REPO_ID, key="model.hf_checkpoint", files=CHECKPOINT_FILES)
    snapshot = add_to_cache(hf_cache, REPO_ID, {"model.safetensors": "weights"})
    assert resolve_model_dir(REPO_ID, key="model.hf_checkpoint", files=CHECKPOINT_FILES) == snapshot


def test_locate_offline_never_raises(hf_cache):
    for value in ("Org/Absent", "not/a/valid/id", "./missing", "", "tiny"):
        assert locate_offline(value) is None


def test_download_when_online_fetches_only_the_files_needed(hf_cache, monkeypatch):
    """Online, a missing id is downloaded with allow_patterns; the download itself is faked (no network)."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, *, cache_dir, allow_patterns, local_files_only=False):
        calls.append((repo_id, local_files_only, tuple(allow_patterns)))
        if local_files_only:
            raise FileNotFoundError("not cached")
        assert Path(cache_dir) == hf_cache
        return str(add_to_cache(hf_cache, repo_id, {"config.json": json.dumps(CONFIG), "model.safetensors": "w"}))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_hf_config("Org/New") == CONFIG
    assert resolve_model_dir("Org/New", key="model.hf_checkpoint", files=CHECKPOINT_FILES).is_dir()
    assert calls == [
        ("Org/New", True, ("config.json",)),
        ("Org/New", False, ("config.json",)),
        ("Org/New", True, CHECKPOINT_FILES),
        ("Org/New", False, CHECKPOINT_FILES),
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: no download attempt, a clear error
    calls.clear()
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE=1"):
        resolve_hf_config("Org/Other")
    assert calls == [("Org/Other", True, ("config.json",))]


# ---- validation ---------------------------------------------------------------------------------


def test_validation_checks_hub_ids_against_the_cache(hf_cache, monkeypatch):
    config_from_dict({"model": {"hf_config": REPO_ID, "tokenizer": REPO_ID}})
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hf_config": "Org/Absent", "hf_checkpoint": REPO_ID, "tokenizer": "Org/Tok"}})
    assert e.value.keys == ["model.hf_config", "model.hf_checkpoint", "model.tokenizer"]
    assert "looked for *.safetensors" in str(e.value) and "model.allow_download=true" in str(e.value)
    # the parallel layout is checked against the cached config (4 heads, 2 KV heads)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"hf_config": REPO_ID}, "parallel": {"tensor": 4}, "launch": {"nproc_per_node": 4}})
    assert e.value.keys == ["parallel.tensor"] and "Org/Name" in str(e.value)
    allowed = {"model": {"hf_config": "Org/Absent", "hf_checkpoint": "Org/Absent", "allow_download": True}}
    with pytest.raises(ConfigError) as e:  # offline (the fixture): a download could never happen
        config_from_dict(allowed)
    assert e.value.keys == ["model.allow_download"] and "HF_HUB_OFFLINE=1 forbids downloading 'Org/Absent'" in str(
        e.value
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    config_from_dict(allowed)


def write_config(tmp_path: Path, model: dict) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({"model": model}))  # JSON is YAML
    return path


def test_cli_validate_exits_2_for_an_unresolvable_hub_id(hf_cache, tmp_path):
    path = write_config(tmp_path, {"hf_config": "Org/Absent"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1 from the fixture
    env.pop("WORLD_SIZE", None)
    result = run_launch(
        [str(REPO / ".venv/bin/megatron-stepwise"), "validate", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "- model.hf_config: 'Org/Absent' is neither a local path nor in the Hugging Face cache" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_validate_passes_a_cached_id_or_allowed_download(hf_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli_main(["validate", str(write_config(tmp_path, {"hf_config": REPO_ID}))]) == 0
    assert "model Org/Name" in capsys.readouterr().out
    path = write_config(tmp_path, {"hf_config": "Org/Absent", "allow_download": True})
    assert cli_main(["validate", str(path)]) == 2  # HF_HUB_OFFLINE=1 (the fixture) and a download needed
    assert "- model.allow_download: is true but HF_HUB_OFFLINE=1" in capsys.readouterr().err
    assert cli_main(["validate", "--skip-local-checks", str(path)]) == 0  # for the cluster's nodes, not this one
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert cli_main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert cli_main(["validate", str(path), "model.allow_download=false"]) == 2
    assert "- model.hf_config: " in capsys.readouterr().err


def test_hub_module_is_megatron_free():
    # (the package's __init__ imports torch; hub.py itself adds no heavy import)
    code = (
        "import sys, megatron_stepwise.hf.hub; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray', 'transformers', "
        "'huggingface_hub')]; assert not bad, bad"
    )
    subprocess.run([str(REPO / ".venv/bin/python"), "-c", code], check=True, cwd=REPO, timeout=60)
    assert hub.looks_like_path("./x") and not hub.looks_like_path("Org/Name")
