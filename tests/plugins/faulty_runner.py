"""A runner fault, for the server's tests of failed steps: the engine process
imports this module for the policy named on the command line
(``--policy tests.plugins.faulty_runner:FirstComeFirstServed``), and from
then on every step that holds a request with seed ``POISON_SEED`` runs,
writes garbage where it wrote in the KV cache (as a forward that died half
way leaves it) and raises."""

from cadence.core.sched.policy import FCFSPolicy
from cadence.runner.model_runner import ModelRunner

POISON_SEED = 4242
_real_execute_model = ModelRunner.execute_model
_poisoned: set[str] = set()


def _execute_model(self, scheduler_output):
    _poisoned.update(new.req_id for new in scheduler_output.scheduled_new_reqs
                     if new.sampling_params.seed == POISON_SEED)
    output = _real_execute_model(self, scheduler_output)
    if _poisoned.isdisjoint(scheduler_output.num_scheduled_tokens):
        return output
    written = [block for new in scheduler_output.scheduled_new_reqs
               for block in new.block_ids[new.num_computed_tokens // self.block_size:]]
    written += [block for ids in scheduler_output.scheduled_cached_reqs.new_block_ids for block in ids]
    self.kv_cache.data[:, :, written] = 3.0
    raise RuntimeError("a kernel fell over")


ModelRunner.execute_model = _execute_model


class FirstComeFirstServed(FCFSPolicy):
    """First come, first served (this module's import is what matters)."""
