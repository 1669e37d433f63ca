"""Invalid sampling parameters raise ValueError naming the field."""

import pytest

from cadence.sampling_params import (
    MAX_INT64, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY, SamplingParams,
    StructuredOutputParams,
)


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
    assert p.structured_outputs.choice == ("yes", "no")
    assert p.structured_outputs.kind == "choice"
    hash(p)  # a frozen params object stays hashable


def test_structured_outputs_fields_are_checked():
    with pytest.raises(ValueError, match="^structured_outputs: unknown field"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="^structured_outputs.choice: must be a list of strings"):
        StructuredOutputParams(choice="yes")
    with pytest.raises(ValueError, match="^structured_outputs.choice: must not be empty"):
        StructuredOutputParams(choice=[])
    with pytest.raises(ValueError, match="^structured_outputs.regex: must be a non-empty string"):
        StructuredOutputParams(regex=5)
    with pytest.raises(ValueError, match="^structured_outputs.json: must be a JSON schema"):
        StructuredOutputParams(json=[1])
    with pytest.raises(ValueError, match="^structured_outputs: exactly one"):
        StructuredOutputParams(json_object=False)
    # A schema keeps its property order (the order the model writes them in).
    schema = StructuredOutputParams(json={"properties": {"b": {}, "a": {}}}).json
    assert schema.index('"b"') < schema.index('"a"')
    assert StructuredOutputParams(json_object=True).kind == "json_object"


# ---- bounds: every value must be finite and must cross to the engine (msgpack: 64 bits)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be a finite number"):
        SamplingParams(**{field: value})


def test_temperature_is_bounded():
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    with pytest.raises(ValueError, match="^temperature: must be <= "):
        SamplingParams(temperature=1e308)


@pytest.mark.parametrize("field", ["n", "top_k", "max_tokens", "min_tokens", "logprobs",
                                   "prompt_logprobs"])
def test_integers_beyond_64_bits_are_refused(field):
    SamplingParams(**{field: MAX_INT64, **({"max_tokens": None} if field == "min_tokens" else {})})
    with pytest.raises(ValueError, match=f"^{field}: must be <= {MAX_INT64}"):
        SamplingParams(**{field: MAX_INT64 + 1})
    with pytest.raises(ValueError, match="^stop_token_ids: "):
        SamplingParams(stop_token_ids=[2**64])


def test_seed_is_an_unsigned_64_bit_integer():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for seed in (-1, 2**64, 10**30):
        with pytest.raises(ValueError, match="^seed: must be an unsigned 64-bit integer"):
            SamplingParams(seed=seed)


def test_every_sample_of_n_gets_a_seed_that_fits():
    # Sample i of n draws with seed + i: the last one must fit too.
    assert SamplingParams(n=3, seed=2**64 - 3).seed == 2**64 - 3
    with pytest.raises(ValueError, match=r"^seed: .*\[0, 18446744073709551613\]"):
        SamplingParams(n=3, seed=2**64 - 2)


def test_a_stop_string_with_a_lone_surrogate_is_refused():
    with pytest.raises(ValueError, match="^stop: .*surrogate"):
        SamplingParams(stop=["ok", "\ud800"])


# ---- penalties: a value the sampler cannot use is refused, not turned into token 0


@pytest.mark.parametrize("value", [1e-40, 1e-7, -1.0, 0.0, 1e7, 1e300])
def test_repetition_penalty_outside_its_range_is_refused(value):
    with pytest.raises(ValueError, match="^repetition_penalty: must be [<>]= "):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("value", [MIN_REPETITION_PENALTY, 0.5, 1, 1.3, MAX_REPETITION_PENALTY])
def test_repetition_penalty_inside_its_range_is_kept(value):
    assert SamplingParams(repetition_penalty=value).repetition_penalty == value


def test_every_accepted_repetition_penalty_keeps_float32_logits_finite():
    # The sampler divides positive logits by r and multiplies negative ones, in float32.
    float32_max = 3.4028234e38
    largest_logit = 1e4  # far beyond any model's
    assert largest_logit / MIN_REPETITION_PENALTY < float32_max
    assert largest_logit * MAX_REPETITION_PENALTY < float32_max
    assert MIN_REPETITION_PENALTY > 1.18e-38  # a normal float32, not a subnormal


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_are_within_two(field):
    for value in (-2.0, 0.0, 2, 2.0):
        assert getattr(SamplingParams(**{field: value}), field) == value
    for value in (-2.01, 2.5, 1e30):
        with pytest.raises(ValueError, match=f"^{field}: must be [<>]= "):
            SamplingParams(**{field: value})


def test_errors_quote_a_bounded_prefix_of_the_value():
    with pytest.raises(ValueError) as err:
        SamplingParams(seed="x" * 1_000_000)
    assert str(err.value).startswith("seed: ") and len(str(err.value)) < 200
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["ok", b"y" * 1_000_000])  # not a str
    assert len(str(err.value)) < 200
    with pytest.raises(ValueError, match="^top_k: must be <= ") as err:
        SamplingParams(top_k=10**5000)  # beyond Python's digit limit for str()
    assert len(str(err.value)) < 200
