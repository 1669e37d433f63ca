"""Scheduling policies: the waiting-queue order and the preemption victim.

A policy subclasses ``SchedulingPolicy`` (every hook the scheduler calls,
with its default) and is chosen by name; the scheduler never branches on the
name. Add one with ``@register_policy("name")`` (that process only); declare
it in an installed package's entry points (group ``cadence.scheduling_policies``),
or name it by import path, ``policy="package.module:factory"``: those two work
wherever the engine runs (``LLM``, ``cadence serve``'s engine process,
``cadence simulate``).

- ``fcfs``:     arrival order; the victim is the request admitted last.
- ``fair``:     fair shares across clients (``Request.tenant``) by weighted
                service counters, VTC; see ``cadence.core.sched.fair``.
- ``slo``:      latency targets: least slack first, batch work last,
                predicted misses refused; see ``cadence.core.sched.slo``.
- ``lpm``:      the longest cached prefix first, no request passed more
                than ``lpm_max_bypass`` times; see ``cadence.core.sched.cache_aware``.
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
import importlib
import importlib.metadata
import itertools
from collections import deque
from typing import Callable, Iterable, Iterator, Protocol

from cadence.config import POLICY_ENTRY_POINT_GROUP, SCHEDULING_POLICIES, installed_policy_names
from cadence.core.compiled import mypyc_attr
from cadence.core.request import Request


class RequestQueue(Protocol):
    """The waiting queue. ``prepend_request`` puts a request back at the front."""

    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: Iterable[Request]) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class AdmissionRefused(Exception):
    """A policy refuses a valid request at the current load (``check_admission``):
    servers answer 429 with ``retry_after_s``; the simulator counts a rejection."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@mypyc_attr(allow_interpreted_subclasses=True)  # policies may come from other packages
class SchedulingPolicy:
    """What the scheduler asks of a policy: every hook it calls, each with the
    default a policy gets when it leaves the hook out (subclass this class,
    override what the policy decides).

    A policy never changes a request; it orders, chooses and budgets. Hooks
    are called from ``Scheduler.schedule()`` (``begin_step``, ``step_budget``,
    ``defers_prefill``, ``displace``, ``pick_victim``, ``account``) and from
    ``add_request`` (``check_admission``); the scheduler calls the per-step
    ones only when a policy overrides them, so an fcfs step pays nothing.
    """

    # Whether the policy orders by ``Request.priority`` (front ends refuse a
    # priority the policy would ignore).
    reads_priority: bool = False
    # Whether it reads per-request latency targets (``slo_ttft_s``/``slo_tpot_s``;
    # front ends refuse them otherwise).
    reads_slo: bool = False

    # ---- set-up -----------------------------------------------------------

    def configure(self, config) -> None:
        """The ``SchedulerConfig``, once, when the scheduler is built (and when a
        front end checks the options). The policy reads its own options
        there and raises a ``ValueError`` naming one whose value it refuses."""

    def latency_targets(self) -> tuple[float | None, float | None]:
        """The deployment's (TTFT, TPOT) targets for requests that set none;
        front ends count the requests that met them."""
        return None, None

    def may_refuse_admission(self) -> bool:
        """Whether ``check_admission`` may raise ``AdmissionRefused`` (a front
        end then waits for the engine's word before answering a request)."""
        return False

    def set_clock(self, clock: Callable[[], float]) -> None:
        """The clock requests' arrival times are on (virtual in the simulator)."""

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """The scheduler's KV cache manager, once (a cache-aware policy reads
        the prefix cache through it; it never changes it)."""

    def make_queue(self) -> RequestQueue:
        """The waiting queue, in the policy's order (called once)."""
        raise NotImplementedError

    # ---- decisions ----------------------------------------------------------

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out."""
        raise NotImplementedError

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        """With every running slot taken: the running request ``waiting`` should
        preempt, or None to let it wait."""
        return None

    def check_admission(self, request: Request) -> None:
        """Raise to refuse a new request: a ``ValueError`` naming the field when
        the request itself is wrong (HTTP 400), an ``AdmissionRefused`` when the
        load refuses it now (HTTP 429, with its Retry-After)."""

    def begin_step(self, running: list[Request]) -> None:
        """Called first in each ``schedule()``."""

    def step_budget(self, budget: int) -> int:
        """This step's token budget, from the configured one."""
        return budget

    def defers_prefill(self, request: Request) -> bool:
        """Whether ``request``'s prompt (a running chunk or an admission) waits
        this step. If the step would otherwise be empty, deferred running
        prompts are scheduled anyway."""
        return False

    def account(self, scheduled: dict[str, int], requests: dict[str, Request],
                running: list[Request]) -> None:
        """The step's scheduled tokens per request id, once the step is decided."""

    def service_stats(self) -> dict[str, int] | None:
        """Per-client service for the stats (None: the policy keeps none)."""
        return None

    def overrides(self, hook: str) -> bool:
        """Whether this policy replaces the default ``hook``."""
        return getattr(type(self), hook) is not getattr(SchedulingPolicy, hook)


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

    def prepend_requests(self, requests: Iterable[Request]) -> None:
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

    def prepend_requests(self, requests: Iterable[Request]) -> None:
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


class FCFSPolicy(SchedulingPolicy):

    def make_queue(self) -> RequestQueue:
        return FCFSQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]


@mypyc_attr(allow_interpreted_subclasses=True)  # (a benchmark bends it)
class PriorityPolicy(SchedulingPolicy):
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
    """``@register_policy("name")`` on a policy class (or factory): ``policy="name"``
    then selects it in this process. An engine in another process (``cadence
    serve``) needs the ``"package.module:factory"`` form, which imports it there."""
    def register(factory: Callable[[], SchedulingPolicy]) -> Callable[[], SchedulingPolicy]:
        _POLICIES[name] = factory
        if name not in SCHEDULING_POLICIES:
            SCHEDULING_POLICIES.append(name)
        return factory

    return register


def configured_policy(config) -> SchedulingPolicy:
    """The ``SchedulerConfig``'s policy, made and configured: a ``ValueError``
    naming the option if the policy refuses one of its options' values."""
    policy = make_policy(config.policy)
    policy.configure(config)
    return policy


def make_policy(name: str) -> SchedulingPolicy:
    """The policy registered as ``name``, or made by ``"package.module:factory"``
    (importable in every process: the engine core may run in another one)."""
    factory: Callable[[], object] | None = _POLICIES.get(name)
    if factory is None and ":" in name:
        factory = _import_factory(name)
    if factory is None:
        factory = _installed_factory(name)
    if factory is None:
        raise ValueError(f"policy: unknown scheduling policy {name!r}; known: "
                         f"{sorted(_POLICIES) + installed_policy_names()}, or 'package.module:factory'")
    made: object = factory()  # (whatever a factory from outside returns)
    if not isinstance(made, SchedulingPolicy):
        raise ValueError(f"policy: {name!r} made a {type(made).__name__}, not a SchedulingPolicy "
                         "(subclass cadence.core.sched.policy.SchedulingPolicy)")
    return made


def _installed_factory(name: str) -> Callable[[], SchedulingPolicy] | None:
    """The factory an installed package declares as ``name`` (entry points)."""
    for entry_point in importlib.metadata.entry_points(group=POLICY_ENTRY_POINT_GROUP, name=name):
        try:
            return entry_point.load()
        except (ImportError, AttributeError) as err:
            raise ValueError(f"policy: {name!r} ({entry_point.value}) cannot be loaded: {err}") from err
    return None


def _import_factory(path: str) -> Callable[[], SchedulingPolicy] | None:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"policy: cannot import {module_name!r} ({err})") from err
    factory = _POLICIES.get(path) or getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"policy: {module_name!r} has no {attr!r}")
    return factory


def policy_names() -> list[str]:
    """The registered policies' names."""
    return sorted(_POLICIES)


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


def _cache_aware_policy() -> SchedulingPolicy:
    from cadence.core.sched.cache_aware import CacheAwarePolicy

    return CacheAwarePolicy()


register_policy("lpm")(_cache_aware_policy)
