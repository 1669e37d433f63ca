"""A scheduling policy defined outside the ``cadence`` package, as a user's
would be: selected by ``policy="tests.plugins.shortest_first:ShortestPromptFirst"``
(in any process) or, once this module is imported, by ``policy="shortest-first"``."""

from cadence.core.sched.policy import KeyedQueue, SchedulingPolicy, register_policy


@register_policy("shortest-first")
class ShortestPromptFirst(SchedulingPolicy):
    """Waiting requests with the fewest prompt tokens first; the victim is the
    running request with the most tokens left to compute."""

    def make_queue(self) -> KeyedQueue:
        return KeyedQueue(lambda request: request.num_prompt_tokens)

    def pick_victim(self, running):
        return max(reversed(running), key=lambda r: r.num_tokens - r.num_computed_tokens)


class NotAPolicy:
    """Has the two methods, but does not declare the contract."""

    def make_queue(self):
        return KeyedQueue(lambda request: 0)

    def pick_victim(self, running):
        return running[-1]
