"""The ``lpm`` policy: waiting requests with the longest cached prefix first,
with a bound on how long any request waits, and ageing up to it.

SGLang's ``lpm`` orders its queue by the longest prefix match: requests whose
prompt the prefix cache already holds run first, so the cache keeps what the
queue is about to reuse and steps compute fewer tokens. Unbounded, it starves
a request whose prompt shares nothing (SGLang's users measured p99 TTFT +252%
against FCFS). Here each waiting request counts the later requests admitted
before it; once the count reaches ``lpm_max_bypass`` it goes first, whatever
its prefix, so no request waits behind more than that many later arrivals.

Before the bound, a request ages: each bypass adds 1/bound of the window's
best score to its own, so it reaches the best score when the bound forces it
anyway. A request nearly as hot as the best goes after a few bypasses, a
cold one after nearly all of them. Without ageing any request was passed
until the bound, whatever its own prefix: at 1.2x capacity on the CPU
profile at least one admission in ten came after the full 16 bypasses;
with ageing nine in ten come after at most 6, the prefix hit rate the
same, and p99 TTFT went from 1.09x FCFS's to 0.95x (on the H100 at
capacity from 1.06x to 1.00x; BENCHMARKS.md, lpm-v1).

    queue (arrival order):   a(0 cached)  b(32)  c(0)  d(48)     bound 2
    picks d (the best); a, b, c passed once, each bypass now worth 32 // 2:
                             a 16  b 48  c 16
    picks b; a passed twice reached the bound and goes next, then c.

Scores are the leading full blocks found in the prefix cache, refreshed once
per step for the first ``WINDOW`` requests of the queue (a longer queue is
served in arrival order beyond them, as SGLang falls back to FCFS for long
queues).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from cadence.core.request import Request
from cadence.core.sched.policy import SchedulingPolicy

if TYPE_CHECKING:
    from cadence.core.kv_cache import AnyKVCacheManager

# Waiting requests scored each step: the head of the queue.
WINDOW = 64
# Later requests admitted before a waiting one, at most (``lpm_max_bypass``).
DEFAULT_MAX_BYPASS = 16


class CacheAwareQueue:
    """Arrival order, served longest-cached-prefix first within the window
    (a passed request ageing), and oldest first once a request was passed
    ``max_bypass`` times."""

    def __init__(self, max_bypass: int) -> None:
        self.max_bypass = max_bypass
        self._queue: list[Request] = []
        self._bypassed: dict[str, int] = {}  # req_id -> later requests popped before it
        self._scores: dict[str, int] = {}  # req_id -> cached prefix tokens (last refresh)
        self._choice: int | None = None  # index of the next request, until the queue changes

    # ---- order -----------------------------------------------------------

    def refresh(self, score: Callable[[Request], int]) -> None:
        """Score the head of the queue (``score(request)``: cached prefix tokens)."""
        self._scores = {r.request_id: score(r) for r in self._queue[:WINDOW]}
        self._choice = None

    def _pick(self) -> int:
        if self._choice is None:
            self._choice = self._best()
        return self._choice

    def _best(self) -> int:
        queue, bypassed = self._queue, self._bypassed
        bound = self.max_bypass
        if bound == 0:
            return 0  # nobody may be passed: arrival order
        if bypassed:
            for index, request in enumerate(queue[:WINDOW]):
                if bypassed.get(request.request_id, 0) >= bound:
                    return index  # the oldest starved request first
        scores = self._scores
        window = queue[:WINDOW]
        # Ageing: each bypass is worth 1/bound of the best score (see the module docstring);
        # whole tokens, so an unbounded lpm (a huge bound) keeps SGLang's order exactly.
        age = max((scores.get(r.request_id, 0) for r in window), default=0) // bound
        best, best_score = 0, -1
        for index, request in enumerate(window):
            req_id = request.request_id
            score = scores.get(req_id, 0) + age * bypassed.get(req_id, 0)
            if score > best_score:  # ties: the earlier one
                best, best_score = index, score
        return best

    # ---- the RequestQueue interface ---------------------------------------

    def add_request(self, request: Request) -> None:
        self._queue.append(request)
        self._choice = None

    def peek_request(self) -> Request:
        return self._queue[self._pick()]

    def pop_request(self) -> Request:
        index = self._pick()
        request = self._queue.pop(index)
        bypassed = self._bypassed
        for passed in self._queue[:index]:
            bypassed[passed.request_id] = bypassed.get(passed.request_id, 0) + 1
        bypassed.pop(request.request_id, None)
        self._choice = None
        return request

    def prepend_request(self, request: Request) -> None:
        self._queue.insert(0, request)
        self._choice = None

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._queue[:0] = list(requests)
        self._choice = None

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {r.request_id for r in requests}
        self._queue = [r for r in self._queue if r.request_id not in doomed]
        for req_id in doomed:
            self._bypassed.pop(req_id, None)
        self._choice = None

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class CacheAwarePolicy(SchedulingPolicy):
    """The ``lpm`` policy (see the module docstring)."""

    def __init__(self) -> None:
        self.max_bypass = DEFAULT_MAX_BYPASS
        self._queue: CacheAwareQueue | None = None
        self._kv: AnyKVCacheManager | None = None

    def configure(self, config) -> None:
        bound = config.lpm_max_bypass
        if bound is not None and bound < 0:
            raise ValueError("lpm_max_bypass: must be >= 0")
        self.max_bypass = DEFAULT_MAX_BYPASS if bound is None else bound

    def bind_kv_cache_manager(self, kv_cache_manager: AnyKVCacheManager) -> None:
        self._kv = kv_cache_manager

    def make_queue(self) -> CacheAwareQueue:
        self._queue = CacheAwareQueue(self.max_bypass)
        return self._queue

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def begin_step(self, running: list[Request]) -> None:
        if self._queue and self._kv is not None:
            self._queue.refresh(self.cached_prefix_tokens)

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's prompt found in the prefix cache now."""
        if request.num_computed_tokens or self._kv is None:
            return 0
        return self._kv.num_cached_prefix_tokens(request)
