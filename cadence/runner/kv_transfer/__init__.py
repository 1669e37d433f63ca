"""Moving KV blocks between engine processes (prefill/decode disaggregation)."""
