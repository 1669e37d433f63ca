"""Workloads the KV-content oracle found failing, kept as explicit examples
of ``tests/core/test_kv_oracle.py`` (each ran against the fix that closed it).

Each comment says what went wrong before the fix: KV read that no step wrote
(wrong output on a real model), or requests that never finished.
"""

from __future__ import annotations

from tests.core.kv_oracle import Workload


def req(req_id: str, prompt: list[int], **fields) -> dict:
    """A request of a workload; fields not given take ``workloads()``'s plainest values."""
    request = {"id": req_id, "prompt": prompt, "max_tokens": 1, "arrival_step": 0,
               "abort_step": None, "priority": 0, "tenant": None, "ttft": None, "n": 1,
               "grammar": False}
    request.update(fields)
    return request


def workload(requests: list[dict], scheduler: dict, *, fail_all: bool = False, **fields) -> Workload:
    """``fail_all``: every request's first load from the tier breaks."""
    if fail_all:
        fields["failing_loads"] = frozenset(r["id"] for r in requests)
    return Workload(requests=requests, scheduler=scheduler, **fields)


FOUND = [
    # a forking parent (n > 1) loaded from the tier up to its fork point never ran
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100]),
            req('r3', [100]),
            req('r4', [100]),
            req('r5', [100] * 5, arrival_step=1, n=2),
            req('r6', [100]),
            req('r7', [100] * 4),
            req('r8', [100] * 5),
        ],
        scheduler={'policy': 'fcfs',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 5,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        tier_slots=8, fail_all=True,
    ),
    # fair: a grammar still compiling at the head held every seat's prefill back
    workload(
        requests=[
            req('r0', [100], tenant='a'),
            req('r1', [100], tenant='a', grammar=True),
            req('r2', [100] * 5, n=2),
            req('r3', [100]),
            req('r4', [100]),
            req('r5', [100]),
            req('r6', [100]),
            req('r7', [100]),
            req('r8', [100]),
            req('r9', [100]),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 5,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 0,
                   'max_blocked_bypass_steps': 0},
        structured=True,
    ),
    # fair: two clients displaced each other at every chunk
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100]),
            req('r3', [100] * 5),
            req('r4', [100]),
            req('r5', [100] * 5, tenant='a'),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 5,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 4},
    ),
    # fair: a protected request deferred for a client that could not be seated
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100] * 9, tenant='a'),
            req('r3', [100] * 3),
            req('r4', [100] * 3, arrival_step=1),
            req('r5', [100] * 9),
            req('r6', [100]),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 6,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 4},
        tier_slots=8, fail_all=True,
    ),
    # a request resumed and displaced in one step stayed in the step's resumed list
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100], tenant='a'),
            req('r2', [100] * 9, tenant='a'),
            req('r3', [100] * 4),
            req('r4', [100], tenant='a'),
            req('r5', [100] * 6, arrival_step=1),
            req('r6', [100] * 5),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 6,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 4},
        tier_slots=8, fail_all=True,
    ),
    # swap: allocating a slot evicted the slot holding the victim's next block
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100] * 7 + [101] + [100] * 12, max_tokens=6, arrival_step=1),
            req('r2', [100], arrival_step=1, n=2),
            req('r3', [100] * 7 + [101], max_tokens=2, arrival_step=1, ttft=1.0, n=2),
            req('r4', [100] * 15, max_tokens=2, arrival_step=2, ttft=1.0),
            req('r5', [100], arrival_step=1),
            req('r6', [100]),
        ],
        scheduler={'policy': 'slo',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 3,
                   'num_gpu_blocks': 11,
                   'enable_prefix_caching': True,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        num_spec=1, tier_slots=8, preemption_mode='swap', fail_all=True,
    ),
    # swap: a failed swap left a slot findable by hash whose copy was never issued
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100] * 7, priority=1),
            req('r2', [100], max_tokens=6),
            req('r3', [100] * 3 + [101] + [100] * 17, max_tokens=9, n=3),
            req('r4', [100]),
            req('r5', [100]),
            req('r6', [100]),
            req('r7', [100]),
        ],
        scheduler={'policy': 'priority',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 2,
                   'num_gpu_blocks': 14,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        num_spec=1, tier_slots=8, preemption_mode='swap', fail_all=True,
    ),
    # loads beside each other held every block; none could be admitted
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100] * 9, n=3),
            req('r3', [100] * 21, n=2),
            req('r4', [100]),
            req('r5', [100]),
            req('r6', [100]),
            req('r7', [100]),
        ],
        scheduler={'policy': 'priority',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 9,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        tier_slots=8, failing_loads=frozenset(['r0', 'r1', 'r2', 'r4', 'r5', 'r6', 'r7']),
    ),
    # priority: among equal children the furthest along was the victim, round after round
    workload(
        requests=[
            req('r0', [100] * 13, max_tokens=9, n=3),
            req('r1', [100] * 9),
        ],
        scheduler={'policy': 'priority',
                   'max_num_batched_tokens': 13,
                   'max_num_seqs': 3,
                   'num_gpu_blocks': 9,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 4,
                   'max_blocked_bypass_steps': 0},
    ),
    # async: a displaced request re-admitted in the same step counted its placeholder twice
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100] * 13),
            req('r3', [100] * 5),
            req('r4', [100], max_tokens=4, priority=1),
            req('r5', [100]),
        ],
        scheduler={'policy': 'priority',
                   'max_num_batched_tokens': 13,
                   'max_num_seqs': 2,
                   'num_gpu_blocks': 7,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 4,
                   'max_blocked_bypass_steps': 0,
                   'max_num_partial_prefills': 2,
                   'max_long_partial_prefills': 1,
                   'async_scheduling': True},
    ),
    # slo: among equal children the furthest along was the victim, round after round
    workload(
        requests=[
            req('r0', [100] * 19, max_tokens=7, n=3),
            req('r1', [100]),
            req('r2', [100]),
            req('r3', [100]),
            req('r4', [100]),
            req('r5', [100]),
            req('r6', [100]),
            req('r7', [100]),
            req('r8', [100]),
        ],
        scheduler={'policy': 'slo',
                   'max_num_batched_tokens': 19,
                   'max_num_seqs': 2,
                   'num_gpu_blocks': 10,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 7,
                   'max_blocked_bypass_steps': 0},
    ),
    # fair: protection dropped while the displacing request loaded its KV
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [100]),
            req('r2', [100]),
            req('r3', [100] * 13),
            req('r4', [100] * 13, tenant='a'),
            req('r5', [100]),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 7,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        tier_slots=8, fail_all=True,
    ),
    # fair: loaded requests held the blocks of a running request the policy deferred
    workload(
        requests=[
            req('r0', [100] * 5, arrival_step=1, n=2),
            req('r1', [100] * 13, tenant='a'),
            req('r2', [100] * 5),
            req('r3', [100] * 5),
            req('r4', [100]),
            req('r5', [100] * 5),
            req('r6', [100] * 5),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 8,
                   'max_num_seqs': 2,
                   'num_gpu_blocks': 7,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': True,
                   'long_prefill_token_threshold': 0},
        tier_slots=8, fail_all=True,
    ),
    # fair: prompts deferred for a front request that could not get blocks: empty steps for ever
    workload(
        requests=[
            req('r0', [100] * 3 + [101] + [100] * 11, arrival_step=2),
            req('r1', [100], max_tokens=5, arrival_step=1),
            req('r2', [100]),
            req('r3', [100], tenant='a'),
            req('r4', [100] * 5, max_tokens=9, tenant='a'),
            req('r5', [100], n=2),
        ],
        scheduler={'policy': 'fair',
                   'max_num_batched_tokens': 15,
                   'max_num_seqs': 2,
                   'num_gpu_blocks': 7,
                   'enable_prefix_caching': True,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 7,
                   'max_blocked_bypass_steps': 0},
    ),
    # slo: a request about to load its KV displaced a running one, round after round
    workload(
        requests=[
            req('r0', [100]),
            req('r1', [123] + [100] * 19, max_tokens=7, n=3),
            req('r2', [100], arrival_step=4),
            req('r3', [100], arrival_step=1),
            req('r4', [100], arrival_step=4),
            req('r5', [100], arrival_step=7),
            req('r6', [100], arrival_step=5),
            req('r7', [123] + [100] * 12, arrival_step=5, ttft=1.0),
        ],
        scheduler={'policy': 'slo',
                   'max_num_batched_tokens': 20,
                   'max_num_seqs': 1,
                   'num_gpu_blocks': 11,
                   'enable_prefix_caching': False,
                   'enable_chunked_prefill': False,
                   'long_prefill_token_threshold': 0,
                   'max_blocked_bypass_steps': 0},
        tier_slots=8, failing_loads=frozenset(['r0', 'r1', 'r2', 'r3', 'r4', 'r5', 'r6']),
    ),

]
