"""The KV-content oracle over random workloads that mix every scheduling
feature (see ``tests/core/kv_oracle.py``); ``bench/kv_oracle.py`` runs the
same property over tens of thousands of examples."""

from hypothesis import HealthCheck, given, note, settings

import pytest

from tests.core.kv_oracle import expected_streams, pd_workload, run_pd_workload, run_workload, workloads
from tests.core.kv_oracle_regressions import FOUND


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_step_reads_the_kv_its_tokens_wrote(w):
    note(repr(w))
    run = run_workload(w)
    expected_streams(w, run)


@pytest.mark.parametrize("w", FOUND, ids=[f"found{i}" for i in range(len(FOUND))])
def test_workloads_the_oracle_found(w):
    run = run_workload(w)
    expected_streams(w, run)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_prefill_decode_disaggregation_reads_the_kv_the_producer_wrote(w):
    w = pd_workload(w)
    note(repr(w))
    run = run_pd_workload(w)
    expected_streams(w, run)
