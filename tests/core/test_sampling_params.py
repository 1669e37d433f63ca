"""Invalid sampling parameters raise ValueError naming the field."""

import pytest

from cadence.sampling_params import SamplingParams, StructuredOutputParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3),
    ("min_p", 2.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("seed", "x"), ("temperature", float("nan")), ("n", True), ("stop_token_ids", [-1]),
])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(field)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.top_k == 0
    assert p.is_greedy
    assert SamplingParams(temperature=0.7).is_greedy is False


def test_structured_outputs_exactly_one():
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputParams(regex="a", choice=["b"])
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert p.structured_outputs.choice == ["yes", "no"]
