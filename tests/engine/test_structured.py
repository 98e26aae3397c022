"""Structured output in the engine: grammars compiled against the model's vocabulary, masks on the
constrained rows of a step, matchers advanced per token, bad specs refused with the field named.

The generation tests run the real SmolLM2 with its GGUF vocabulary; the plumbing tests (HTTP, the
offline mode, the decode-graph path, a rejected token) run the tiny model with a synthetic
byte-level vocabulary of its vocab size.
"""

from __future__ import annotations

import functools
import io
import json
import re
import time

import msgpack
import pytest
import torch
import xgrammar as xgr
from paged import peaky_tiny
from starlette.testclient import TestClient

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.model_runner import LaunchedStep
from engine.models.loader import load_tokenizer_info
from engine.offline import run_offline
from engine.protocol import (
    MSGPACK,
    GenerateRequest,
    OutputFrame,
    ProtocolError,
    SamplingParams,
    StructuredOutput,
)
from engine.server import build_app
from engine.structured import NO_VOCABULARY, Grammars, TokenMasks, new_matcher
from engine.warmup import warmup

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
CODE = r"[A-Z][a-z]{2,7}-\d{2,4}"
COLOURS = ["red", "green", "blue", "light blue"]
EXPRESSION = """root ::= "(" expr ")"
expr ::= num (op num){0,3}
op ::= " + " | " * "
num ::= [1-9] [0-9]{0,2}"""


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == set(PERSON["properties"])
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert type(person["age"]) is int and 18 <= person["age"] <= 99
    assert person["role"] in ("admin", "user", "guest")
    assert set(person["address"]) == {"city", "zip"} and len(person["address"]["city"]) <= 12
    assert type(person["address"]["zip"]) is int and 10000 <= person["address"]["zip"] <= 99999
    assert 1 <= len(person["tags"]) <= 3 and set(person["tags"]) <= {"a", "b", "c"}


# (kind, spec, prompt, check of the output text, also sampled at temperature 1.0)
CASES = [
    ("json_schema", json.dumps(PERSON), "Describe a person as JSON.", check_person, True),
    ("regex", CODE, "Write a product code.", lambda t: re.fullmatch(CODE, t) or pytest.fail(t), True),
    ("choice", json.dumps(COLOURS), "Pick a colour.", lambda t: t in COLOURS or pytest.fail(t), True),
    ("grammar", EXPRESSION, "Write a sum.",
     lambda t: re.fullmatch(r"\([1-9]\d{0,2}( [+*] [1-9]\d{0,2}){0,3}\)", t) or pytest.fail(t), True),
    ("json_object", "", 'Reply with a JSON object with the keys "city" and "country" for Paris.',
     lambda t: isinstance(json.loads(t), dict) or pytest.fail(t), False),
]


# --- the real SmolLM2 --------------------------------------------------------------------------

class Text:
    """Prompts and outputs of SmolLM2 as text, through its vocabulary: a greedy longest-match
    encoder (near enough to BPE for a prompt) and the tokens' bytes."""

    def __init__(self, info: xgr.TokenizerInfo, eos: int):
        self.vocab = info.decoded_vocab
        self.ids = {piece: i for i, piece in enumerate(self.vocab) if piece}
        self.eos = eos

    def encode(self, text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            j = next(j for j in range(min(len(data), i + 16), i, -1) if data[i:j] in self.ids)
            out.append(self.ids[data[i:j]])
            i = j
        return out

    def chat(self, text: str) -> list[int]:
        im_start, im_end = 1, 2
        return [im_start, *self.encode(f"user\n{text}"), im_end, *self.encode("\n"), im_start,
                *self.encode("assistant\n")]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.vocab[i] for i in ids if i != self.eos).decode()


@pytest.fixture(scope="module")
def text(smollm2, smollm2_tokenizer_info):
    return Text(smollm2_tokenizer_info, smollm2[1].eos_token_ids[0])


@pytest.fixture(scope="module")
def real_core(smollm2, smollm2_tokenizer_info):
    model, config = smollm2

    def make(**overrides):
        settings = {"max_num_batched_tokens": 256, "num_kv_blocks": 512, **overrides}
        return EngineCore.from_model(EngineConfig(model="smollm2", **settings), model, config, smollm2_tokenizer_info)

    return make


def run(core: EngineCore, requests: list[GenerateRequest]) -> dict[tuple[str, int], tuple[list[int], str]]:
    """(request id, index) -> (tokens, finish reason), checking the pool after every step."""
    for request in requests:
        core.add_request(request)
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    while core.has_work():
        for frame in core.step():
            tokens.setdefault((frame.request_id, frame.index), []).extend(frame.token_ids)
            if frame.finish_reason is not None:
                finish[frame.request_id, frame.index] = frame.finish_reason
        core.check_integrity()
    assert core.check_integrity().used == 0
    return {key: (tokens[key], finish[key]) for key in tokens}


def structured(kind: str, spec: str, **sampling) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput(kind, spec), **{"max_tokens": 200, **sampling})


def case_requests(text: Text, prefix: str = "") -> list[GenerateRequest]:
    """Per case one greedy request, and where the grammar is finite three seeded samples at
    temperature 1.0 (n = 3: each sibling its own matcher)."""
    requests = []
    for kind, spec, prompt, _, sampled in CASES:
        requests.append(GenerateRequest(f"{prefix}{kind}-greedy", text.chat(prompt),
                                        structured(kind, spec, temperature=0.0)))
        if sampled:
            requests.append(GenerateRequest(f"{prefix}{kind}-sampled", text.chat(prompt),
                                            structured(kind, spec, temperature=1.0, seed=7, n=3)))
    return requests


@pytest.mark.slow
def test_constrained_outputs_are_valid_greedy_and_sampled(real_core, text):
    out = run(real_core(), case_requests(text))
    assert len(out) == 5 + 4 * 3
    for kind, _, _, check, _ in CASES:
        for (rid, index), (tokens, finish) in out.items():
            if rid.startswith(f"{kind}-"):
                assert finish == "stop", (rid, index, text.decode(tokens))
                assert tokens[-1] == text.eos
                check(text.decode(tokens))
    samples = {text.decode(out["json_schema-sampled", i][0]) for i in range(3)}
    assert len(samples) > 1  # the siblings drew their own tokens


@pytest.mark.slow
def test_unconstrained_rows_are_unchanged_by_constrained_ones_in_the_batch(real_core, text):
    plain = [
        GenerateRequest(f"plain{i}", text.chat(prompt), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        for i, prompt in enumerate(["Tell me about the sea.", "Describe a person as JSON.", "Count to ten."])
    ]
    alone = run(real_core(), plain)
    mixed = run(real_core(), [*case_requests(text)[::2], *plain])
    for request in plain:
        assert mixed[request.request_id, 0] == alone[request.request_id, 0]


@pytest.mark.slow
def test_a_constrained_sequence_preempted_mid_output_resumes_validly(real_core, text, monkeypatch):
    """Preemption by recompute keeps the output tokens the matcher accepted, so the resumed
    sequence goes on from the matcher's state: same greedy output as without preemption."""
    requests = [GenerateRequest(f"person{i}", text.chat(f"Describe person number {i} as JSON."),
                                structured("json_schema", json.dumps(PERSON), temperature=0.0, max_tokens=100))
                for i in range(4)]
    ample = run(real_core(), requests)
    core = real_core(num_kv_blocks=12, block_size=16)
    preempted_at: list[int] = []  # output tokens of each victim
    preempt = core.scheduler._preempt
    monkeypatch.setattr(core.scheduler, "_preempt",
                        lambda seq: (preempted_at.append(len(seq.output_ids)), preempt(seq)))
    tight = run(core, requests)
    assert any(n > 0 for n in preempted_at), preempted_at
    assert tight == ample
    for tokens, finish in tight.values():
        assert finish == "stop"
        check_person(text.decode(tokens))


def test_compiling_a_spec_again_is_a_cache_hit(smollm2_tokenizer_info):
    grammars = Grammars(smollm2_tokenizer_info)
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    assert grammars.compile(spec) is not None
    assert grammars._compiler.get_cache_size_bytes() > 0
    size = grammars._compiler.get_cache_size_bytes()
    grammars.compile(StructuredOutput("json_schema", json.dumps(PERSON)))
    assert grammars._compiler.get_cache_size_bytes() == size


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("json_schema", '{"type": "nope"}', 'Unsupported type "nope"'),
    ("json_schema", "{not json", "Failed to parse JSON"),
    ("regex", "(?<=a)b", "Lookbehind is not supported"),
    ("regex", "(ab", "parenthesis is not closed"),
    ("grammar", 'root ::= "a" |', "EBNF parser error"),
    ("grammar", "root ::= undefined_rule", 'Rule "undefined_rule" is not defined'),
    ("choice", '"red"', "choice must be a non-empty JSON list of strings"),
    ("choice", "[1, 2]", "choice must be a non-empty JSON list of strings"),
    ("choice", "[]", "choice must be a non-empty JSON list of strings"),
    ("choice", "red, green", "choice must be a JSON list of strings"),
])
def test_a_bad_spec_is_a_protocol_error_naming_structured(smollm2_tokenizer_info, kind, spec, message):
    with pytest.raises(ProtocolError) as info:
        Grammars(smollm2_tokenizer_info).compile(StructuredOutput(kind, spec))
    assert info.value.param == "structured"
    assert message in info.value.message and kind in info.value.message
    assert not info.value.message.startswith("[")  # xgrammar's timestamp and source location are cut


# --- plumbing on the tiny model, with a synthetic vocabulary ----------------------------------

def synthetic_tokenizer_info(vocab_size: int, eos: int) -> xgr.TokenizerInfo:
    """A byte-level vocabulary for a model that has none: ids 0-15 special (EOS among them), then
    the 256 single bytes, then every pair of printable ASCII characters; the rest special."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))  # GPT-2's bytes_to_unicode: the character of each byte
    byte_chars = [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]
    printable = [chr(c) for c in range(0x21, 0x7F)]
    tokens = [""] * 16 + byte_chars + [a + b for a in printable for b in printable]
    assert eos < 16 and len(tokens) <= vocab_size
    return xgr.TokenizerInfo(tokens + [""] * (vocab_size - len(tokens)), xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab_size, stop_token_ids=[eos])


def tiny_text(ids: list[int], info: xgr.TokenizerInfo) -> str:
    return b"".join(info.decoded_vocab[i] for i in ids).decode()


@pytest.fixture(scope="module")
def tiny_info(tiny):
    return synthetic_tokenizer_info(tiny[1].vocab_size, tiny[1].eos_token_ids[0])


def tiny_core(tiny, info, **overrides) -> EngineCore:
    model, config = tiny
    settings = {"max_num_batched_tokens": 32, "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 6, **overrides}
    return EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config, info)


WORD = r"[a-z]{3,8}( [0-9]{1,3})?"


def test_the_decode_graph_path_masks_constrained_rows_and_keeps_its_argmax_for_the_others(tiny, tiny_info):
    plain = [GenerateRequest(f"plain{i}", list(range(20 + i, 30 + i)),
                             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(2)]
    constrained = [GenerateRequest(f"word{i}", list(range(40 + i, 47 + i)), structured("regex", WORD, temperature=0.0))
                   for i in range(2)]
    eager = run(tiny_core(tiny, tiny_info), [*plain, *constrained])
    core = tiny_core(tiny, tiny_info)
    runner = core.runner
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.device, runner.block_size,
                                        runner.max_blocks_per_seq, decode_buckets(6), capture=False)
    assert run(core, [*plain, *constrained]) == eager
    for request in constrained:
        tokens, finish = eager[request.request_id, 0]
        assert finish == "stop" and re.fullmatch(WORD, tiny_text(tokens, tiny_info))


class OverridingRunner:
    """Wraps a runner and replaces every token it samples for request ``request_id``."""

    def __init__(self, runner, request_id: str, token_id: int):
        self.runner, self.request_id, self.token_id = runner, request_id, token_id

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, scheduled, previous=None):
        sampled = self.runner.launch(scheduled, previous).resolve()
        return LaunchedStep.on_host([s._replace(token_id=self.token_id) if s.seq.request_id == self.request_id else s
                                     for s in sampled], graphed=False)


def test_a_token_outside_the_grammar_fails_only_its_sequence(tiny, tiny_info):
    core = tiny_core(tiny, tiny_info)
    digit = tiny_info.decoded_vocab.index(b"7")
    core.runner = OverridingRunner(core.runner, "letters", digit)  # a digit where only letters may go
    core.add_request(GenerateRequest("letters", list(range(10, 20)), structured("regex", "[a-z]+", temperature=0.0)))
    core.add_request(GenerateRequest("word", list(range(10, 20)), structured("regex", WORD, temperature=0.0)))
    frames = {}
    while core.has_work():
        frames.update((f.request_id, f) for f in core.step() if f.finish_reason is not None)
    assert core.check_integrity().used == 0
    letters = frames["letters"]
    assert (letters.finish_reason, letters.error) == ("error", f"sampled token {digit} is outside the grammar")
    assert frames["word"].finish_reason == "stop"


def test_abort_and_finish_release_the_matcher(tiny, tiny_info):
    core = tiny_core(tiny, tiny_info)
    core.add_request(GenerateRequest("r", list(range(10, 20)), structured("regex", WORD, n=2)))
    seqs = core.requests["r"]
    assert all(s.matcher is not None for s in seqs) and seqs[0].matcher is not seqs[1].matcher
    core.step()
    core.abort("r")
    assert all(s.matcher is None for s in seqs)


def test_a_model_without_a_vocabulary_refuses_structured_requests(tiny):
    core = tiny_core(tiny, None)
    with pytest.raises(ProtocolError) as info:
        core.add_request(GenerateRequest("r", [10, 11], structured("regex", "a+")))
    assert (info.value.message, info.value.param) == (NO_VOCABULARY, "structured")
    core.add_request(GenerateRequest("plain", [10, 11]))  # unconstrained requests still run


def test_offline_lines_carry_structured_and_a_bad_spec_is_an_error_line(tiny, tiny_info):
    lines = [
        json.dumps({"prompt_ids": [10, 11, 12], "max_tokens": 20, "temperature": 0.0,
                    "structured": {"kind": "regex", "spec": WORD}}),
        json.dumps({"prompt_ids": [10, 11, 12], "structured": {"kind": "regex", "spec": "(?=x)"}}),
        json.dumps({"prompt_ids": [10, 11, 12], "max_tokens": 3}),
    ]
    out = io.StringIO()
    run_offline(tiny_core(tiny, tiny_info), lines, out)
    word, bad, plain = (json.loads(line) for line in out.getvalue().splitlines())
    assert word["finish_reason"] == "stop" and re.fullmatch(WORD, tiny_text(word["token_ids"], tiny_info))
    assert bad["error"]["param"] == "structured" and "Lookahead" in bad["error"]["message"]
    assert len(plain["token_ids"]) == 3


def post(client: TestClient, request: GenerateRequest):
    return client.post("/generate", content=request.pack(), headers={"content-type": MSGPACK})


def _sidecar_core(has_vocabulary: bool) -> EngineCore:
    """The tiny core a sidecar test serves (module-level: an engine process builds it)."""
    tiny = peaky_tiny()
    info = synthetic_tokenizer_info(tiny[1].vocab_size, tiny[1].eos_token_ids[0]) if has_vocabulary else None
    return tiny_core(tiny, info, num_kv_blocks=256)


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "thread"])
@pytest.mark.parametrize("has_vocabulary", [True, False])
def test_the_sidecar_answers_400_before_any_stream_for_a_spec_it_cannot_compile(tiny_info, has_vocabulary,
                                                                                 engine_process):
    app = build_app(EngineConfig(model="tiny"), make_core=functools.partial(_sidecar_core, has_vocabulary),
                    engine_process=engine_process)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while (health := client.get("/health")).status_code != 200:  # the engine thread warms up
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        resp = post(client, GenerateRequest("bad", [10, 11, 12], structured("grammar", "root ::= ")))
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "structured"
        assert ("EBNF parser error" if has_vocabulary else NO_VOCABULARY) in error["message"]
        if has_vocabulary:
            resp = post(client, GenerateRequest("good", [10, 11, 12], structured("regex", WORD, temperature=0.0)))
            assert resp.status_code == 200
            frames = _frames(resp.content)
            tokens = [t for f in frames for t in f.token_ids]
            assert frames[-1].finish_reason == "stop"
            assert re.fullmatch(WORD, tiny_text(tokens, tiny_info))


def _frames(body: bytes) -> list[OutputFrame]:
    unpacker = msgpack.Unpacker(strict_map_key=False)
    unpacker.feed(body)
    return [OutputFrame.from_wire(m) for m in unpacker]


def test_a_mask_admits_exactly_what_the_matcher_does_and_leaves_other_rows_alone(tiny_info):
    grammar = Grammars(tiny_info).compile(StructuredOutput("regex", "[0-9]"))
    logits = torch.zeros(3, tiny_info.vocab_size)
    TokenMasks().apply(logits, [None, new_matcher(grammar, [2]), None])
    admitted = (logits[1] == 0).nonzero().flatten().tolist()
    assert sorted(tiny_info.decoded_vocab[i] for i in admitted) == [str(d).encode() for d in range(10)]
    assert (logits[0] == 0).all() and (logits[2] == 0).all()


@pytest.mark.slow
def test_an_hf_directory_gives_the_vocabulary_its_gguf_gives(gguf_path, smollm2, smollm2_tokenizer_info, tmp_path):
    from transformers import AutoTokenizer

    config = smollm2[1]
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config.to_hf()}))
    hf = load_tokenizer_info(str(tmp_path), "hf", config)
    gguf = smollm2_tokenizer_info
    assert (hf.vocab_type, hf.add_prefix_space, hf.stop_token_ids) == (gguf.vocab_type, gguf.add_prefix_space, [2])
    assert hf.special_token_ids == gguf.special_token_ids  # control tokens: never admitted
    assert hf.decoded_vocab == gguf.decoded_vocab


def test_warmup_runs_a_constrained_request_when_there_is_a_vocabulary(tiny, tiny_info, monkeypatch):
    compiled = []
    core = tiny_core(tiny, tiny_info)
    monkeypatch.setattr(core, "compile_structured", lambda spec: compiled.append(spec) or core.grammars.compile(spec))
    warmup(core)
    assert compiled == [StructuredOutput("json_object")]
    assert not core.has_work() and core.check_integrity().used == 0
