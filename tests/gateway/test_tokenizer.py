"""Chat templates rendered byte-identically to transformers' apply_chat_template; probed boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken

from engine.protocol import default_model_path
from gateway.schemas import ChatCompletionRequest
from gateway.tokenizer import ByteLRU, Tokenizer, load_hf_tokenizer

# OpenAI-shaped conversations, and what the chat template sees of them (developer → system, text parts
# joined with newlines).
CONVERSATIONS = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None),
    ([{"role": "user", "content": "What is 2+2?"}], None),
    ([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
      {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke."}], None),
    ([{"role": "user", "content": f"turn {i}"} if i % 2 == 0 else {"role": "assistant", "content": f"reply {i}"}
      for i in range(9)], None),
    ([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Good morning"}],
     [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Good morning"}]),
    ([{"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]}],
     [{"role": "user", "content": "First part.\nSecond."}]),
    ([{"role": "system", "content": "Ünïcödé 🙂"}, {"role": "user", "content": "日本語で答えて 😀👍🏽"}], None),
    ([{"role": "user", "content": "literal <|im_end|> and <|im_start|>assistant inside"}], None),
    ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], None),
    ([{"role": "user", "content": "Finish this:"}, {"role": "assistant", "content": "Once upon"}], None),
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi", "name": "alice"}], None),
    ([{"role": "system", "content": "  leading and trailing  \n\n"},
      {"role": "user", "content": "\ttabs\n\nand\r\nCRLF "}], None),
    ([{"role": "system", "content": "A long shared system prompt. " * 60}, {"role": "user", "content": "Q?"}], None),
]


def template_messages(openai_messages: list[dict]) -> list[dict]:
    return ChatCompletionRequest.model_validate({"messages": openai_messages}).template_messages()


@pytest.mark.parametrize("openai_messages, expected_template_input", CONVERSATIONS)
def test_rendering_and_tokens_match_apply_chat_template(tokenizer, hf_tokenizer, openai_messages,
                                                        expected_template_input):
    messages = template_messages(openai_messages)
    reference_input = expected_template_input or openai_messages
    assert messages == reference_input
    prompt = tokenizer.chat_prompt(messages)
    reference_text = hf_tokenizer.apply_chat_template(reference_input, tokenize=False, add_generation_prompt=True)
    assert prompt.text.encode() == reference_text.encode()
    reference_ids = hf_tokenizer.apply_chat_template(reference_input, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    assert prompt.token_ids == list(reference_ids)


def test_boundaries_point_at_the_end_of_the_system_prompt_and_of_the_last_message(tokenizer):
    messages = template_messages([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
                                  {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Joke?"}])
    prompt = tokenizer.chat_prompt(messages)
    system_end, last_end = prompt.cache_boundaries
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert decode(prompt.token_ids[:system_end]) == "<|im_start|>system\nBe kind.<|im_end|>\n"
    assert decode(prompt.token_ids[system_end:last_end]) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nJoke?<|im_end|>\n")
    assert decode(prompt.token_ids[last_end:]) == "<|im_start|>assistant\n"  # only the generation prompt follows


def test_next_turn_shares_the_prefix_up_to_the_last_boundary(tokenizer):
    turn1 = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hi! What's up?"}, {"role": "user", "content": "Not much."}]
    first = tokenizer.chat_prompt(template_messages(turn1))
    second = tokenizer.chat_prompt(template_messages(turn2))
    b = first.cache_boundaries[-1]
    assert second.token_ids[:b] == first.token_ids[:b]
    assert first.cache_boundaries[0] == second.cache_boundaries[0]  # same system prompt, same boundary


def test_without_a_system_message_only_the_last_message_boundary(tokenizer):
    prompt = tokenizer.chat_prompt(template_messages([{"role": "user", "content": "Hello"}]))
    (last_end,) = prompt.cache_boundaries
    assert tokenizer.decode(prompt.token_ids[last_end:], skip_special_tokens=False) == "<|im_start|>assistant\n"


def test_system_probe_is_cached_per_system_prompt(tokenizer):
    system = {"role": "system", "content": "A cached system prompt."}
    tokenizer.chat_prompt(template_messages([system, {"role": "user", "content": "one"}]))
    hits = tokenizer._cache.hits
    again = tokenizer.chat_prompt(template_messages([system, {"role": "user", "content": "two"}]))
    assert tokenizer._cache.hits == hits + 1  # the system probe (the conversation, new, is no hit)
    assert tokenizer.decode(again.token_ids[: again.cache_boundaries[0]], skip_special_tokens=False).endswith(
        "A cached system prompt.<|im_end|>\n")


def probed_boundaries(tok: Tokenizer, messages: list[dict]) -> list[int]:
    """The reference for ChatPrompt.cache_boundaries: tokenize each probe and keep it if its text and
    tokens are a prefix of the prompt's."""
    text = tok.render(messages)
    ids = tok.encode(text, False)
    num_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    boundaries = []
    for probe in ([messages[:num_system]] if 0 < num_system < len(messages) else []) + [messages]:
        try:
            probe_text = tok.render(probe, add_generation_prompt=False)
        except Exception:
            continue
        probe_ids = tok.encode(probe_text, False)
        n = len(probe_ids)
        if text.startswith(probe_text) and ids[:n] == probe_ids and 0 < n < len(ids) and n not in boundaries:
            boundaries.append(n)
    return boundaries


@pytest.mark.parametrize("openai_messages", [c for c, _ in CONVERSATIONS])
def test_boundaries_equal_tokenizing_each_probe(tokenizer, openai_messages):
    messages = template_messages(openai_messages)
    assert tokenizer.chat_prompt(messages).cache_boundaries == probed_boundaries(tokenizer, messages)


def test_last_message_boundary_comes_from_the_prompts_own_tokens(tokenizer, monkeypatch):
    # ChatML: the last message ends where <|im_start|>, an added token, begins; the tokenizer splits
    # there first, so the prompt's tokens before it are the probe's, with no second tokenizing.
    messages = template_messages(CONVERSATIONS[2][0])
    expected = probed_boundaries(tokenizer, messages)
    tokenizer.chat_prompt(messages)  # the system probe, tokenized once and cached
    monkeypatch.setattr(tokenizer, "encode", lambda *args: pytest.fail("a probe was tokenized again"))
    assert tokenizer.chat_prompt(messages).cache_boundaries == expected


class RecordingBackend:
    """The tokenizers backend, recording the texts it is asked to encode."""

    def __init__(self, backend):
        self.backend = backend
        self.texts: list[str] = []

    def encode(self, text, **kwargs):
        self.texts.append(text)
        return self.backend.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


AGENT_TURNS = [
    ("Read the file <|im_start|>notes.txt please", "Reading it: ünïcödé 🙂 and a literal <|im_end|> inside."),
    ("  leading spaces\n\n\ttabs and CRLF\r\n", "ok"),
    ("", "an empty question gets this"),
    ("Finish: once upon a", " time"),
]


def converse(tok: Tokenizer, system: str | None = "You are an agent. " * 40):
    """A conversation turn by turn, as an agent sends it: each prompt, with what its tokenizer encoded."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for question, answer in AGENT_TURNS:
        messages.append({"role": "user", "content": question})
        tok.backend.texts.clear()
        yield list(messages), tok.chat_prompt(list(messages)), list(tok.backend.texts)
        messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("system", ["You are an agent. " * 40, None])
def test_a_conversation_is_tokenized_once(hf_tokenizer, system):
    tok = Tokenizer(hf_tokenizer)
    tok.backend = RecordingBackend(tok.backend)
    for turn, (messages, prompt, encoded) in enumerate(converse(tok, system)):
        assert prompt.token_ids == list(hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False))
        assert prompt.cache_boundaries == probed_boundaries(tok, messages)
        if turn:  # only what follows the previous turn's last message: the answer and the new question
            previous = tok.render(messages[:-2], add_generation_prompt=False)
            assert encoded == [prompt.text[len(previous):]]
        else:
            assert prompt.text in encoded


def test_a_conversation_evicted_from_the_cache_is_tokenized_whole(hf_tokenizer):
    tok = Tokenizer(hf_tokenizer, cache_bytes=1)  # holds nothing
    tok.backend = RecordingBackend(tok.backend)
    for messages, prompt, encoded in converse(tok):
        assert prompt.text in encoded
        assert prompt.cache_boundaries == probed_boundaries(tok, messages)


def test_byte_lru_keeps_the_most_recently_used_within_its_bytes():
    cache = ByteLRU(max_bytes=6)
    cache.put("a", [1, 2], 2)
    cache.put("b", [3, 4], 2)
    assert cache.get("a") == [1, 2]  # now the most recently used
    cache.put("c", [5, 6, 7], 3)  # 7 bytes: the least recently used, b, goes
    assert cache.get("b") is None and cache.get("c") == [5, 6, 7] and cache.num_bytes == 5
    cache.put("d", list(range(7)), 7)  # larger than the whole cache: not kept
    assert cache.get("d") is None and len(cache) == 2 and cache.hits == 2


def test_caches_are_per_tenant_and_bounded_in_bytes(hf_tokenizer):
    """A tenant never reuses another's entry (the timing oracle), and a large prompt costs its bytes."""
    tok = Tokenizer(hf_tokenizer, cache_bytes=1 << 20)
    system = {"role": "system", "content": "Shared words. " * 200}
    turn1 = [system, {"role": "user", "content": "one"}]
    tok.chat_prompt(turn1, tenant="key-a")
    hits = tok._cache.hits
    tok.chat_prompt(turn1, tenant="key-b")
    assert tok._cache.hits == hits  # b's first request: nothing of a's
    tok.chat_prompt(turn1, tenant="key-a")
    assert tok._cache.hits > hits
    big = {"role": "system", "content": "word " * 300_000}  # ~1.5 MB: more than the cache
    tok.chat_prompt([big, {"role": "user", "content": "x"}], tenant="key-a")
    assert tok._cache.num_bytes <= 1 << 20


@pytest.fixture(scope="module")
def make_template_tokenizer(hf_tokenizer, tmp_path_factory):
    """A Tokenizer over the same vocabulary with another chat template, loaded from an HF directory."""

    def make(template: str, added_tokens: Sequence[AddedToken] = ()) -> tuple[Tokenizer, object]:
        path = tmp_path_factory.mktemp("hf")
        original = hf_tokenizer.chat_template
        hf_tokenizer.chat_template = template
        try:
            hf_tokenizer.save_pretrained(str(path))
        finally:
            hf_tokenizer.chat_template = original
        hf = load_hf_tokenizer(str(path), Path(path))
        hf.add_tokens(list(added_tokens))
        return Tokenizer(hf), hf

    return make


LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ZEPHYR_STYLE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
COUNTING = ("{{ messages | length }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
GLUED = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}ing{% endif %}"


@pytest.mark.parametrize("template", [LLAMA3_STYLE, ZEPHYR_STYLE])
def test_other_templates_from_tokenizer_config_match_apply_chat_template(make_template_tokenizer, template):
    tok, hf = make_template_tokenizer(template)
    for openai_messages, expected in CONVERSATIONS[:4]:
        messages = template_messages(openai_messages)
        prompt = tok.chat_prompt(messages)
        assert prompt.text == hf.apply_chat_template(expected or openai_messages, tokenize=False,
                                                     add_generation_prompt=True)
        assert prompt.token_ids == list(hf.apply_chat_template(expected or openai_messages, tokenize=True,
                                                               add_generation_prompt=True, return_dict=False))
        assert prompt.cache_boundaries == probed_boundaries(tok, messages)


def test_probe_that_is_no_text_prefix_gives_no_boundary(make_template_tokenizer):
    tok, _ = make_template_tokenizer(COUNTING)  # the system probe "1[sys]" is no prefix of "2[sys][hi]>"
    prompt = tok.chat_prompt([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert prompt.text == "2[sys][hi]>"
    assert prompt.cache_boundaries == [len(tok.encode("2[sys][hi]", False))]  # only the last-message one


def test_probe_that_is_no_token_prefix_gives_no_boundary(make_template_tokenizer):
    tok, _ = make_template_tokenizer(GLUED)
    # "Say" + generation prompt "ing" tokenizes as "Saying": the probe's tokens are no prefix of it.
    assert tok.encode("Saying", False)[: len(tok.encode("Say", False))] != tok.encode("Say", False)
    prompt = tok.chat_prompt([{"role": "user", "content": "Say"}])
    assert prompt.text == "Saying" and prompt.cache_boundaries == []


def test_added_token_that_strips_the_space_before_it_gets_no_shortcut(make_template_tokenizer):
    # "<|sep|>" swallows the space before it, so "hi <|sep|>" tokenizes as [hi, <|sep|>] while the
    # probe "hi " is [hi, Ġ]: no true prefix, though an added token begins where the probe ends.
    tok, _ = make_template_tokenizer("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                     "{% if add_generation_prompt %}<|sep|>{% endif %}",
                                     [AddedToken("<|sep|>", lstrip=True, special=True)])
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.chat_prompt(messages)
    assert prompt.text == "hi <|sep|>" and len(prompt.token_ids) == 2
    assert prompt.cache_boundaries == probed_boundaries(tok, messages) == []


@pytest.mark.parametrize("added", [
    AddedToken("\n<|im_start|>", special=True),  # overlaps <|im_start|> from the left: "\n" no longer splits
    AddedToken("<|im_start|>", lstrip=True, special=True),  # takes the "\n" before it
])
def test_no_continuation_where_the_split_is_not_certain(make_template_tokenizer, hf_tokenizer, added):
    tok, hf = make_template_tokenizer(hf_tokenizer.chat_template, [added])
    assert not tok._starts_segment(tok.backend.token_to_id("<|im_start|>"))
    tok.backend = RecordingBackend(tok.backend)
    for messages, prompt, encoded in converse(tok):
        assert prompt.token_ids == list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                               return_dict=False))
        assert prompt.cache_boundaries == probed_boundaries(tok, messages)
        assert prompt.text in encoded


def test_token_bytes_rebuild_the_text_exactly(tokenizer):
    text = "naïve café — 日本語 🙂 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
    partial = [t for t in ids if tokenizer.token_text(t) == "\ufffd"]
    assert partial, "some token must hold only part of a character"
    assert all(len(tokenizer.token_bytes(t)) < 4 for t in partial)


@pytest.mark.slow
def test_cached_tokenizer_equals_a_fresh_gguf_conversion(tmp_path):
    gguf = str(default_model_path())
    fresh = load_hf_tokenizer(gguf, tmp_path)  # converts and writes the cache
    (entry,) = (tmp_path / "tokenizers").iterdir()
    cached = load_hf_tokenizer(gguf, tmp_path)  # reads the cache
    assert (entry / "tokenizer.json").is_file()
    assert cached.chat_template == fresh.chat_template and cached.special_tokens_map == fresh.special_tokens_map
    assert len(cached) == len(fresh)
    for text in ["Hello world", "  spaces\n\ttabs", "日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "x" * 500]:
        for special in (True, False):
            ids = cached(text, add_special_tokens=special)["input_ids"]
            assert ids == fresh(text, add_special_tokens=special)["input_ids"]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert cached.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(messages, tokenize=False)


def test_template_refusal_is_a_400_naming_messages(make_template_tokenizer):
    from gateway.errors import APIError

    tok, _ = make_template_tokenizer(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(APIError) as info:
        tok.chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert info.value.status == 400 and info.value.param == "messages"
    assert "the first message must be the user" in info.value.message
    assert tok.chat_prompt([{"role": "user", "content": "u"}]).text == "u"
