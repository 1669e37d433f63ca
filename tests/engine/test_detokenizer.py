"""IncrementalDetokenizer on the default model's real tokenizer.

Text built token by token must equal ``tokenizer.decode`` of the same ids,
never show half a character, and end exactly where a stop string says.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.engine.detokenizer import IncrementalDetokenizer
from cadence.sampling_params import SamplingParams

TEXTS = [
    "Hello, world!",
    "héllo wörld, ñandú, Ωμέγα and Привет",
    "emoji 😀 then a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵 🚀🎉",
    "日本語のテキスト、中文文本和한국어",
    "  two  spaces\tand\ttabs   ",
    "line one\nline two\n\n\nend\n",
    "math ∑ ∫ → ✓ ≤ ≥ and a zero-width\u200bjoiner",
]
QA = "The answer is 42.\n\nQ: what next? Q: again"


def stream(tokenizer, ids, params=None, chunk=1):
    """Feed ``ids`` ``chunk`` at a time; returns the detokenizer and the text after each append."""
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    texts = []
    for start in range(0, len(ids), chunk):
        detok.append(ids[start:start + chunk])
        texts.append(detok.text)
    return detok, texts


def splits_a_character(tokenizer, ids):
    """Whether some token alone is not valid UTF-8 (a character spread over tokens)."""
    def valid(data):
        try:
            data.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False
    return any(not valid(tokenizer.token_bytes(t)) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok, texts = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids) == text
    for partial in texts:
        assert "\ufffd" not in partial
        assert text.startswith(partial)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_any_chunking_gives_the_same_text(tokenizer, chunk):
    text = " | ".join(TEXTS)
    ids = tokenizer.encode(text)
    detok, texts = stream(tokenizer, ids, chunk=chunk)
    assert detok.text == text
    assert all("\ufffd" not in t for t in texts)


def test_emoji_appears_only_once_its_last_byte_arrived(tokenizer):
    ids = tokenizer.encode("I like 😀 a lot")
    assert splits_a_character(tokenizer, ids)  # the test is about split characters
    detok, texts = stream(tokenizer, ids)
    emoji_at = next(i for i, t in enumerate(texts) if "😀" in t)
    # The token before carried the first three bytes: the text then ends with the space.
    assert texts[emoji_at - 1] == "I like "
    assert texts[emoji_at] == "I like 😀"


def test_cjk_and_emoji_texts_really_split_characters(tokenizer):
    # Guard: the parametrised texts above exercise split characters, not just whole ones.
    assert splits_a_character(tokenizer, tokenizer.encode(TEXTS[2]))
    assert splits_a_character(tokenizer, tokenizer.encode(TEXTS[3]))


# SmolLM2's vocabulary has no token for some bytes (lead bytes 0xF1/0xF2 of
# planes 4-11, a few C0 controls): text using them cannot round-trip, so the
# alphabet stops below U+40000 and leaves out control characters.
REPRESENTABLE = st.characters(
    max_codepoint=0x3FFFF, blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffd"
)


@given(st.text(alphabet=REPRESENTABLE, max_size=40))
@settings(max_examples=60, deadline=None)
def test_random_text_token_by_token_equals_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok, texts = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids)
    assert all("\ufffd" not in t for t in texts)


# ------------------------------------------------------------ special tokens


def test_skip_special_tokens_drops_them(tokenizer):
    text = "<|im_start|>user\nhi there<|im_end|>"
    ids = tokenizer.encode(text)
    assert set(ids) & set(tokenizer.all_special_ids)
    detok, _ = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi there"


def test_special_tokens_kept_when_asked(tokenizer):
    text = "<|im_start|>user\nhi there<|im_end|>"
    ids = tokenizer.encode(text)
    detok, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert detok.text == tokenizer.decode(ids) == text


def test_only_special_tokens_give_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert detok.append([tokenizer.eos_token_ids[0]]) is None
    assert detok.text == ""


# ------------------------------------------------------------ stop strings


def append_until_stop(tokenizer, ids, params):
    """Feed one token at a time; returns (detok, index of the token that hit the stop)."""
    detok = IncrementalDetokenizer(tokenizer, params)
    for i, t in enumerate(ids):
        if detok.append([t]) is not None:
            return detok, i
    return detok, None


def test_stop_string_across_token_boundaries(tokenizer):
    ids = tokenizer.encode(QA)
    stop = "\n\nQ:"
    assert not any(stop in tokenizer.token_bytes(t).decode() for t in ids)  # spans tokens
    detok, hit = append_until_stop(tokenizer, ids, SamplingParams(stop=[stop]))
    assert detok.stop_string == stop
    assert tokenizer.decode(ids[:hit + 1]).endswith(stop)  # found as soon as complete
    assert detok.text == "The answer is 42."
    # Later tokens change nothing.
    assert detok.append(ids[hit + 1:]) == stop
    assert detok.text == "The answer is 42."


def test_stop_string_included_when_asked(tokenizer):
    ids = tokenizer.encode(QA)
    params = SamplingParams(stop=["\n\nQ:"], include_stop_str_in_output=True)
    detok, _ = append_until_stop(tokenizer, ids, params)
    assert detok.text == "The answer is 42.\n\nQ:"


def test_stop_string_inside_one_chunk_cuts_what_follows(tokenizer):
    ids = tokenizer.encode(QA)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["next"]))
    assert detok.append(ids) == "next"
    assert detok.text == "The answer is 42.\n\nQ: what "


@pytest.mark.parametrize("stops", [("again", "42", "Q:"), ("Q:", "again", "42")])
def test_earliest_of_several_stops_wins(tokenizer, stops):
    ids = tokenizer.encode(QA)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops))
    assert detok.append(ids) == "42"
    assert detok.text == "The answer is "


def test_stop_string_made_of_split_character(tokenizer):
    ids = tokenizer.encode("I like 😀 a lot")
    detok, hit = append_until_stop(tokenizer, ids, SamplingParams(stop=["😀"]))
    assert detok.stop_string == "😀"
    assert detok.text == "I like "
    assert hit == 3  # the token carrying the emoji's last byte


def test_streaming_never_shows_part_of_a_stop_string(tokenizer):
    ids = tokenizer.encode(QA)
    stop = "\n\nQ:"
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[stop]))
    shown = []
    for t in ids:
        finished = detok.append([t]) is not None
        shown.append(detok.streamable_text(finished=finished))
        if finished:
            break
    assert shown[-1] == "The answer is 42."
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before)  # a stream only grows
    assert all(stop[0] not in s for s in shown)  # not even the first "\n"


def test_held_back_tail_shown_once_finished(tokenizer):
    # Ends with "\n\nQ", a prefix of the stop string that never completes.
    ids = tokenizer.encode("end\n\nQ")
    detok, hit = append_until_stop(tokenizer, ids, SamplingParams(stop=["\n\nQ:"]))
    assert hit is None
    assert detok.streamable_text(finished=False) == "end"
    assert detok.streamable_text(finished=True) == "end\n\nQ"


def test_holdback_is_longest_stop_minus_one(tokenizer):
    ids = tokenizer.encode("abcdefghij")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["xy", "wxyz"]))
    detok.append(ids)
    assert detok.text == "abcdefghij"
    assert detok.streamable_text(finished=False) == "abcdefg"


def test_no_stop_strings_stream_everything(tokenizer):
    ids = tokenizer.encode(QA)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    for t in ids:
        detok.append([t])
        assert detok.streamable_text(finished=False) == detok.text
    assert detok.text == QA
