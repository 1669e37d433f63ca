"""cadence.core: the scheduler, KV-cache manager and request model. Pure Python, no torch."""
