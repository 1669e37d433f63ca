"""A per-step result's memory kept from one step to the next (a batch's logits)."""

from __future__ import annotations

import weakref

import torch


class StepBuffer:
    """One float32 tensor that a per-step result of [rows, width] is written into, step after
    step: a batch's logits over Gemma 3's 262,144 tokens are 64 MiB at 64 rows, above malloc's
    mmap threshold (32 MiB at most), so a fresh tensor would be fresh pages every step, each
    faulted in on its first write (~25 ms a step on these VMs, ~10% of a batch-64 step).
    It grows to the most rows asked for; whoever asks is done with the last rows it got.
    ``release_step_buffers`` (an idle engine's ``return_freed_memory``) drops it, to be
    taken again by the next step."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None
        _ALIVE.add(self)

    def release(self) -> None:
        self._data = None

    def rows(self, rows: int, width: int) -> torch.Tensor:
        """The buffer's first ``rows`` rows [rows, width] (contiguous, contents undefined)."""
        data = self._data
        if data is None or data.shape[1] != width or data.shape[0] < rows:
            data = self._data = None  # the old one freed before the new one is taken
            self._data = data = torch.empty(rows, width, dtype=torch.float32)
        return data[:rows]


def release_step_buffers() -> None:
    """Drop every step buffer's tensor (an idle engine's call: the next step takes one again)."""
    for buffer in list(_ALIVE):
        buffer.release()


# Every StepBuffer alive, for release_step_buffers.
_ALIVE: "weakref.WeakSet[StepBuffer]" = weakref.WeakSet()
