"""Scheduling policies: the waiting-queue order and the preemption victim.

A policy is a small object registered by name; the scheduler never branches
on the policy's name. Add one with ``@register_policy("name")``.

- ``fcfs``:     arrival order; the victim is the request admitted last.
- ``fair``:     fair shares across clients (``Request.tenant``) by weighted
                service counters, VTC; see ``cadence.core.sched.fair``.
- ``slo``:      latency targets: least slack first, batch work last,
                predicted misses refused; see ``cadence.core.sched.slo``.
- ``priority``: lower ``priority`` value first, ties by arrival; the victim
                is the running request with the worst (priority, arrival).
                When ``max_num_seqs`` is full, a waiting request of a
                strictly better priority displaces that victim (vLLM only
                preempts when blocks run out, #40004). Equal priorities never
                displace each other, so two requests cannot take turns
                preempting one another.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Iterable, Iterator, Protocol

from cadence.core.request import Request


class RequestQueue(Protocol):
    """The waiting queue. ``prepend_request`` puts a request back at the front."""

    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: "RequestQueue") -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class SchedulingPolicy(Protocol):
    # Whether the policy orders by ``Request.priority`` (front ends refuse a
    # priority the policy would ignore).
    reads_priority: bool

    def make_queue(self) -> RequestQueue: ...

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out."""
        ...

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        """With every running slot taken: the running request ``waiting`` should
        preempt, or None to let it wait."""
        ...


class FCFSQueue:
    """A deque in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # Keep their order: the first of ``requests`` ends up at the very front.
        self._queue.extendleft(reversed(list(requests)))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        self._queue = deque(r for r in self._queue if r not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class KeyedQueue:
    """A heap on (key(request), arrival_time, insertion order).

    "Prepending" needs no special case: a preempted request gets its key again
    and so returns to its rightful place.
    """

    def __init__(self, key: Callable[[Request], float]) -> None:
        self._key = key
        self._heap: list[tuple[float, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (self._key(request), request.arrival_time, next(self._counter), request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        self._heap = [entry for entry in self._heap if entry[3] not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


class PriorityQueue(KeyedQueue):
    """Lower ``priority`` first, then arrival order."""

    def __init__(self) -> None:
        super().__init__(lambda request: request.priority)


class FCFSPolicy:
    reads_priority = False

    def make_queue(self) -> RequestQueue:
        return FCFSQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        return None


class PriorityPolicy:
    reads_priority = True

    def make_queue(self) -> RequestQueue:
        return PriorityQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        # Among equals (n > 1 children share their parent's arrival) the one
        # admitted last, as fcfs: taking the furthest along first can cycle,
        # each victim preempting the next before any finishes.
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        if not running:
            return None
        victim = self.pick_victim(running)
        return victim if waiting.priority < victim.priority else None


_POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {}


def register_policy(name: str) -> Callable[[Callable[[], SchedulingPolicy]], Callable[[], SchedulingPolicy]]:
    def register(factory: Callable[[], SchedulingPolicy]) -> Callable[[], SchedulingPolicy]:
        _POLICIES[name] = factory
        return factory

    return register


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy: unknown scheduling policy {name!r}; known: {sorted(_POLICIES)}")


def _fair_policy() -> SchedulingPolicy:
    from cadence.core.sched.fair import FairPolicy

    return FairPolicy()


register_policy("fcfs")(FCFSPolicy)
register_policy("priority")(PriorityPolicy)
register_policy("fair")(_fair_policy)


def _slo_policy() -> SchedulingPolicy:
    from cadence.core.sched.slo import SLOPolicy

    return SLOPolicy()


register_policy("slo")(_slo_policy)
