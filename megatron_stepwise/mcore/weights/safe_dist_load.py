"""megatron-core's torch_dist load strategies with every pickle read as data (restricted_unpickle.py).

`dist_checkpointing.load` takes its strategies as arguments, so nothing is patched globally:
`load_strategies()` hands `_load` (dist_checkpoint.py) a sharded strategy whose reader parses
`.metadata` with the restricted unpickler (and confines every storage file it names to the
checkpoint: checkpoint_dir.check_index_paths) and whose planner loads byte items with
`weights_only=True`, and a common strategy that loads `common.pt` the same way (a regular file
under MAX_COMMON_BYTES).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Optional

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from megatron_stepwise.mcore.weights.checkpoint_dir import check_index_paths
from megatron_stepwise.mcore.weights.checkpoint_errors import UnsafeCheckpointError
from megatron_stepwise.mcore.weights.restricted_unpickle import load_index, load_torch_pickle
from megatron_stepwise.rundir.file_reads import UnsafeFileError, read_regular

METADATA_FILE = ".metadata"
MAX_COMMON_BYTES = 1 << 30  # common.pt: the trainer state, scheduler and RNG states, a few MiB


class RestrictedReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by the restricted unpickler (and kept, as
    megatron-core's CachedMetadataFileSystemReader does: the strategy asks twice)."""

    def __init__(self, path: Any):
        super().__init__(path)
        self._index = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        if rank is not None:  # torch's per-rank index (checkpoints saved without collectives)
            return self._read(f"__{rank}{METADATA_FILE}")
        if self._index is None:
            self._index = self._read(METADATA_FILE)
        return self._index

    def _read(self, name: str):
        """The index file `name`, read as data, every storage file it names confined to the checkpoint."""
        source = os.path.join(self.path, name)
        index = load_index(source)
        check_index_paths(index, self.path, source)
        return self._with_load_id(index)

    def _with_load_id(self, metadata):
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RestrictedLoadPlanner(MCoreLoadPlanner):
    """megatron-core's load planner; each byte item is loaded with `weights_only=True` first."""

    def __init__(self, *args: Any, checkpoint_dir: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = checkpoint_dir

    def _source(self, read_item) -> str:
        info = (self.metadata.storage_data or {}).get(read_item.storage_index)
        where = getattr(info, "relative_path", "a .distcp file")
        return f"{os.path.join(self.checkpoint_dir, where)} (item {read_item.storage_index.fqn})"

    def load_bytes(self, read_item, value) -> None:
        load_torch_pickle(value, self._source(read_item))  # raises unless the item is plain data
        value.seek(0)
        super().load_bytes(read_item, value)  # the same in-memory bytes, now known to hold only data


class RestrictedTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """TorchDistLoadShardedStrategy with the restricted reader and planner."""

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        # megatron-core 0.16's TorchDistLoadShardedStrategy.load, with the reader and the planner
        # swapped (it builds both inline).
        flexible_shape_sharded_tensors = [
            sh_ten
            for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch
        ]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten
            for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch
        }
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = RestrictedReader(checkpoint_dir)
        # Parsed (or refused) here, on every rank, before torch reads it: torch.distributed.checkpoint
        # turns a failed read into an AssertionError carrying only the message.
        reader.read_metadata()
        dcp.load_state_dict(
            pyt_state_dict,
            reader,
            planner=RestrictedLoadPlanner(
                shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
                checkpoint_dir=str(checkpoint_dir),
            ),
        )
        self.cached_global_metadata = reader.read_metadata()
        mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(mcore_state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Optional[Any] = None):
        if metadata is None:
            metadata = RestrictedReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        metadata = RestrictedReader(checkpoint_dir).read_metadata()
        sharded_metadata = {}
        for key, storage in metadata.state_dict_metadata.items():
            if isinstance(storage, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded_metadata


class RestrictedCommonLoadStrategy(TorchCommonLoadStrategy):
    """`common.pt` loaded with `weights_only=True` (megatron-core leaves it to torch's default)."""

    def load_common(self, checkpoint_dir):
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        try:
            data = read_regular(path, MAX_COMMON_BYTES)
        except FileNotFoundError as e:
            raise CheckpointingException(f"Common file {path} does not exist") from e
        except UnsafeFileError as e:
            raise UnsafeCheckpointError(f"checkpoint file {e}") from None
        return load_torch_pickle(io.BytesIO(data), path)


def load_strategies() -> dict:
    """The `sharded_strategy` and `common_strategy` arguments of `dist_checkpointing.load`."""
    return {"sharded_strategy": RestrictedTorchDistLoadStrategy(), "common_strategy": RestrictedCommonLoadStrategy()}
