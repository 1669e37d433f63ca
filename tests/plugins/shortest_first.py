"""A scheduling policy defined outside the ``cadence`` package, as a user's
would be: selected by ``policy="tests.plugins.shortest_first:ShortestPromptFirst"``
(in any process) or, once this module is imported, by ``policy="shortest-first"``."""

from cadence.core.sched.policy import AdmissionRefused, KeyedQueue, SchedulingPolicy, register_policy


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


class ShortPromptsOnly(ShortestPromptFirst):
    """Shortest first, and refuses at the current load any prompt longer than
    ``MAX_PROMPT_TOKENS``: the contract's ``AdmissionRefused``, which a server
    answers with 429 and a Retry-After, before any stream begins."""

    MAX_PROMPT_TOKENS = 32

    def may_refuse_admission(self) -> bool:
        return True

    def check_admission(self, request) -> None:
        if request.num_prompt_tokens > self.MAX_PROMPT_TOKENS:
            raise AdmissionRefused(
                f"prompt: {request.num_prompt_tokens} tokens; this policy admits at most "
                f"{self.MAX_PROMPT_TOKENS} now", retry_after_s=7.0)
