"""Seeded requests' random streams, put back where a discarded step found them.

A request with a seed samples from its own generator, so its tokens depend
on the seed and on how many draws came before, never on its batch. A step
whose results the engine discards breaks that: a step the runner raised on
(``core/sched/step_faults.py``) may have sampled before it failed, and with
async scheduling the step in flight behind it ran to its end. The engine
sends the request anew with the output tokens it had before those steps;
the runner keeps the request's generator across a resend (a preemption must
not restart the stream), so the generator must go back too, or every later
token differs from a run without the fault.

Before each step, ``SeededStreams`` notes the generator state of every
seeded request in it under the number of output tokens the request has. A
step that succeeds adds tokens, so a request sent anew with a count that
has a note had the steps from that note on discarded: its generator goes
back to the noted state. A preempted request comes back with the tokens it
had sampled, a count past every note, and keeps its stream as it is.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Mapping

import torch

if TYPE_CHECKING:
    from cadence.runner.input_batch import RequestState

# Notes kept per request: the step that failed and the one in flight behind
# it (async scheduling) are the newest two; the rest is slack.
KEPT_NOTES = 4


class SeededStreams:
    """The seeded requests' generators, and their states before recent steps."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        # req_id -> (output tokens before a step, the generator's state then), oldest first
        self._notes: dict[str, deque[tuple[int, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._generators)

    def track(self, req_id: str, generator: torch.Generator) -> None:
        self._generators[req_id] = generator

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)
        self._notes.pop(req_id, None)

    def note_step(self, scheduled: Mapping[str, int], requests: Mapping[str, RequestState]) -> None:
        """Before a step (``scheduled``: its requests' token counts): the
        state of each seeded request in it, under its number of output tokens."""
        for req_id, generator in self._generators.items():
            if req_id not in scheduled:
                continue
            notes = self._notes.get(req_id)
            if notes is None:
                notes = self._notes[req_id] = deque(maxlen=KEPT_NOTES)
            count = len(requests[req_id].output_token_ids)
            if notes and notes[-1][0] == count:
                notes.pop()  # a prompt chunk drew nothing: one note per count
            notes.append((count, generator.get_state()))

    def rewind(self, req_id: str, num_output_tokens: int) -> None:
        """A request sent anew with ``num_output_tokens``: if a step began
        at that count, the steps since were discarded; its generator goes
        back to the state that step found."""
        notes = self._notes.get(req_id)
        generator = self._generators.get(req_id)
        if not notes or generator is None:
            return
        while notes and notes[-1][0] > num_output_tokens:
            notes.pop()
        if notes and notes[-1][0] == num_output_tokens:
            generator.set_state(notes[-1][1])
