"""Workloads: what arrives when, as ``RequestSpec`` rows.

A spec holds lengths, not tokens. Prompt token ids are made when a request
is injected (``PromptMaker``), so 100,000 queued specs cost little memory:

    prompt = group prefix (shared by every request of its prefix group)
           + this request's own tokens

A multi-turn conversation is a run of specs, turn 0, 1, ...: a later turn's
prompt is the previous turn's prompt and the tokens it generated, then a new
message; it arrives ``think_time_s`` after the previous turn's last token
(``cadence.sim.conversations``, which the engine loop follows):

    turn 0:  [system prompt][message 0]
    turn 1:  [system prompt][message 0][output 0][message 1]
    turn 2:  [system prompt][message 0][output 0][message 1][output 1][message 2]

Two sources:

- ``SyntheticWorkload``: Poisson or gamma arrivals at a mean rate, prompt and
  output lengths from a distribution string (``fixed:N``, ``uniform:LO:HI``,
  ``lognormal:MEAN:CV``, ``exponential:MEAN``), a share of requests in
  shared-prefix groups, priorities, client ids, turns per conversation;
  seeded.
- JSONL traces, one request per line: ``arrival_time, prompt_tokens,
  output_tokens`` and optionally ``prefix_group, prefix_tokens, priority,
  client`` (``prefix_tokens`` defaults to half the prompt) and ``conversation,
  turn, think_time_s`` (a later turn's ``arrival_time`` is the earliest it
  may arrive).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

from cadence.config import option


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload: when it arrives and how long it is."""

    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    prefix_tokens: int = 0  # leading prompt tokens shared with its group
    priority: int = 0
    client: int = 0
    # Latency targets (interactive requests); None: batch, judged by the run's SLO.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # Multi-turn: the conversation's id and this turn's place in it. A later turn
    # (turn >= 1) arrives think_time_s after the previous turn's last token, and
    # not before arrival_time; its prompt_tokens count the whole history.
    conversation: int | None = None
    turn: int = 0
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens: must be >= 1")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError("prefix_tokens: must be in [0, prompt_tokens]")
        if self.turn < 0 or (self.turn and self.conversation is None):
            raise ValueError("turn: must be >= 0, and a later turn (>= 1) needs a conversation")
        if not self.think_time_s >= 0:
            raise ValueError("think_time_s: must be >= 0")


# ---------------------------------------------------------------- synthetic

ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class SyntheticWorkload:
    """A seeded random workload (the CLI's workload options come from here)."""

    num_requests: int = option(1000, "Requests in the workload.")
    rate: float = option(10.0, "Mean arrival rate, requests/s (0: all at time 0).")
    arrival: str = option("poisson", "Inter-arrival times: poisson, or gamma (see burstiness).")
    burstiness: float = option(1.0, "Gamma shape of inter-arrival times: < 1 bursty, 1 Poisson.")
    prompt_len: str = option("lognormal:512:1.0", "Prompt tokens: fixed:N, uniform:LO:HI, lognormal:MEAN:CV, exponential:MEAN.")
    output_len: str = option("lognormal:128:1.0", "Output tokens, same forms as prompt_len.")
    max_len: int = option(4096, "Cap on sampled prompt and output lengths.")
    prefix_groups: int = option(0, "Shared-prefix groups (0: none).")
    prefix_fraction: float = option(0.5, "Share of requests that belong to a prefix group.")
    prefix_tokens: int = option(256, "Shared prefix length of a group (cut to the prompt).")
    priorities: str = option("0", "Priority values, drawn uniformly, comma separated.")
    num_clients: int = option(1, "Client ids 0..N-1, drawn uniformly.")
    interactive_fraction: float = option(
        0.0, "Share of requests that carry latency targets (interactive); the rest are batch.")
    interactive_slo: str = option(
        "0.5,0.05", "The interactive requests' targets: TTFT seconds, TPOT seconds.")
    client_shares: str | None = option(
        None, "Relative request shares of clients 0, 1, ... (e.g. 10,1); overrides num_clients.")
    turns: str = option(
        "fixed:1", "Turns per conversation, same forms as prompt_len (fixed:1: single requests). "
                   "A later turn's prompt is the previous turn's prompt and output, then a new "
                   "message (turn_prompt_len); it arrives think_time after the previous turn's "
                   "last token. Conversations start at rate / mean turns, so requests keep "
                   "arriving at about rate.")
    turn_prompt_len: str | None = option(
        None, "Tokens of a later turn's new message, same forms as prompt_len (default: prompt_len).")
    think_time: str = option(
        "exponential:1", "Seconds from a turn's last token to the next turn: fixed:S, uniform:LO:HI, "
                         "lognormal:MEAN:CV, exponential:MEAN.")
    seed: int = option(0, "Random seed.")

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests: must be >= 1")
        if self.rate < 0:
            raise ValueError("rate: must be >= 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival: must be one of {ARRIVALS}")
        if self.burstiness <= 0:
            raise ValueError("burstiness: must be > 0")
        if not 0 <= self.prefix_fraction <= 1:
            raise ValueError("prefix_fraction: must be in [0, 1]")
        for name in ("prompt_len", "output_len", "turns", "think_time"):
            parse_length_dist(getattr(self, name), name)
        if self.turn_prompt_len is not None:
            parse_length_dist(self.turn_prompt_len, "turn_prompt_len")
        if not 0 <= self.interactive_fraction <= 1:
            raise ValueError("interactive_fraction: must be in [0, 1]")
        self.interactive_targets()
        if self.client_shares is not None:
            try:
                shares = [float(x) for x in self.client_shares.split(",")]
            except ValueError:
                shares = []
            if not shares or any(not s > 0 or s == float("inf") for s in shares):
                raise ValueError(f"client_shares: expected positive numbers, e.g. 10,1; got {self.client_shares!r}")

    def interactive_targets(self) -> tuple[float, float]:
        try:
            ttft, tpot = (float(x) for x in self.interactive_slo.split(","))
        except ValueError:
            ttft = tpot = float("nan")
        if not (ttft > 0 and tpot > 0):
            raise ValueError(f"interactive_slo: expected TTFT,TPOT seconds, e.g. 0.5,0.05; "
                             f"got {self.interactive_slo!r}")
        return ttft, tpot

    def generate(self) -> list[RequestSpec]:
        import numpy as np

        rng = np.random.default_rng(self.seed)
        n = self.num_requests
        arrivals = self._arrival_times(rng)
        prompts = sample_lengths(self.prompt_len, n, rng, self.max_len)
        outputs = sample_lengths(self.output_len, n, rng, self.max_len)
        in_group = rng.random(n) < self.prefix_fraction if self.prefix_groups else np.zeros(n, bool)
        groups = rng.integers(0, max(self.prefix_groups, 1), n)
        priority_values = [int(p) for p in self.priorities.split(",")]
        priorities = rng.choice(priority_values, n)
        if self.client_shares:
            shares = np.array([float(x) for x in self.client_shares.split(",")])
            clients = rng.choice(len(shares), n, p=shares / shares.sum())
        else:
            clients = rng.integers(0, self.num_clients, n)
        interactive = (rng.random(n) < self.interactive_fraction if self.interactive_fraction
                       else np.zeros(n, bool))
        ttft_target, tpot_target = self.interactive_targets()
        specs = []
        for i in range(n):
            prompt = int(prompts[i])
            grouped = bool(in_group[i])
            specs.append(RequestSpec(
                arrival_time=float(arrivals[i]),
                prompt_tokens=prompt,
                output_tokens=int(outputs[i]),
                prefix_group=int(groups[i]) if grouped else None,
                prefix_tokens=min(self.prefix_tokens, prompt) if grouped else 0,
                priority=int(priorities[i]),
                client=int(clients[i]),
                slo_ttft_s=ttft_target if interactive[i] else None,
                slo_tpot_s=tpot_target if interactive[i] else None,
            ))
        if self.turns == "fixed:1":
            return specs
        return self._conversations(specs)

    def _conversations(self, singles: list[RequestSpec]) -> list[RequestSpec]:
        """The same requests strung into conversations, in order: a conversation
        takes turn 0 from the next single request (its system prompt, client,
        priority, targets), each later turn the next one's output length and a
        new message. It ends at its drawn number of turns, or before a prompt
        would pass ``max_len``. Its own random stream (seed, 1) leaves the single
        requests' draws as they were.

        Conversations start as a Poisson (or gamma) process at rate * C / n:
        the single requests' first C arrivals, stretched over the same span."""
        import numpy as np

        rng = np.random.default_rng([self.seed, 1])
        n = len(singles)
        # Drawn generously (every conversation could be one turn long); used in order.
        num_turns = iter(sample_lengths(self.turns, n, rng, n).tolist())
        messages = iter(sample_lengths(self.turn_prompt_len or self.prompt_len, n, rng, self.max_len).tolist())
        thinks = iter(sample_seconds(self.think_time, n, rng).tolist())
        conversations: list[list[RequestSpec]] = []
        rest = iter(singles)
        for single in rest:
            first = replace(single, conversation=len(conversations))
            turns = [first]
            for _ in range(next(num_turns) - 1):
                previous = turns[-1]
                prompt = previous.prompt_tokens + previous.output_tokens + next(messages)
                following = next(rest, None) if prompt <= self.max_len else None
                if following is None:
                    break
                turns.append(replace(first, prompt_tokens=prompt, output_tokens=following.output_tokens,
                                     turn=len(turns), think_time_s=next(thinks)))
            conversations.append(turns)
        stretch = n / len(conversations)
        return [replace(spec, arrival_time=singles[c].arrival_time * stretch)
                for c, turns in enumerate(conversations) for spec in turns]

    def _arrival_times(self, rng):
        import numpy as np

        n = self.num_requests
        if self.rate == 0:
            return np.zeros(n)
        mean_gap = 1.0 / self.rate
        if self.arrival == "poisson":
            gaps = rng.exponential(mean_gap, n)
        else:  # gamma with mean 1/rate: shape k, scale 1/(k * rate)
            gaps = rng.gamma(self.burstiness, mean_gap / self.burstiness, n)
        gaps[0] = 0.0  # the first request opens the run
        return np.cumsum(gaps)


def parse_length_dist(spec: str, name: str = "length distribution") -> tuple[str, list[float]]:
    kind, *args = spec.split(":")
    expected = {"fixed": 1, "uniform": 2, "lognormal": 2, "exponential": 1}
    if kind not in expected or len(args) != expected[kind]:
        raise ValueError(
            f"{name} {spec!r}: not a length distribution; expected fixed:N, uniform:LO:HI, "
            "lognormal:MEAN:CV or exponential:MEAN"
        )
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise ValueError(f"{name} {spec!r}: parameters must be numbers") from None
    if any(not v >= 0 for v in values):
        raise ValueError(f"{name} {spec!r}: parameters must be >= 0")
    return kind, values


def sample_seconds(spec: str, n: int, rng):
    """``n`` non-negative floats from a distribution string (not rounded)."""
    import numpy as np

    kind, args = parse_length_dist(spec)
    if kind == "fixed":
        return np.full(n, args[0])
    if kind == "uniform":
        return rng.uniform(args[0], args[1], n)
    if kind == "exponential":
        return rng.exponential(args[0], n)
    mean, cv = args  # lognormal with the given mean and coefficient of variation
    sigma2 = np.log1p(cv * cv)
    return rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), n) if mean else np.zeros(n)


def sample_lengths(spec: str, n: int, rng, max_len: int):
    """``n`` integer lengths in [1, max_len] from a distribution string."""
    import numpy as np

    kind, args = parse_length_dist(spec)
    if kind == "uniform":
        values = rng.integers(int(args[0]), int(args[1]) + 1, n)
    else:
        values = sample_seconds(spec, n, rng)
    return np.clip(np.rint(values), 1, max_len).astype(np.int64)


# ---------------------------------------------------------------- traces

_REQUIRED = ("arrival_time", "prompt_tokens", "output_tokens")


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Specs from a JSONL trace, sorted by arrival time."""
    specs = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            specs.append(_spec_from_row(json.loads(line), f"{path}:{line_no}"))
    specs.sort(key=lambda s: s.arrival_time)
    return specs


def _spec_from_row(row: dict, where: str) -> RequestSpec:
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    group = row.get("prefix_group")
    prompt = int(row["prompt_tokens"])
    prefix = row.get("prefix_tokens")
    if prefix is None:
        prefix = prompt // 2 if group is not None else 0
    return RequestSpec(
        arrival_time=float(row["arrival_time"]),
        prompt_tokens=prompt,
        output_tokens=int(row["output_tokens"]),
        prefix_group=None if group is None else int(group),
        prefix_tokens=int(prefix),
        priority=int(row.get("priority", 0)),
        client=int(row.get("client", 0)),
        slo_ttft_s=row.get("slo_ttft_s"),
        slo_tpot_s=row.get("slo_tpot_s"),
        conversation=None if row.get("conversation") is None else int(row["conversation"]),
        turn=int(row.get("turn", 0)),
        think_time_s=float(row.get("think_time_s", 0.0)),
    )


def write_trace(path: str | Path, specs: Iterable[RequestSpec]) -> None:
    """One JSON object per line; optional fields only where they say something."""
    with open(path, "w") as f:
        for spec in specs:
            row = asdict(spec)
            if spec.prefix_group is None:
                del row["prefix_group"], row["prefix_tokens"]
            for name in ("slo_ttft_s", "slo_tpot_s"):
                if row[name] is None:
                    del row[name]
            if spec.conversation is None:
                del row["conversation"], row["turn"], row["think_time_s"]
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- prompt tokens


RUN_FILL = 1  # a simulated prompt's ids after the first of each run (see PromptMaker)


class PromptMaker:
    """Prompt token ids for specs: a group's requests share their leading tokens.

    Without ``vocab_size`` (pure simulation) a run of ids opens with an id of
    its own (a request's, or a group's, from disjoint ranges) and goes on with
    ``RUN_FILL``, an id no simulated output is (the runner samples
    ``FILLER_TOKEN_ID``). Two token sequences then agree exactly as far as
    they would with every prompt id distinct (a run ends where the other
    sequence has a new run's own id or an output, never ``RUN_FILL``), so
    prompts share blocks where they share a group prefix and nowhere else,
    and a prompt costs no integer object per token (a million requests'
    prompts are half a billion ids). With
    it (a real model) ids are random in [``low``, vocab_size), seeded per
    request and per group, so two runs of one trace get the same prompts.
    """

    def __init__(self, vocab_size: int | None = None, *, low: int = 100, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.low = low
        self.seed = seed
        self._group_prefixes: dict[int, list[int]] = {}

    def make(self, index: int, spec: RequestSpec) -> list[int]:
        own = self.own_tokens(index, spec.prompt_tokens - spec.prefix_tokens)
        if not spec.prefix_tokens:
            return own
        assert spec.prefix_group is not None  # (a shared prefix has its group)
        return self._group_prefix(spec.prefix_group, spec.prefix_tokens) + own

    def own_tokens(self, index: int, num_tokens: int) -> list[int]:
        """Request ``index``'s own tokens (after its group prefix; a later
        turn's new message): shared with no other request."""
        return self._tokens(("req", index), num_tokens, start=(index + 1) << 24)

    def _group_prefix(self, group: int, length: int) -> list[int]:
        prefix = self._group_prefixes.get(group)
        if prefix is None or len(prefix) < length:
            # Group ranges sit below zero, apart from the per-request ones.
            prefix = self._tokens(("group", group), max(length, 2 * len(prefix or ())),
                                  start=-((group + 1) << 24))
            self._group_prefixes[group] = prefix
        return prefix[:length]

    def _tokens(self, key: tuple, n: int, start: int) -> list[int]:
        if self.vocab_size is None:
            return [start] + [RUN_FILL] * (n - 1) if n > 0 else []
        rng = random.Random(f"{self.seed}/{key[0]}/{key[1]}")
        return [rng.randrange(self.low, self.vocab_size) for _ in range(n)]
