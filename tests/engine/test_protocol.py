"""OutputFrame.merge: one frame per sequence that means what the frames it joins meant."""

from engine.protocol import OutputFrame, PromptLogprob, TokenLogprob


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
