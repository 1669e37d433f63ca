"""LoRA in the scheduler: at most ``max_loras`` distinct adapters per batch."""

from __future__ import annotations

from cadence.core.request import Request


class LoRABatchLimit:
    """Tracks the adapters of one step's batch."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self.lora_ids: set[int] = set()

    def add_running(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def can_add(self, request: Request) -> bool:
        lora = request.lora_request
        if self.max_loras is None or lora is None or lora.lora_int_id in self.lora_ids:
            return True
        return len(self.lora_ids) < self.max_loras

    def add(self, request: Request) -> None:
        if request.lora_request is not None and request.lora_request.lora_int_id > 0:
            self.lora_ids.add(request.lora_request.lora_int_id)
