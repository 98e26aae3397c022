"""Incremental detokenization and stop strings against the tokenizer's own full decode."""

from __future__ import annotations

import pytest

from gateway.detokenizer import SequenceText

TEXTS = [
    "Hello, world! This is plain ASCII text with numbers 12345.",
    "Ünïcödé: naïve café, Straße, smörgåsbord — “quotes” and ‘more’.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀👍🏽🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🙂 end",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # square\n",
    "Mixed ascii😀日本 ẞ ǅ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok",
]
PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


def stream(seq: SequenceText, ids: list[int], chunk: int) -> tuple[list[str], int]:
    """Feed ``ids`` in frames of ``chunk`` tokens; returns the released pieces and tokens consumed."""
    pieces, consumed = [], 0
    for i in range(0, len(ids), chunk):
        consumed += len(seq.add(ids[i:i + chunk]))
        pieces.append(seq.release())
        if seq.stopped:
            break
    pieces.append(seq.finish())
    return pieces, consumed


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_text_equals_full_decode_and_never_breaks_utf8(tokenizer, hf_tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, consumed = stream(SequenceText(tokenizer, PROMPT), ids, chunk)
    assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert consumed == len(ids)
    assert not any("\ufffd" in p for p in pieces)  # a character split across tokens is held back, not mangled


def test_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    seq = SequenceText(tokenizer, PROMPT)
    for token in ids[:-1]:
        seq.add([token])
        assert seq.release() == ""
    seq.add(ids[-1:])
    assert seq.release() == "🙂"


def test_incomplete_character_at_the_end_becomes_replacement_char(tokenizer):
    ids = tokenizer.encode("ok🙂", add_special_tokens=False)
    seq = SequenceText(tokenizer, PROMPT)
    seq.add(ids[:-1])
    assert seq.release() + seq.finish() == "ok\ufffd"


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries_cuts_right(tokenizer, chunk, include):
    text = "The answer is forty-two. THE END of the story, and more text after it."
    stop = "THE END"
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = SequenceText(tokenizer, PROMPT, stops=(stop,), include_stop=include)
    pieces, consumed = stream(seq, ids, chunk)
    expected = "The answer is forty-two. " + (stop if include else "")
    assert "".join(pieces) == expected and seq.text == expected and seq.stopped
    # exactly the tokens up to the one that completed the stop string were consumed
    first_complete = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], True))
    assert consumed == first_complete
    if not include:
        assert not any("THE" in p for p in pieces)  # no part of the stop string ever went out


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    seq = SequenceText(tokenizer, PROMPT, stops=("delta", "beta", "gamma"))
    pieces, _ = stream(seq, ids, len(ids))  # all at once: several stops in one frame
    assert "".join(pieces) == "alpha "


def test_stop_string_with_a_multibyte_character(tokenizer):
    ids = tokenizer.encode("Smile 🙂 please, then 😀 stop", add_special_tokens=False)
    seq = SequenceText(tokenizer, PROMPT, stops=("🙂 p",))
    pieces, _ = stream(seq, ids, 1)
    assert "".join(pieces) == "Smile "


def test_released_text_lags_by_at_most_the_longest_stop_minus_one(tokenizer):
    text = "one two three four five six seven"
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = SequenceText(tokenizer, PROMPT, stops=("xyz", "never"))
    released = ""
    for token in ids:
        seq.add([token])
        released += seq.release()
        assert len(seq.text) - len(released) <= len("never") - 1
    assert released + seq.finish() == text


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = "stop here and stop there"
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = next(k for k in range(1, len(ids)) if "stop here" in tokenizer.decode(ids[:k], True)) + 1
    seq = SequenceText(tokenizer, PROMPT, stops=("stop",), min_tokens=k)
    pieces, _ = stream(seq, ids, 1)
    assert "".join(pieces) == "stop here and "


@pytest.mark.parametrize("skip, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_special_tokens_skipped_or_kept(tokenizer, skip, expected):
    ids = tokenizer.encode("Hi there<|im_end|>", add_special_tokens=False)
    pieces, _ = stream(SequenceText(tokenizer, PROMPT, skip_special_tokens=skip), ids, 1)
    assert "".join(pieces) == expected
