"""Scheduler: token budget, chunked prefill mixed with decodes, FCFS, preemption by recompute."""

from engine.kv_cache import KVCacheManager
from engine.protocol import SamplingParams
from engine.request import Sequence, Status
from engine.scheduler import SampledToken, Scheduler

BS = 4


def make_seq(rid, n_prompt):
    base = ord(rid) * 100  # distinct prompts: no accidental prefix sharing between sequences
    return Sequence(rid, 0, list(range(base, base + n_prompt)), SamplingParams(), None, [], None)


def advance(sched: Scheduler, out, sample_token=7):
    """Record a step whose model samples ``sample_token`` for every sequence it fully computed."""
    sampled = [SampledToken(seq, sample_token, None) for seq, n in out.scheduled
               if seq.num_computed_tokens + n == seq.num_tokens]
    return sched.update(out.scheduled, sampled)


def plan(out):
    return [(s.request_id, n) for s, n in out.scheduled]


def test_chunked_prefill_mixes_with_decodes_under_the_budget():
    sched = Scheduler(KVCacheManager(64, BS), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq("a", 6), make_seq("b", 23)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 6), ("b", 4)]
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 9)]  # a decodes, b's prefill continues in the same step
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 9)]
    advance(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # b's last prompt token
    assert b.output_ids == []
    advance(sched, out)
    assert b.output_ids == [7] and len(a.output_ids) == 4


def test_max_num_seqs_limits_admission_fcfs():
    sched = Scheduler(KVCacheManager(64, BS), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(r, 3) for r in "abc"]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("a", 3), ("b", 3)]
    assert seqs[2].status is Status.WAITING
    advance(sched, out)
    sched.finish(seqs[0], "stop")
    assert plan(sched.schedule()) == [("b", 1), ("c", 3)]


def test_prefill_pack_tokens_keeps_long_prompts_out_of_one_step():
    """Admission stops once the step holds prefill_pack_tokens prompt tokens, counting a running
    prefill's chunk; decodes do not count, and short prompts still pack."""
    packed = Scheduler(KVCacheManager(256, BS), max_num_seqs=16, max_num_batched_tokens=100, prefill_pack_tokens=20)
    unpacked = Scheduler(KVCacheManager(256, BS), max_num_seqs=16, max_num_batched_tokens=100)
    for sched in (packed, unpacked):
        for rid, n in (("a", 30), ("b", 30), ("c", 6), ("d", 6)):
            sched.add(make_seq(rid, n))
    assert plan(unpacked.schedule()) == [("a", 30), ("b", 30), ("c", 6), ("d", 6)]
    out = packed.schedule()
    assert plan(out) == [("a", 30)]  # b waits: its first token need not wait for a's prefill too
    advance(packed, out)
    out = packed.schedule()
    assert plan(out) == [("a", 1), ("b", 30)]  # a's decode leaves the pack limit to b
    advance(packed, out)
    assert plan(packed.schedule()) == [("a", 1), ("b", 1), ("c", 6), ("d", 6)]  # short prompts pack

    chunked = Scheduler(KVCacheManager(256, BS), max_num_seqs=16, max_num_batched_tokens=16, prefill_pack_tokens=8)
    chunked.add(make_seq("e", 38))
    chunked.add(make_seq("f", 6))
    out = chunked.schedule()
    assert plan(out) == [("e", 16)]
    advance(chunked, out)
    out = chunked.schedule()
    assert plan(out) == [("e", 16)]  # e's running chunk already fills the pack limit
    advance(chunked, out)
    assert plan(chunked.schedule()) == [("e", 6), ("f", 6)]  # e's last chunk is under the limit: f joins


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens; two sequences of 7 prompt tokens need 2 blocks each, then grow.
    kv = KVCacheManager(4, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make_seq("a", 7), make_seq("b", 7)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 7), ("b", 7)]
    advance(sched, out)  # both hold 8 tokens now, in 2 blocks each: pool full
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # position 7 fits both last blocks
    advance(sched, out)
    out = sched.schedule()  # a needs a 3rd block: b (the latest) is preempted
    assert plan(out) == [("a", 1)]
    assert sched.num_preemptions == 1 and b.status is Status.WAITING and b.block_ids == []
    assert b.output_ids == [7, 7]  # kept; recomputed with the prompt on resumption
    kv.check_integrity([a, b])
    advance(sched, out)
    sched.finish(a, "stop")
    out = sched.schedule()
    # b resumes: prompt and both outputs, minus the prefix still cached (its first full block)
    assert plan(out) == [("b", 9 - 4)]
    assert b.num_computed_tokens == 4


def test_oldest_sequence_always_progresses():
    kv = KVCacheManager(3, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [make_seq(r, 5) for r in "abc"]
    for s in seqs:
        sched.add(s)
    finished = []
    for _ in range(200):
        out = sched.schedule()
        advance(sched, out)
        for seq in list(sched.running):
            if len(seq.output_ids) >= 6:
                sched.finish(seq, "length")
                finished.append(seq.request_id)
        kv.check_integrity(sched.running)
        if not sched.has_work():
            break
    assert finished == ["a", "b", "c"]
    assert kv.check_integrity([]).used == 0


def test_admission_resumes_after_an_exact_position_entry():
    kv = KVCacheManager(64, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = Sequence("a", 0, list(range(100, 110)), SamplingParams(), None, [6], None)
    sched.add(a)
    advance(sched, sched.schedule())
    sched.finish(a, "stop")
    # shares a's first 6 tokens: a full block, then 2 tokens of the entry at a's boundary
    b = Sequence("b", 0, list(range(100, 106)) + [7, 8, 9], SamplingParams(), None, [], None)
    sched.add(b)
    assert plan(sched.schedule()) == [("b", 3)]
    assert b.num_computed_tokens == b.num_cached_tokens == 6
    kv.check_integrity([b])


def test_update_applies_the_finish_rules_and_frees_the_finished():
    kv = KVCacheManager(64, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, eos_token_ids=[2], max_model_len=12)
    eos = make_seq("a", 3)
    early_eos = Sequence("b", 0, list(range(300, 303)), SamplingParams(min_tokens=2), None, [], None)
    stop = Sequence("c", 0, list(range(400, 403)), SamplingParams(stop_token_ids=[9]), None, [], None)
    ignore = Sequence("d", 0, list(range(500, 503)), SamplingParams(ignore_eos=True, max_tokens=2), None, [], None)
    window = make_seq("e", 11)  # the 12th token reaches max_model_len
    seqs = [eos, early_eos, stop, ignore, window]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    tokens = {"a": 2, "b": 2, "c": 9, "d": 2, "e": 5}
    got = sched.update(out.scheduled, [SampledToken(s, tokens[s.request_id], None) for s, _ in out.scheduled])
    assert got == seqs
    assert [s.finish_reason for s in seqs] == ["stop", None, "stop", None, "length"]
    assert [s.status for s in seqs] == [Status.FINISHED, Status.RUNNING, Status.FINISHED, Status.RUNNING,
                                        Status.FINISHED]
    assert sched.running == [early_eos, ignore] and kv.check_integrity(sched.running).used == 2
    out = sched.schedule()
    sched.update(out.scheduled, [SampledToken(s, 2, None) for s, _ in out.scheduled])
    assert early_eos.finish_reason == "stop"  # eos counts once min_tokens are out
    assert ignore.finish_reason == "length" and ignore.output_ids == [2, 2]  # eos ignored: max_tokens
    assert not sched.has_work() and kv.check_integrity([]).used == 0


def test_held_siblings_start_once_the_first_sequence_has_prefilled():
    kv = KVCacheManager(64, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    params = SamplingParams(n=3)
    seqs = [Sequence("r", i, list(range(100, 109)), params, None, [], None) for i in range(3)]
    sched.add_request(seqs)
    assert sched.num_waiting == 3 and list(sched.waiting) == [seqs[0]]
    advance(sched, sched.schedule())  # 6 of 9 prompt tokens: still held
    assert sched.num_waiting == 2 and not sched.waiting
    advance(sched, sched.schedule())
    assert list(sched.waiting) == seqs[1:] and not sched.held
    out = sched.schedule()
    # the siblings resume after the two full blocks the first one cached
    assert plan(out) == [("r", 1), ("r", 1), ("r", 1)] and [s.num_cached_tokens for s in seqs[1:]] == [8, 8]


def test_finish_takes_a_held_sibling_out_without_touching_the_queues():
    kv = KVCacheManager(64, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [Sequence("r", i, list(range(100, 105)), SamplingParams(n=3), None, [], None) for i in range(3)]
    sched.add_request(seqs)
    sched.finish(seqs[2], "abort")
    assert sched.held == {"r": [seqs[1]]} and seqs[2].finish_reason == "abort"
    for seq in seqs[:2]:
        sched.finish(seq, "abort")
    assert not sched.held and not sched.has_work() and sched.num_waiting == 0
    assert kv.check_integrity([]).used == 0
