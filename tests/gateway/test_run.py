"""Engine frames → deltas (gateway/run.py) with synthetic frames and the real tokenizer: stop strings,
n>1 and batched prompts, logprobs, finish reasons and engine errors."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams, TokenLogprob
from gateway.detokenizer import SequenceText
from gateway.engine_client import EngineFailed
from gateway.run import Choice, Delta, Job, Run

PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
STORY = "The answer is forty-two. THE END of the story, and more text after it."
STOP = "THE END"


class FakeStream:
    """Stands in for a RoutedStream: plays its frames, counts how many were read, notes its close."""

    replica = SimpleNamespace(url="http://engine-1")

    def __init__(self, frames: list[OutputFrame]):
        self._frames = frames
        self.read = 0
        self.closed = False

    async def frames(self):
        for frame in self._frames:
            self.read += 1
            yield frame
            await asyncio.sleep(0)  # let the other jobs' streams take turns
            if self.closed:
                raise ConnectionError("read from a closed stream")  # as an aborted HTTP stream fails

    async def aclose(self) -> None:
        self.closed = True


def make_run(tokenizer, per_job: list[list[OutputFrame]], n: int = 1, stops: tuple[str, ...] = (),
             include_stop: bool = False, logprobs: bool = False) -> Run:
    """A run laid out as Serving._build_run lays it out: choice index = prompt * n + sequence."""
    jobs, choices = [], []
    for p, frames in enumerate(per_job):
        job_choices = [Choice(p * n + i, SequenceText(tokenizer, PROMPT, stops, include_stop)) for i in range(n)]
        sampling = SamplingParams(n=n, logprobs=0 if logprobs else None)
        jobs.append(Job(GenerateRequest(f"cmpl-test-{p}", PROMPT, sampling), job_choices, open=n, running=n,
                        stream=FakeStream(frames)))
        choices += job_choices
    return Run(jobs, choices, logprobs)


def one_token_frames(ids: list[int], index: int = 0, finish: str | None = "length") -> list[OutputFrame]:
    frames = [OutputFrame("r", index, [t]) for t in ids]
    frames[-1].finish_reason = finish
    return frames


def fake_logprobs(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(-0.5 - k, [(t, -0.25)]) for k, t in enumerate(ids)]


async def drain(run: Run) -> list[Delta]:
    return [d async for d in run.deltas()]


def tokens_through_stop(tokenizer, ids: list[int], stop: str) -> int:
    """How many tokens it takes until the decoded text contains ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], True))


async def test_length_finish_delivers_the_whole_text(tokenizer):
    text = "Hello, world! Ünïcödé and 😀 emoji."
    ids = tokenizer.encode(text, add_special_tokens=False)
    frames = one_token_frames(ids)
    frames[0].num_cached_tokens = 3
    run = make_run(tokenizer, [frames])
    deltas = await drain(run)
    assert "".join(d.text for d in deltas) == text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert sum(len(d.token_ids) for d in deltas) == len(ids) and all(d.logprobs is None for d in deltas)
    assert run.choices[0].finish_reason == "length" and run.first_token_at is not None
    assert run.usage() == {"prompt_tokens": len(PROMPT), "completion_tokens": len(ids),
                           "total_tokens": len(PROMPT) + len(ids), "prompt_tokens_details": {"cached_tokens": 3}}
    stream = run.jobs[0].stream
    assert stream.read == len(frames) and not stream.closed  # ended by the engine: nothing to abort


async def test_stop_string_split_across_frames(tokenizer):
    ids = tokenizer.encode(STORY, add_special_tokens=False)
    k = tokens_through_stop(tokenizer, ids, STOP)
    assert STOP not in tokenizer.decode(ids[k - 1:k], True)  # the stop string really spans frames
    run = make_run(tokenizer, [one_token_frames(ids)], stops=(STOP,))
    deltas = await drain(run)
    assert "".join(d.text for d in deltas) == "The answer is forty-two. "
    assert not any("THE" in d.text for d in deltas)  # no part of the stop string went out
    assert deltas[-1].finish_reason == "stop" and run.choices[0].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in deltas) == k == run.usage()["completion_tokens"]
    stream = run.jobs[0].stream
    assert stream.closed and stream.read == k  # aborted at the stop; no later frame was read


@pytest.mark.parametrize("include, expected", [(False, "The answer is forty-two. "),
                                               (True, "The answer is forty-two. THE END")])
async def test_stop_string_in_the_middle_of_a_frame(tokenizer, include, expected):
    ids = tokenizer.encode(STORY, add_special_tokens=False)
    k = tokens_through_stop(tokenizer, ids, STOP)
    frames = [OutputFrame("r", 0, ids), OutputFrame("r", 0, [ids[0]], finish_reason="length")]
    run = make_run(tokenizer, [frames], stops=(STOP,), include_stop=include)
    (delta,) = await drain(run)
    assert delta.text == expected and run.choices[0].seq.text == expected
    assert delta.finish_reason == "stop"
    assert delta.token_ids == ids[:k] and len(delta.offsets) == k  # the tokens after the stop are dropped
    stream = run.jobs[0].stream
    assert stream.closed and stream.read == 1


async def test_logprobs_follow_the_consumed_tokens(tokenizer):
    ids = tokenizer.encode(STORY, add_special_tokens=False)
    k = tokens_through_stop(tokenizer, ids, STOP)
    lps = fake_logprobs(ids)
    frames = [OutputFrame("r", 0, ids[:3], lps[:3]), OutputFrame("r", 0, ids[3:], lps[3:], "length")]
    run = make_run(tokenizer, [frames], stops=(STOP,), logprobs=True)
    deltas = await drain(run)
    assert [d.logprobs for d in deltas] == [lps[:3], lps[3:k]]
    assert [d.token_ids for d in deltas] == [ids[:3], ids[3:k]]
    offsets = [o for d in deltas for o in d.offsets]
    assert offsets == [len(tokenizer.decode(ids[:j], True)) for j in range(k)]  # where each token's text starts


async def test_collect_accumulates_text_and_logprobs(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    lps = fake_logprobs(ids)
    frames = [OutputFrame("r", 0, ids[:2], lps[:2]), OutputFrame("r", 0, ids[2:], lps[2:], "length")]
    run = make_run(tokenizer, [frames], logprobs=True)
    await run.collect()
    (choice,) = run.choices
    assert choice.seq.text == "one two three four" and choice.finish_reason == "length"
    assert choice.token_ids == ids and choice.lp_values == lps
    assert choice.lp_offsets == [len(tokenizer.decode(ids[:j], True)) for j in range(len(ids))]


async def test_without_logprobs_asked_none_are_passed_on(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    run = make_run(tokenizer, [[OutputFrame("r", 0, ids, fake_logprobs(ids), "length")]])
    (delta,) = await drain(run)
    assert delta.logprobs is None and delta.text == "one two"


async def test_missing_logprobs_are_an_engine_failure(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    run = make_run(tokenizer, [[OutputFrame("r", 0, ids, None, "length")]], logprobs=True)
    with pytest.raises(EngineFailed, match="engine sent no logprobs although they were asked for"):
        await drain(run)


async def test_n_choices_interleaved_in_one_stream(tokenizer):
    texts = ["alpha beta gamma delta", "one two three"]
    seqs = [one_token_frames(tokenizer.encode(t, add_special_tokens=False), index=i) for i, t in enumerate(texts)]
    frames = [f for pair in zip(*seqs) for f in pair] + seqs[0][len(seqs[1]):]  # 0, 1, 0, 1, ..., 0, 0
    run = make_run(tokenizer, [frames], n=2)
    deltas = await drain(run)
    assert [d.index for d in deltas[:4]] == [0, 1, 0, 1]
    assert ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)] == texts
    assert [c.finish_reason for c in run.choices] == ["length", "length"]
    assert not run.jobs[0].stream.closed


async def test_a_choice_that_stops_ignores_its_later_frames_and_the_job_aborts_when_all_are_done(tokenizer):
    ids0 = tokenizer.encode("red green STOP blue violet", add_special_tokens=False)
    ids1 = tokenizer.encode("one two three", add_special_tokens=False)
    seq1 = one_token_frames(ids1, index=1)
    frames = [OutputFrame("r", 0, ids0[:-1]), seq1[0], OutputFrame("r", 0, ids0[-1:]), *seq1[1:],  # ignored
              OutputFrame("r", 0, [], finish_reason="length")]  # never read: the job is done before it
    run = make_run(tokenizer, [frames], n=2, stops=("STOP",))
    deltas = await drain(run)
    assert ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)] == ["red green ", "one two three"]
    assert [c.finish_reason for c in run.choices] == ["stop", "length"]
    stream = run.jobs[0].stream
    assert stream.closed and stream.read == len(frames) - 1  # sequence 0 still ran on the engine: aborted


async def test_prompts_of_a_batch_merge_with_n_choices_each(tokenizer):
    texts = ["a b c d", "e f g", "h i j k l", "m n"]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    per_job = [one_token_frames(encoded[0], 0) + one_token_frames(encoded[1], 1),
               one_token_frames(encoded[2], 0, finish="stop") + one_token_frames(encoded[3], 1)]
    run = make_run(tokenizer, per_job, n=2)
    deltas = await drain(run)
    assert {d.index for d in deltas[:3]} >= {0, 2}  # both streams are read as their frames come
    assert ["".join(d.text for d in deltas if d.index == i) for i in range(4)] == texts
    assert [c.finish_reason for c in run.choices] == ["length", "length", "stop", "length"]
    assert run.usage()["completion_tokens"] == sum(map(len, encoded))


async def test_a_prompt_of_a_batch_that_stops_is_aborted_while_the_others_go_on(tokenizer):
    ids0 = tokenizer.encode("red green STOP blue violet", add_special_tokens=False)
    ids1 = tokenizer.encode("one two three four five", add_special_tokens=False)
    run = make_run(tokenizer, [one_token_frames(ids0), one_token_frames(ids1)], stops=("STOP",))
    deltas = await drain(run)
    texts = ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)]
    assert texts == ["red green ", "one two three four five"]
    assert [c.finish_reason for c in run.choices] == ["stop", "length"]
    assert run.jobs[0].stream.closed and run.jobs[0].stream.read < len(ids0)
    assert not run.jobs[1].stream.closed


@pytest.mark.parametrize("error, message", [("CUDA out of memory", "CUDA out of memory"), (None, "error")])
async def test_an_error_frame_fails_the_run_after_the_text_before_it(tokenizer, error, message):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    frames = [OutputFrame("r", 0, ids), OutputFrame("r", 0, [], finish_reason="error", error=error)]
    run = make_run(tokenizer, [frames])
    received = []
    with pytest.raises(EngineFailed, match=f"^engine http://engine-1 ended the request: {message}$"):
        async for d in run.deltas():
            received.append(d.text)
    assert received == ["one two"] and run.choices[0].finish_reason is None


async def test_a_stream_that_ends_early_is_an_engine_failure(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    run = make_run(tokenizer, [[OutputFrame("r", 0, ids)]])
    with pytest.raises(EngineFailed, match="an engine stream ended before all its sequences finished"):
        await drain(run)


async def test_a_frame_for_an_unknown_sequence_is_an_engine_failure(tokenizer):
    run = make_run(tokenizer, [[OutputFrame("r", 2, [42], finish_reason="length")]], n=2)
    with pytest.raises(EngineFailed, match="engine sent a frame for sequence 2 of 2"):
        await drain(run)
