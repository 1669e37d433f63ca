"""Counting the preemptions an ``LLM``'s scheduler makes (tests that need the cache to run out)."""


def record_preemptions(llm) -> list[str]:
    """The ids each later ``schedule()`` preempts, appended to the returned list."""
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule
    preemptions: list[str] = []

    def counting_schedule():
        output = schedule()
        preemptions.extend(output.preempted_req_ids)
        return output

    scheduler.schedule = counting_schedule
    return preemptions
