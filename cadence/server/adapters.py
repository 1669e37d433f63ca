"""The models a server answers to: the base model and its LoRA adapters, by name.

    ServedModels.resolve(model field) -> None (the base) | LoRARequest | ModelNotFound (404)
    ServedModels.cards()              -> /v1/models entries (adapters name their parent)
    await load(name, path) / unload(name)   the runtime endpoints (as vLLM's)

Adapters get ``lora_int_id`` 1, 2, ... in the order they are loaded; a name
unloaded and loaded again gets a new id (its KV is never reused across the
two). Loading happens in the engine process, which checks the files and
answers a ValueError for a bad adapter: the server answers 400 and goes on.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from cadence.core.request import LoRARequest
from cadence.engine.async_llm import AsyncLLM
from cadence.server.errors import ModelNotFound, quoted


class ServedModels:
    """The base model's name and the adapters served beside it."""

    def __init__(self, llm: AsyncLLM, base_name: str, base_root: str) -> None:
        self.llm = llm
        self.base_name = base_name
        self.base_root = base_root
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: names stay unique

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model field names; None for the base model (or no field)."""
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise ModelNotFound(model)
        return adapter

    def cards(self, created: int, max_model_len: int | None) -> list[dict[str, Any]]:
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "cadence",
                "root": self.base_root, "parent": None, "max_model_len": max_model_len}
        return [base] + [
            {"id": name, "object": "model", "created": created, "owned_by": "cadence",
             "root": adapter.lora_path, "parent": self.base_name, "max_model_len": max_model_len}
            for name, adapter in self.adapters.items()
        ]

    async def load(self, name: str, path: str) -> None:
        """Load and serve an adapter; ValueError (400) for a taken name or a bad adapter."""
        async with self._lock:
            if name == self.base_name or name in self.adapters:
                raise ValueError(f"lora_name: the adapter '{quoted(name)}' has already been loaded "
                                 "(or names the base model)")
            adapter = LoRARequest(name, next(self._ids), path)
            await self.llm.add_lora(adapter)
            self.adapters[name] = adapter

    async def unload(self, name: str) -> None:
        """Stop serving an adapter (requests under way finish with it); ModelNotFound (404)."""
        async with self._lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise ModelNotFound(name, "lora_name",
                                    f"The lora adapter '{quoted(name)}' cannot be found.")
            await self.llm.remove_lora(adapter.lora_int_id)
