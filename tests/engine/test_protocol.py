"""OutputFrame.merge: one frame per sequence that means what the frames it joins meant; the KV capacity check."""

import pytest

from engine.protocol import (
    ModelLimits,
    OutputFrame,
    PromptLogprob,
    ProtocolError,
    TokenLogprob,
    parse_generate_request,
)


def test_merge_joins_each_sequences_frames_in_order():
    lp = [TokenLogprob(-0.5, [(7, -0.5)]), TokenLogprob(-1.0, [(8, -1.0)]), TokenLogprob(-2.0, [(9, -2.0)])]
    prompt = [PromptLogprob(-3.0, 2, [(1, -0.1)])]
    first = OutputFrame("r", 0, [7], logprobs=lp[:1], prompt_logprobs=prompt, num_prompt_tokens=5,
                        num_cached_tokens=0)
    frames = [
        first,
        OutputFrame("r", 1, [4], num_prompt_tokens=5),
        OutputFrame("r", 0, [8], logprobs=lp[1:2], num_prompt_tokens=5, num_cached_tokens=3),
        OutputFrame("r", 0, [9], logprobs=lp[2:], finish_reason="length", num_prompt_tokens=5, num_cached_tokens=3),
    ]
    merged = OutputFrame.merge(frames)
    assert merged == [
        OutputFrame("r", 0, [7, 8, 9], logprobs=lp, prompt_logprobs=prompt, finish_reason="length",
                    num_prompt_tokens=5, num_cached_tokens=3),
        OutputFrame("r", 1, [4], num_prompt_tokens=5),
    ]
    assert first.token_ids == [7] and first.logprobs == lp[:1]  # the frames given are left as they were


def test_merge_keeps_an_error_and_a_lone_frame_as_they_are():
    frames = [OutputFrame("r", 0, [1]), OutputFrame("r", 0, [], finish_reason="error", error="engine failed: x")]
    assert OutputFrame.merge(frames) == [OutputFrame("r", 0, [1], finish_reason="error", error="engine failed: x")]
    assert OutputFrame.merge(frames[:1]) == frames[:1]


@pytest.mark.parametrize("max_kv_tokens", [None, 500])
def test_a_request_longer_than_the_kv_pool_holds_is_refused_naming_the_capacity(max_kv_tokens):
    limits = ModelLimits(vocab_size=100, max_model_len=1000, max_kv_tokens=max_kv_tokens)
    wire = {"request_id": "a", "prompt_ids": [5] * 400, "sampling": {"max_tokens": 100}}
    assert parse_generate_request(wire, limits).sampling.max_tokens == 100
    wire["sampling"]["max_tokens"] = 101
    if max_kv_tokens is None:  # a gateway's limits: the context alone bounds it
        parse_generate_request(wire, limits)
        return
    with pytest.raises(ProtocolError, match=r"\(501 tokens\) needs more KV cache than this engine has \(500 tokens\)"):
        parse_generate_request(wire, limits)
