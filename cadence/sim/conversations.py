"""Multi-turn conversations in the engine loop: a later turn arrives once the
previous one has ended, and its prompt holds what that turn generated.

    turn k arrives at   max(spec.arrival_time, turn k-1's last token + spec.think_time_s)
    turn k's prompt  =  turn k-1's prompt ids + turn k-1's output ids
                        + a new message: prompt_tokens(k) - prompt_tokens(k-1)
                          - output_tokens(k-1) of turn k's own tokens

The output ids are the engine's own, read from the step outputs as the loop
records them: a real model's samples in a real replay, the simulated
runner's filler tokens in a simulation. So a later prompt holds exactly the
tokens whose KV the previous turn computed and left in the prefix cache (all
but the last output token's, which was sampled and never fed back), and its
prefix hit is what a real engine would find there: no more, since a turn
whose history was evicted meanwhile computes it again.

A turn that is refused (too long for the context, or by the policy) ends its
conversation: its later turns are refused too. ``drive`` follows a workload's
conversations; the data-parallel and prefill/decode fleets refuse them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from cadence.sim.workload import PromptMaker, RequestSpec

if TYPE_CHECKING:
    from cadence.core.outputs import EngineCoreOutputs
    from cadence.core.request import Request


class Conversations:
    """Which request follows which, and the token history handed from one turn to the next."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self.specs = specs
        self._next: dict[int, int] = {}  # index -> index of its conversation's next turn
        self._previous: dict[int, int] = {}
        turns_of: dict[int, dict[int, int]] = {}  # conversation -> {turn: index}
        for index, spec in enumerate(specs):
            if spec.conversation is not None:
                turns = turns_of.setdefault(spec.conversation, {})
                if spec.turn in turns:
                    raise ValueError(f"conversation {spec.conversation}: turn {spec.turn} appears twice")
                turns[spec.turn] = index
        for conversation, turns in turns_of.items():
            if sorted(turns) != list(range(len(turns))):
                raise ValueError(f"conversation {conversation}: turns must be 0, 1, ... without gaps, "
                                 f"got {sorted(turns)}")
            for turn in range(1, len(turns)):
                self._link(turns[turn - 1], turns[turn])
        # req_id -> (index, its prompt and the outputs so far): live turns with a next one.
        self._live: dict[str, tuple[int, list[int]]] = {}
        self._history: dict[int, list[int]] = {}  # a released turn's index -> its history

    def _link(self, previous: int, index: int) -> None:
        before, spec = self.specs[previous], self.specs[index]
        if self.num_new_tokens(before, spec) < 1:
            raise ValueError(f"conversation {spec.conversation}, turn {spec.turn}: prompt_tokens must "
                             "exceed the previous turn's prompt and output tokens (its new message)")
        self._next[previous] = index
        self._previous[index] = previous

    @staticmethod
    def num_new_tokens(previous: RequestSpec, spec: RequestSpec) -> int:
        return spec.prompt_tokens - previous.prompt_tokens - previous.output_tokens

    def __bool__(self) -> bool:
        """Whether any request waits for another (a multi-turn workload)."""
        return bool(self._next)

    def first_arrivals(self) -> list[tuple[float, int]]:
        """(arrival time, index) of the requests that arrive on their own:
        every one but the later turns."""
        later = self._previous
        return [(spec.arrival_time, index) for index, spec in enumerate(self.specs) if index not in later]

    def prompt_token_ids(self, index: int, prompt_maker: PromptMaker) -> list[int] | None:
        """A later turn's prompt (its history, then its new message); None for
        any other request (its prompt is the maker's)."""
        history = self._history.pop(index, None)
        if history is None:
            return None
        num_new = self.num_new_tokens(self.specs[self._previous[index]], self.specs[index])
        return history + prompt_maker.own_tokens(index, num_new)

    def on_added(self, index: int, request: "Request") -> None:
        if index in self._next:
            self._live[request.request_id] = (index, list(request.prompt_token_ids))

    def refused(self, index: int) -> list[int]:
        """The later turns of a refused turn's conversation, which never arrive."""
        later = []
        turn = self._next.get(index)
        while turn is not None:
            later.append(turn)
            turn = self._next.get(turn)
        return later

    def released(self, now: float, outputs: dict[int, "EngineCoreOutputs"]) -> list[tuple[float, int]]:
        """Take a step's outputs (the step ended at ``now``): (arrival time,
        index) of each next turn whose previous turn finished in it."""
        live = self._live
        if not live:
            return []
        arrivals = []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                entry = live.get(out.request_id)
                if entry is None:
                    continue
                entry[1].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    del live[out.request_id]
                    index, history = entry
                    follower = self._next[index]
                    self._history[follower] = history
                    spec = self.specs[follower]
                    arrivals.append((max(spec.arrival_time, now + spec.think_time_s), follower))
        return arrivals


def refuse_later_turns(specs: Sequence[RequestSpec], option: str) -> None:
    """Fleets replay arrival times as given: a later turn (which waits for its
    previous one) is refused there."""
    if any(spec.turn for spec in specs):
        raise ValueError(f"{option}: multi-turn conversations (turns > 1) run on one engine only "
                         "in the simulator")
