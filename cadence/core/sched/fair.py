"""``fair``: fair shares across clients by virtual token counters (VTC, OSDI'24).

Each request names its client (``Request.tenant``; None is one anonymous
client). Every client has a counter of the service it got, weighted:

    counter[c] += (input_weight * prompt tokens computed
                   + output_weight * other tokens computed) / weight[c]

counted every step from what the step schedules. Admission picks the
waiting request of the client with the smallest counter (FCFS within a
client), so a client that sends ten times more does not get ten times the
service while another waits. Three rules keep that honest:

- **no banked credit**: a client that becomes active again (nothing waiting
  or running) has its counter lifted to the smallest counter of the active
  clients, so idling earns no right to monopolise later;
- **bounded state**: counters of clients gone idle are dropped once they
  would be lifted anyway, and all counters shift down together when the
  smallest active one grows large;
- **preemption**: when blocks run out, the victim is the running request of
  the client with the largest counter (its latest arrival).

Counters decide who goes first; two step shapes keep a less-served client's
first token quick once it is admitted (``FairPolicy.begin_step``): the step
that admits it carries no other client's prompt, and while it is active the
steps that serve only more-served clients' prompts are short, since its next
request will wait for the step in flight.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Iterator

from cadence.core.request import Request
from cadence.core.sched.policy import SchedulingPolicy
from cadence.core.sched.prefill_caps import is_prefilling

# Shift all counters down once the smallest active one passes this.
_RENORMALISE_AT = 1e12
# Idle clients' counters kept at most (the lowest are dropped first).
MAX_IDLE_COUNTERS = 10_000
# Clients named in the stats (and so in /metrics labels); the rest are summed.
MAX_REPORTED_CLIENTS = 16
ANONYMOUS = "_anonymous"
OTHER_CLIENTS = "_other"


class ServiceCounters:
    """Weighted service per client, with VTC's lift and bounded state."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0,
                 client_weights: dict[str | None, float] | None = None) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.client_weights = dict(client_weights or {})
        self.counters: dict[str | None, float] = {}
        self.active: set[str | None] = set()  # waiting or served in the last step
        # Tokens computed for each client (unweighted, never lifted): what /metrics shows.
        self.served: dict[str | None, int] = {}

    def get(self, client: str | None) -> float:
        return self.counters.get(client, 0.0)

    def activate(self, client: str | None) -> None:
        """A client with nothing in flight sends again: lift it to the active minimum."""
        if client in self.active:
            return
        floor = min((self.counters.get(c, 0.0) for c in self.active), default=None)
        if floor is not None and self.get(client) < floor:
            self.counters[client] = floor
        self.active.add(client)

    def charge(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` computed for ``request`` this step (before they are counted)."""
        prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        num_input = min(num_tokens, prompt_left)
        cost = self.input_weight * num_input + self.output_weight * (num_tokens - num_input)
        client = request.tenant
        weight = self.client_weights.get(client, 1.0)
        self.counters[client] = self.counters.get(client, 0.0) + cost / weight
        self.served[client] = self.served.get(client, 0) + num_tokens

    def end_step(self, still_active: set[str | None]) -> None:
        """The clients with requests waiting or running after this step."""
        self.active = still_active
        if not still_active:
            return
        floor = min(self.counters.get(c, 0.0) for c in still_active)
        if floor > _RENORMALISE_AT:
            self.counters = {c: v - floor for c, v in self.counters.items()}
            floor = 0.0
        idle = len(self.counters) - len(still_active)
        if idle > MAX_IDLE_COUNTERS:
            # An idle counter at or below the floor is lifted on return anyway;
            # past the cap, the lowest idle ones go first.
            idle_clients = sorted((v, c) for c, v in self.counters.items() if c not in still_active)
            for value, client in idle_clients[: idle - MAX_IDLE_COUNTERS]:
                del self.counters[client]
                self.served.pop(client, None)

    def top_served(self, limit: int) -> dict[str, int]:
        """Tokens served per client: the ``limit`` most served by name, the rest
        summed under ``OTHER_CLIENTS`` (bounded label cardinality for /metrics)."""
        ranked = sorted(self.served.items(), key=lambda item: -item[1])
        top = {ANONYMOUS if client is None else client: tokens for client, tokens in ranked[:limit]}
        rest = sum(tokens for _, tokens in ranked[limit:])
        if rest:
            top[OTHER_CLIENTS] = top.get(OTHER_CLIENTS, 0) + rest
        return top


class FairQueue:
    """Waiting requests per client; the front is the least-served client's oldest."""

    def __init__(self, counters: ServiceCounters) -> None:
        self.counters = counters
        self._by_client: OrderedDict[str | None, deque[Request]] = OrderedDict()
        self._size = 0

    def _front_client(self) -> str | None:
        get = self.counters.get
        return min(self._by_client, key=get)  # ties: the client that queued first

    def add_request(self, request: Request) -> None:
        client = request.tenant
        queue = self._by_client.get(client)
        if queue is None:
            self.counters.activate(client)
            queue = self._by_client[client] = deque()
        queue.append(request)
        self._size += 1

    def pop_request(self) -> Request:
        client = self._front_client()
        queue = self._by_client[client]
        request = queue.popleft()
        if not queue:
            del self._by_client[client]
        self._size -= 1
        return request

    def peek_request(self) -> Request:
        return self._by_client[self._front_client()][0]

    def prepend_request(self, request: Request) -> None:
        client = request.tenant
        queue = self._by_client.get(client)
        if queue is None:
            queue = self._by_client[client] = deque()
        queue.appendleft(request)
        self._size += 1

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in reversed(list(requests)):
            self.prepend_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        for client in list(self._by_client):
            kept = deque(r for r in self._by_client[client] if r not in doomed)
            self._size -= len(self._by_client[client]) - len(kept)
            if kept:
                self._by_client[client] = kept
            else:
                del self._by_client[client]

    def clients(self) -> set[str | None]:
        return set(self._by_client)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        """In the order they would be admitted if no counter changed."""
        queues = {c: list(q) for c, q in self._by_client.items()}
        while queues:
            client = min(queues, key=self.counters.get)
            yield queues[client].pop(0)
            if not queues[client]:
                del queues[client]


class FairPolicy(SchedulingPolicy):
    """The ``fair`` policy (see the module docstring)."""

    def __init__(self, client_weights: dict[str | None, float] | None = None,
                 input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.counters = ServiceCounters(input_weight, output_weight, client_weights)
        self._queue: FairQueue | None = None
        self._favoured: tuple[str | None, float] | None = None  # see begin_step
        self._short = False  # see begin_step
        self.short_step_tokens: int | None = None  # None: no short steps
        # Requests that displaced another and are still prefilling: never victims
        # of a displacement themselves (see ``displace``).
        self._protected: dict[str, Request] = {}
        self.max_num_seqs: int | None = None  # from configure

    def configure(self, config) -> None:
        """Client weights and the short-step budget from the ``SchedulerConfig``
        (``fair_client_weights``, ``fair_short_step_tokens``)."""
        self.counters.client_weights = parse_client_weights(config.fair_client_weights)
        self.max_num_seqs = config.max_num_seqs
        short = config.fair_short_step_tokens
        if short is not None and not 1 <= short <= config.max_num_batched_tokens:
            raise ValueError("fair_short_step_tokens: must be between 1 and max_num_batched_tokens")
        if short is None:
            # 3/8: measured on the H100 roofline and the CPU profile (BENCHMARKS.md,
            # fair-shares-v1); shorter costs throughput where steps have a high fixed cost.
            short = max(1, config.max_num_batched_tokens * 3 // 8)
        self.short_step_tokens = short if short < config.max_num_batched_tokens else None

    def make_queue(self) -> FairQueue:
        self._queue = FairQueue(self.counters)
        return self._queue

    def pick_victim(self, running: list[Request]) -> Request:
        get = self.counters.get
        # Largest counter; among its requests the latest (max of index breaks ties late).
        return max(reversed(running), key=lambda r: get(r.tenant))

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        """With every slot taken: a request of a more-served client that is still
        prefilling (the one with the least prompt computed: the least work lost)."""
        candidates = self._displaceable(waiting, running)
        if not candidates:
            return None
        # The displacing request keeps its seat until its prompt is computed:
        # otherwise two clients whose counters cross at every chunk would
        # displace each other forever, each losing its prompt's work.
        self._protected[waiting.request_id] = waiting
        return min(candidates, key=lambda r: (r.num_computed_tokens, -r.arrival_time))

    def _displaceable(self, waiting: Request, running: list[Request]) -> list[Request]:
        get = self.counters.get
        own = get(waiting.tenant)
        protected = self._protected
        return [r for r in running
                if is_prefilling(r) and get(r.tenant) > own and r.request_id not in protected]

    def begin_step(self, running: list[Request]) -> None:
        """Decide the kind of this step.

        - *Favoured*: when a more-served client has a prompt running or a
          request waiting, the step favours the front of the queue (see
          ``defers_prefill``): its prompt beside the running decodes only.
        - *Short*: otherwise, when the step serves prompts of clients more
          served than some active client (one with a request running), it gets
          ``short_step_tokens``: that client's next request arrives during a
          step, and waits for it to end.
        """
        self._favoured = None
        self._short = False
        if self._protected:
            self._protected = {req_id: r for req_id, r in self._protected.items()
                               if not r.is_finished() and is_prefilling(r)}
        get = self.counters.get
        prompt_counters = [get(r.tenant) for r in running if is_prefilling(r)]
        queue = self._queue
        if queue:
            front = queue._front_client()
            floor = get(front)
            if (any(counter > floor for counter in prompt_counters)
                    or any(get(client) > floor for client in queue._by_client)) \
                    and self._can_seat(queue.peek_request(), running):
                self._favoured = (front, floor)
                return
            prompt_counters.append(floor)
        if prompt_counters and self.short_step_tokens is not None:
            least_served_prompt = min(prompt_counters)
            self._short = any(get(client) < least_served_prompt for client in self.counters.active)

    def _can_seat(self, waiting: Request, running: list[Request]) -> bool:
        """Whether ``waiting`` could run this step: a free seat, or one it may
        take. Holding others' prompts back for a request that cannot run
        would only stall them (with every seat taken, for ever)."""
        if self.max_num_seqs is None or len(running) < self.max_num_seqs:
            return True
        return bool(self._displaceable(waiting, running))

    def step_budget(self, budget: int) -> int:
        """This step's token budget (after ``begin_step``)."""
        if self._short and self.short_step_tokens is not None:  # (set only with short steps)
            return min(budget, self.short_step_tokens)
        return budget

    def defers_prefill(self, request: Request) -> bool:
        """Whether ``request``'s prompt (running chunk or admission) waits this step.

        A step that favours an under-served client carries that client's
        prompt and the running decodes only: a short step, so its first token
        is not held up by a step full of other clients' prompts.
        """
        favoured = self._favoured
        if favoured is None or request.tenant == favoured[0]:
            return False
        return self.counters.get(request.tenant) > favoured[1]

    def service_stats(self) -> dict[str, int]:
        """Tokens served per client, at most ``MAX_REPORTED_CLIENTS`` names."""
        return self.counters.top_served(MAX_REPORTED_CLIENTS)

    def account(self, scheduled: dict[str, int], requests: dict[str, Request],
                running: list[Request]) -> None:
        """Charge this step's scheduled tokens; refresh which clients are active."""
        charge = self.counters.charge
        for req_id, num_tokens in scheduled.items():
            charge(requests[req_id], num_tokens)
        active = {r.tenant for r in running}
        if self._queue is not None:
            active |= self._queue.clients()
        self.counters.end_step(active)


def parse_client_weights(text: str | None) -> dict[str | None, float]:
    """``"alice=2,bob=0.5"`` -> {"alice": 2.0, "bob": 0.5}; ValueError naming the option."""
    weights: dict[str | None, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not name.strip() or not weight > 0 or weight == float("inf"):
            raise ValueError(f"fair_client_weights: expected name=weight (weight > 0) pairs, got {item!r}")
        weights[name.strip()] = weight
    return weights
