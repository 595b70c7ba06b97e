"""The embedded engine's weights: loads, their checks, versions and memory release.

Everything here runs on the model thread or between two decode steps (the engine holds the
scheduler's model lock around it). A load writes HF-named tensors into the model and, when the
trainer asks for a sampled check, takes the samples the trainer compares (`weight_checks`).
Every load bumps the weight version and the epoch the running batch compares to know its KV
is stale. Colocated mode follows SGLang's release / resume semantics: released weights keep
shape and dtype with no bytes behind them; resumed ones hold zeros until the next load.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_stepwise import weight_checks
from megatron_stepwise.rollout.engines.embedded import hf_model
from megatron_stepwise.rollout.engines.protocol import EngineReleasedError, NamedTensors


class EngineWeights:
    """The weights of one embedded engine's `model`: `version`, `epoch`, loads, checks, release.

    `behind_loads` queues work on the model thread behind the load that queued it (the engine's
    executor `submit`): the next version's sample positions are prepared there.
    """

    def __init__(self, model: Any, name: str, behind_loads: Callable):
        self.model = model
        self.name = name
        self.version = 0
        self.epoch = 0  # bumped by every weight load; in-flight batches compare it
        self.groups: dict[str, Any] = {}  # weight-update groups joined, by name
        self.released: set[str] = set()  # memory tags released (colocated mode)
        self._behind_loads = behind_loads
        self._freed_storages: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its size) while released
        self._needs_values = False  # weights resumed without their values: a weight update must come first
        self._params_by_name: Optional[dict] = None  # for the weight checks
        self._loaded: tuple = (None, [])  # (version, [(name, tensor)] its sampled updates loaded so far)
        self._positions: Optional[weight_checks.Positions] = None  # the next version's, prepared after a load
        self._names_share_memory: dict[tuple, bool] = {}  # names of a version's updates -> `overlapping`

    # ---- versions ---------------------------------------------------------------------------

    def next_version(self, weight_version: Optional[int]) -> int:
        return self.version + 1 if weight_version is None else int(weight_version)

    def replaced(self, weight_version: Optional[int]) -> int:
        """A load finished: the new version (`weight_version`, else the next), a new epoch."""
        self._needs_values = False
        self.epoch += 1
        self.version = self.next_version(weight_version)
        return self.version

    # ---- loads and their checks -------------------------------------------------------------

    def apply(self, named: NamedTensors, version: int, sample: bool) -> Optional[tuple]:
        """Load `named` into the model as weight `version`; with `sample` also take, from the
        tensors the names now hold, the values the trainer's sampled check compares: (samples,
        seconds the sampling took).

        Each tensor is sampled right after it is written (`weight_checks.Sampler`), unless two
        names of this version's update (this request or an earlier one: a push sent a bucket at a
        time) load into the same memory: then a later write could change a tensor already
        sampled, so every name of the version is sampled by name after the whole load, and shows it."""
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        if not sample:
            hf_model.load_named_tensors(self.model, items)
            if self._positions is not None:  # sampled updates were seen: the next may be one again
                self._prepare_positions_after(version, items)
            return None
        targets = hf_model.load_targets(self.model, items)
        start = time.perf_counter()
        if self._loaded[0] != version:
            self._loaded = (version, [])
        earlier = self._loaded[1]
        earlier.extend((name, target) for (name, _), target in zip(items, targets))
        sampler = None
        if not self._share_memory(earlier):
            positions = self._positions
            if positions is None or positions.version != version:
                positions = weight_checks.Positions(version)
            sampler = weight_checks.Sampler([n for n, _ in items], [t.numel() for t in targets], positions)
        seconds = time.perf_counter() - start
        with torch.no_grad(), weight_checks.plain_torch():
            for i, (target, (_, tensor)) in enumerate(zip(targets, items)):
                target.copy_(tensor.to(target.dtype))
                if sampler is not None:
                    start = time.perf_counter()
                    sampler.take(i, target)
                    seconds += time.perf_counter() - start
        self._prepare_positions_after(version, earlier)
        if sampler is not None:
            start = time.perf_counter()
            samples = sampler.checks()
            return samples, seconds + time.perf_counter() - start
        start = time.perf_counter()
        held = hf_model.weights_by_name(self.model, [name for name, _ in earlier], self._parameters())
        samples = weight_checks.samples_of(held.items(), version)
        return samples, seconds + time.perf_counter() - start

    def _share_memory(self, loaded: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether two of a version's loaded tensors share memory (`weight_checks.overlapping`),
        remembered by their names: which names alias is fixed for the model, and a push loads the
        same names every version."""
        key = tuple(name for name, _ in loaded)
        shared = self._names_share_memory.get(key)
        if shared is None:
            if len(self._names_share_memory) > 64:  # pushes of changing subsets (tests): stay small
                self._names_share_memory.clear()
            shared = self._names_share_memory[key] = weight_checks.overlapping([t for _, t in loaded])
        return shared

    def _prepare_positions_after(self, version: int, loaded: list[tuple[str, torch.Tensor]]) -> None:
        """Queue, behind this load on the model thread (its answer does not wait), the sample
        positions of version + 1 for the names just loaded: the next sampled update's, most likely."""
        names, numels = [n for n, _ in loaded], [t.numel() for _, t in loaded]

        def prepare() -> None:
            if self._positions is None or self._positions.version != version + 1:
                self._positions = weight_checks.Positions(version + 1)
            self._positions.prepare(names, numels)

        with contextlib.suppress(RuntimeError):  # the engine shutting down
            self._behind_loads(prepare)

    def answer(self, version: int, samples: Optional[tuple]) -> Union[int, dict]:
        """The version, or the answer of a sampled update: {"engine", "weight_version", "samples":
        its samples of what it loaded (`weight_checks.Samples`; `Checks` when names shared memory),
        "sample_s": the seconds sampling took}."""
        if samples is None:
            return version
        return {"engine": self.name, "weight_version": version, "samples": samples[0], "sample_s": samples[1]}

    def compare(self, checks: Mapping[str, weight_checks.TensorCheck], version: int) -> dict:
        """{tensor: why it differs} between the weights held now and the trainer's record of a push."""
        held = hf_model.weights_by_name(self.model, list(checks), self._parameters())
        return weight_checks.compare_all(held, checks, version)

    def _parameters(self) -> dict:
        if self._params_by_name is None:  # the parameter objects live as long as the model
            self._params_by_name = hf_model.parameters_by_name(self.model)
        return self._params_by_name

    def manifest(self) -> dict:
        """{HF name: {shape, dtype, sha256}} of every weight held now (a tied `lm_head` is left
        out, as a sync never sends it)."""
        state = hf_model.checkpoint_state(self.model)
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return weight_checks.manifest(state.items())

    # ---- colocated mode: memory release / resume ---------------------------------------------

    def check_can_generate(self) -> None:
        blocking = sorted(self.released & {"weights", "kv_cache"})
        if blocking:
            raise EngineReleasedError(
                f"engine {self.name}: cannot generate while its {' and '.join(blocking)} memory is released "
                f"(colocated mode); call resume_memory_occupation first"
            )
        if self._needs_values:
            raise EngineReleasedError(
                f"engine {self.name}: its weights were resumed after a release and hold no values yet; "
                "load weights (update_weights_from_*) before generating"
            )

    def check_resident(self, what: str) -> None:
        if "weights" in self.released:
            raise EngineReleasedError(
                f"engine {self.name}: {what} while the weights' memory is released; the order is "
                "resume_memory_occupation(['weights']) -> update -> resume_memory_occupation(['kv_cache'])"
            )

    def free(self) -> None:
        # Each storage once (tied embeddings, fused experts share one): its bytes go back to the
        # allocator, while the tensors keep shape and dtype so loads can refill them in place.
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for p in self.model.parameters():
            storage = p.untyped_storage()
            seen.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
        for storage, _ in seen.values():
            storage.resize_(0)
        self._freed_storages = list(seen.values())

    def restore(self) -> None:
        for storage, nbytes in self._freed_storages:
            storage.resize_(nbytes)
            storage.fill_(0)
        self._freed_storages = []
        self._needs_values = True
