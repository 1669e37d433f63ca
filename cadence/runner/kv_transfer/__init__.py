"""KV connectors, worker side: the runner's half of a connector moves KV
bytes between its paged cache and elsewhere (a host-memory tier, another
engine). The scheduler's half (``cadence.core.kv_transfer``) plans; this half
executes the plan around the forward. ``base.py`` is the protocol."""
