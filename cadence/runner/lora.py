"""The runner's LoRA adapters: loaded from PEFT folders, installed into the
model's linear layers, unloaded least-recently-used first.

    add_lora(LoRARequest)        load (once) and install; ValueError for a bad adapter
    remove_lora(lora_int_id)     unload now, or when the last request using it is gone
    set_step(adapter of each sequence, tokens of each)   the mapping every layer reads

An adapter is identified by ``lora_int_id`` (> 0; 0 is the base model). At most
``num_cpu_loras`` stay loaded: loading one more unloads the least recently
used adapter that no request in the runner holds. A request whose adapter
was unloaded while it waited gets it loaded again from its ``lora_path``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.core.request import LoRARequest
from cadence.models.layers import Linear
from cadence.models.lora_layers import LinearLoRA, LoRAMapping
from cadence.models.peft_adapter import PeftAdapter, load_peft_adapter

if TYPE_CHECKING:
    from cadence.config import LoRAConfig


class LoRAManager:
    """The adapters installed in one model, by ``lora_int_id``."""

    def __init__(self, model: torch.nn.Module, config: "LoRAConfig", dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.max_rank = config.max_lora_rank
        self.capacity = config.num_cpu_loras
        self.dtype, self.device = dtype, device
        self.mapping = LoRAMapping()  # shared by every LinearLoRA of the model
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self._layers: dict[int, list[LinearLoRA]] = {}  # adapter -> the layers holding it
        self._retired: set[int] = set()  # unloaded by request, still used by a request

    @property
    def lora_ids(self) -> list[int]:
        return [i for i in self.loaded if i not in self._retired]

    def add_lora(self, lora: LoRARequest, in_use: set[int] = frozenset()) -> bool:
        """Make ``lora`` usable; True if it was loaded now (False: already there)."""
        _check_request(lora)
        self._retired.discard(lora.lora_int_id)
        if lora.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora.lora_int_id)
            return False
        adapter = load_peft_adapter(lora.lora_path, max_rank=self.max_rank, dtype=self.dtype)
        self._layers[lora.lora_int_id] = self._install(lora.lora_int_id, adapter)
        self.loaded[lora.lora_int_id] = lora
        self._evict(in_use | {lora.lora_int_id})
        return True

    def remove_lora(self, lora_int_id: int, in_use: set[int] = frozenset()) -> bool:
        """Unload an adapter (later, if a request still uses it); False if not loaded."""
        if lora_int_id not in self.loaded or lora_int_id in self._retired:
            return False
        if lora_int_id in in_use:
            self._retired.add(lora_int_id)
        else:
            self._unload(lora_int_id)
        return True

    def collect(self, in_use: set[int]) -> None:
        """Unload the removed adapters that no request uses any more."""
        for lora_int_id in [i for i in self._retired if i not in in_use]:
            self._retired.discard(lora_int_id)
            self._unload(lora_int_id)

    def set_step(self, seq_lora_ids: np.ndarray, num_scheduled: np.ndarray) -> None:
        """The adapter of each of this step's tokens: sequence s's id, num_scheduled[s] times."""
        if not seq_lora_ids.any():
            self.mapping.clear()
            return
        token_ids = torch.from_numpy(np.repeat(seq_lora_ids, num_scheduled))  # [T]
        self.mapping.update(token_ids.to(self.device))

    # ------------------------------------------------------------ internals

    def _install(self, lora_int_id: int, adapter: PeftAdapter) -> list[LinearLoRA]:
        """Check every tensor against the layer it adapts, then add them all (or none)."""
        shards_of: dict[Linear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in adapter.weights.items():
            try:
                linear, shard = self.model.projection(module)
            except ValueError:
                raise ValueError(f"lora_path: target module {module!r} is not in the model") from None
            out_rows = _shard_sizes(linear)[shard]
            if a.shape != (adapter.rank, linear.in_features) or b.shape != (out_rows, adapter.rank):
                raise ValueError(
                    f"lora_path: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                    f"the model's layer needs [{adapter.rank}, {linear.in_features}] and "
                    f"[{out_rows}, {adapter.rank}] (an adapter of another base model?)")
            shards_of.setdefault(linear, {})[shard] = (a.to(self.device), b.to(self.device))
        layers = []
        for linear, shards in shards_of.items():
            if linear.lora is None:
                linear.lora = LinearLoRA(linear.in_features, _shard_sizes(linear), self.mapping)
            linear.lora.add(lora_int_id, shards, adapter.scaling)
            layers.append(linear.lora)
        return layers

    def _unload(self, lora_int_id: int) -> None:
        for layer in self._layers.pop(lora_int_id, []):
            layer.remove(lora_int_id)
        self.loaded.pop(lora_int_id, None)

    def _evict(self, keep: set[int]) -> None:
        """Unload least recently used adapters beyond the capacity, sparing ``keep``."""
        for lora_int_id in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                return
            if lora_int_id not in keep:
                self._unload(lora_int_id)


def _shard_sizes(linear: Linear) -> tuple[int, ...]:
    return getattr(linear, "shard_sizes", (linear.out_features,))


def _check_request(lora: LoRARequest) -> None:
    if not isinstance(lora, LoRARequest):  # (its fields check themselves)
        raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora).__name__}")
