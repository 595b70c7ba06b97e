"""The readers that keep a checkpoint's pickles data (mcore/weights/restricted_unpickle.py)."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import random

import numpy as np
import pytest
import torch

from megatron_stepwise.mcore.weights.checkpoint_errors import UnsafeCheckpointError
from megatron_stepwise.mcore.weights.restricted_unpickle import load_index, load_torch_pickle


class Poison:
    """Unpickling this writes `marker`: what a tampered checkpoint would do instead."""

    def __init__(self, marker, via=builtins.exec):
        self.marker, self.via = str(marker), via

    def __reduce__(self):
        if self.via is os.system:
            return os.system, (f"touch {self.marker}",)
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_real_checkpoint_index_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "h": torch.zeros(4, dtype=torch.bfloat16), "extra": io.BytesIO(b"x")}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        expected = pickle.load(f)  # written just above by torch itself
    got = load_index(tmp_path / ".metadata")
    assert type(got) is type(expected)
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.storage_data == expected.storage_data
    assert got.state_dict_metadata["w"].size == torch.Size([2, 3])


@pytest.mark.parametrize("via,named", [(builtins.exec, "builtins.exec"), (os.system, f"{os.system.__module__}.system")])
def test_a_poisoned_index_is_refused_naming_the_file_and_the_class(tmp_path, via, named):
    marker, path = tmp_path / "MARKER", tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"ok": torch.Size([1]), "bad": Poison(marker, via)}))
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_index(path)
    message = str(refused.value)
    assert f"checkpoint file {path} asks to load {named}" in message and "\n" not in message
    assert not marker.exists()


def test_only_the_named_classes_of_an_allowed_module_load(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(torch.save))  # a function of the torch module: never in an index
    with pytest.raises(UnsafeCheckpointError, match=r"asks to load torch\.serialization\.save"):
        load_index(path)


def test_a_poisoned_torch_save_part_is_refused_and_data_loads(tmp_path):
    marker, path = tmp_path / "MARKER", tmp_path / "common.pt"
    torch.save({"scheduler": {"lr": 0.1}, "poison": Poison(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=rf"checkpoint file {path} asks to load builtins\.exec"):
        load_torch_pickle(path, str(path))
    buf = io.BytesIO()
    torch.save({"poison": Poison(marker)}, buf)
    buf.seek(0)
    with pytest.raises(UnsafeCheckpointError, match=r"checkpoint file item rng asks to load builtins\.exec"):
        load_torch_pickle(buf, "item rng")
    assert not marker.exists()
    # What a checkpoint really holds: tensors, builtin containers, an RNG state with its numpy array.
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, path)
    loaded = load_torch_pickle(path, str(path))
    assert loaded["python"] == rng["python"] and torch.equal(loaded["torch"], rng["torch"])
    assert np.array_equal(loaded["numpy"][1], rng["numpy"][1])
