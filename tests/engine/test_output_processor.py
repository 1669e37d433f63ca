"""OutputProcessor driven with hand-built EngineCoreOutputs (no model, real tokenizer).

What the scheduler sends per step (new token ids, finish reason, logprob
rows) must become cumulative RequestOutputs: text, token ids, finish and
stop reasons, n completions of one prompt, and the stop strings the engine
must then finish in the scheduler.
"""

import pytest

from cadence.core.outputs import EngineCoreOutput, LogprobsLists
from cadence.core.request import FinishReason
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import Logprob
from cadence.sampling_params import SamplingParams

PROMPT_IDS = [504, 2988, 314]
QA = "The answer is 42.\n\nQ: what next? Q: again"


def eco(req_id, token_ids, finish=None, stop_reason=None, *, logprobs=None, prompt_logprobs=None,
        parent=None, cached=0):
    return EngineCoreOutput(
        request_id=req_id, new_token_ids=list(token_ids), finish_reason=finish,
        stop_reason=stop_reason, new_logprobs=logprobs, new_prompt_logprobs=prompt_logprobs,
        num_cached_tokens=cached, parent_request_id=parent,
    )


def rows(*entries):
    """LogprobsLists from (token ids [sampled, top...], logprobs, sampled rank) per row."""
    return LogprobsLists([list(e[0]) for e in entries], [list(e[1]) for e in entries],
                         [e[2] for e in entries])


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer)


def add(processor, req_id="r", params=None, prompt="The answer is"):
    processor.add_request(req_id, prompt, PROMPT_IDS, params or SamplingParams())


def only(results):
    outputs, stopped = results
    assert len(outputs) == 1
    return outputs[0], stopped


# ------------------------------------------------------------ one completion


def test_text_and_token_ids_accumulate(processor, tokenizer):
    ids = tokenizer.encode("Hello wörld 😀, how are you?")
    add(processor)
    for i, t in enumerate(ids[:-1]):
        out, stopped = only(processor.process([eco("r", [t])]))
        assert out.request_id == "r" and out.prompt == "The answer is"
        assert out.prompt_token_ids == PROMPT_IDS
        assert out.outputs[0].token_ids == ids[:i + 1]
        assert tokenizer.decode(ids[:i + 1]).startswith(out.outputs[0].text)
        assert not out.finished and out.outputs[0].finish_reason is None and stopped == []
    out, _ = only(processor.process([eco("r", ids[-1:], FinishReason.LENGTH)]))
    assert out.finished
    assert out.outputs[0].text == "Hello wörld 😀, how are you?"
    assert out.outputs[0].token_ids == ids
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert not processor.has_unfinished_requests()


def test_several_tokens_in_one_step(processor, tokenizer):
    ids = tokenizer.encode("one two three four")
    add(processor)
    only(processor.process([eco("r", ids[:1])]))
    out, _ = only(processor.process([eco("r", ids[1:])]))
    assert out.outputs[0].token_ids == ids
    assert out.outputs[0].text == "one two three four"


@pytest.mark.parametrize(
    "reason, stop_reason, expected",
    [(FinishReason.STOP, None, "stop"), (FinishReason.STOP, 28, "stop"),
     (FinishReason.LENGTH, None, "length"), (FinishReason.ABORT, None, "abort")],
)
def test_finish_reason_and_stop_reason_from_the_core(processor, reason, stop_reason, expected):
    add(processor)
    out, stopped = only(processor.process([eco("r", [19556, 28], reason, stop_reason)]))
    assert out.finished and out.outputs[0].finished
    assert out.outputs[0].finish_reason == expected
    assert out.outputs[0].stop_reason == stop_reason
    assert stopped == []  # the core finished it already
    assert not processor.has_unfinished_requests()


def test_outputs_of_unknown_or_finished_requests_are_ignored(processor):
    add(processor)
    only(processor.process([eco("r", [19556], FinishReason.LENGTH)]))
    assert processor.process([eco("r", [905]), eco("nobody", [905])]) == ([], [])


def test_num_cached_tokens_reported(processor):
    add(processor)
    out, _ = only(processor.process([eco("r", [19556], cached=16)]))
    assert out.num_cached_tokens == 16


def test_requests_are_kept_apart(processor, tokenizer):
    add(processor, "a")
    add(processor, "b")
    outs, _ = processor.process([eco("a", tokenizer.encode("alpha")), eco("b", tokenizer.encode("beta"))])
    assert {o.request_id: o.outputs[0].text for o in outs} == {"a": "alpha", "b": "beta"}


# ------------------------------------------------------------ stop strings


def test_stop_string_finishes_and_is_reported(processor, tokenizer):
    ids = tokenizer.encode(QA)
    add(processor, params=SamplingParams(stop=["\n\nQ:"]))
    for t in ids:
        out, stopped = only(processor.process([eco("r", [t])]))
        if out.finished:
            break
    assert stopped == ["r"]  # the engine must finish it in the scheduler
    completion = out.outputs[0]
    assert completion.text == "The answer is 42."
    assert completion.finish_reason == "stop" and completion.stop_reason == "\n\nQ:"
    assert tokenizer.decode(completion.token_ids).endswith("\n\nQ:")
    assert not processor.has_unfinished_requests()


def test_stop_string_in_the_last_output_is_not_reported_again(processor, tokenizer):
    ids = tokenizer.encode(QA)
    add(processor, params=SamplingParams(stop=["next"]))
    out, stopped = only(processor.process([eco("r", ids, FinishReason.LENGTH)]))
    assert stopped == []  # the scheduler already finished it (length)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "next"
    assert out.outputs[0].text == "The answer is 42.\n\nQ: what "


def test_streamed_text_holds_back_a_possible_stop(processor, tokenizer):
    add(processor, params=SamplingParams(stop=["\n\nQ:"]))
    out, _ = only(processor.process([eco("r", tokenizer.encode("The answer is 42.\n\nQ"))]))
    assert out.outputs[0].text == "The answer is 42."
    out, _ = only(processor.process([eco("r", [], FinishReason.LENGTH)]))
    assert out.outputs[0].text == "The answer is 42.\n\nQ"


# ------------------------------------------------------------ n > 1


def test_parallel_sampling_is_one_output_with_n_completions(processor, tokenizer):
    add(processor, "p", SamplingParams(n=3))
    assert processor.engine_request_ids("p") == ["p", "0_p", "1_p", "2_p"]
    words = [tokenizer.encode(w) for w in (" red", " green", " blue")]
    outs, _ = processor.process([eco(f"{i}_p", words[i], parent="p") for i in (2, 0, 1)])
    assert len(outs) == 1
    out = outs[0]
    assert out.request_id == "p" and not out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.text for c in out.outputs] == [" red", " green", " blue"]
    assert [c.token_ids for c in out.outputs] == words

    out, _ = only(processor.process([eco("1_p", [30], FinishReason.LENGTH, parent="p")]))
    assert not out.finished  # two are still running
    assert [c.finish_reason for c in out.outputs] == [None, "length", None]
    out, _ = only(processor.process([
        eco("0_p", [30], FinishReason.STOP, 30, parent="p"),
        eco("2_p", [], FinishReason.LENGTH, parent="p"),
    ]))
    assert out.finished
    assert [c.finish_reason for c in out.outputs] == ["stop", "length", "length"]
    assert [c.stop_reason for c in out.outputs] == [30, None, None]
    assert [c.text for c in out.outputs] == [" red.", " green.", " blue"]
    assert not processor.has_unfinished_requests()


def test_stop_string_of_one_child_reports_the_child_id(processor, tokenizer):
    add(processor, "p", SamplingParams(n=2, stop=["STOP"]))
    outs, stopped = processor.process([
        eco("0_p", tokenizer.encode(" go on"), parent="p"),
        eco("1_p", tokenizer.encode(" STOP here"), parent="p"),
    ])
    assert stopped == ["1_p"]
    out = outs[0]
    assert not out.finished
    # Child 0 still runs: its last len("STOP") - 1 characters are held back.
    assert [c.text for c in out.outputs] == [" go", " "]
    assert [c.finish_reason for c in out.outputs] == [None, "stop"]
    assert out.outputs[1].stop_reason == "STOP"


# ------------------------------------------------------------ logprobs


def test_logprob_rows_become_dicts_with_ranks(processor, tokenizer):
    add(processor, params=SamplingParams(logprobs=2))
    # Row 1: sampled 905 is also the top token. Row 2: sampled 30 ranks 5th, outside the top 2.
    out, _ = only(processor.process([eco("r", [905], logprobs=rows(([905, 905, 28], [-0.1, -0.1, -2.5], 1)))]))
    out, _ = only(processor.process([eco("r", [30], logprobs=rows(([30, 28, 198], [-4.0, -0.5, -1.0], 5)))]))
    first, second = out.outputs[0].logprobs
    assert first == {905: Logprob(-0.1, 1, " world"), 28: Logprob(-2.5, 2, ",")}
    assert second == {30: Logprob(-4.0, 5, "."), 28: Logprob(-0.5, 1, ","), 198: Logprob(-1.0, 2, "\n")}
    assert out.outputs[0].cumulative_logprob == pytest.approx(-4.1)


def test_no_logprobs_unless_asked(processor):
    add(processor)
    out, _ = only(processor.process([eco("r", [905], logprobs=rows(([905, 905], [-0.1, -0.1], 1)))]))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_logprobs_zero_keeps_only_the_sampled_token(processor):
    add(processor, params=SamplingParams(logprobs=0))
    out, _ = only(processor.process([eco("r", [30], logprobs=rows(([30], [-3.0], 4)))]))
    assert out.outputs[0].logprobs == [{30: Logprob(-3.0, 4, ".")}]


def test_prompt_logprobs_start_with_none(processor):
    add(processor, params=SamplingParams(prompt_logprobs=1))
    prompt_rows = rows(([2988, 28], [-3.0, -1.0], 7), ([314, 314], [-0.2, -0.2], 1))
    out, _ = only(processor.process([eco("r", [216], prompt_logprobs=prompt_rows)]))
    assert out.prompt_logprobs == [
        None,
        {2988: Logprob(-3.0, 7, " answer"), 28: Logprob(-1.0, 1, ",")},
        {314: Logprob(-0.2, 1, " is")},
    ]


def test_earlier_outputs_are_snapshots(processor):
    add(processor, params=SamplingParams(logprobs=1))
    first, _ = only(processor.process([eco("r", [905], logprobs=rows(([905, 905], [-0.1, -0.1], 1)))]))
    only(processor.process([eco("r", [30], logprobs=rows(([30, 30], [-0.3, -0.3], 1)))]))
    assert first.outputs[0].token_ids == [905]
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids)


# ------------------------------------------------------------ abort


def test_abort_finishes_what_is_unfinished(processor, tokenizer):
    add(processor, "p", SamplingParams(n=2))
    processor.process([eco("0_p", tokenizer.encode(" hi"), parent="p"),
                       eco("1_p", tokenizer.encode(" yo"), FinishReason.LENGTH, parent="p")])
    out = processor.abort("p")
    assert out.finished and out.request_id == "p"
    assert [c.finish_reason for c in out.outputs] == ["abort", "length"]
    assert [c.text for c in out.outputs] == [" hi", " yo"]
    assert not processor.has_unfinished_requests()
    assert processor.engine_request_ids("p") == []
    assert processor.process([eco("0_p", [30], parent="p")]) == ([], [])


def test_abort_of_unknown_request_is_none(processor):
    assert processor.abort("nobody") is None
