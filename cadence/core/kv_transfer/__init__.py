"""KV connectors, scheduler side: what to move between this engine's KV
cache and elsewhere, planned with the scheduler (the protocol is
``cadence.core.sched.kv_connector``; the worker sides are in
``cadence.runner.kv_transfer``). ``offloading.py``: the host-memory tier and
swap preemption, over ``host_tier.py``'s slot bookkeeping; ``pd_connector.py``:
prefill/decode disaggregation (a decode engine pulls a prefill engine's KV)."""
