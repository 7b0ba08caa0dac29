from lpcache.cache.speeds import MIN_TOKENS, Rate, Speeds


def test_unknown_speeds_restore() -> None:
    s = Speeds.new()
    assert s.restore_pays(1000, 1)
    s.prefill.add(100.0, 1000)
    assert s.restore_pays(1000, 1)          # the restore side is still unknown


def test_restore_pays_against_the_prefill_it_spares() -> None:
    s = Speeds.new()
    s.prefill.add(1000.0, 1000)             # 1 ms per token (a CPU)
    s.restore.add(10.0, 1000)               # 0.01 ms per token (a disk)
    assert s.restore_pays(1000, 900)
    assert not s.restore_pays(1000, 5)      # a long file for a short shared part: prefill 5 tokens instead
    fast = Speeds.new()
    fast.prefill.add(10.0, 10000)           # 0.001 ms per token (a GPU)
    fast.restore.add(30.0, 1000)            # 0.03 ms per token (a slow disk)
    assert not fast.restore_pays(1000, 1000)


def test_rates_are_weighted_and_ignore_tiny_or_empty_measurements() -> None:
    r = Rate()
    r.add(5.0, MIN_TOKENS - 1)
    r.add(0.0, 1000)
    assert r.ms_per_token is None
    r.add(100.0, 100)
    r.add(300.0, 100)
    assert r.ms_per_token is not None and 1.0 < r.ms_per_token < 3.0


def test_the_generation_rate_is_not_taken_from_answers_that_waited_for_another_slot_s_prefill() -> None:
    """Eight-token answers on a 2-core server: most decode at about 40 ms a token, but those whose steps waited
    for another slot's 400-token prefill show 600 ms and more. The rate a wait is planned on is a decode step's
    cost, not the average of both (which made a session compute its whole prompt on another server rather than
    wait a fraction of a second for its own)."""
    s = Speeds.new()
    for i, ms_per_token in enumerate([40, 38, 650, 42, 2100, 41, 39, 700, 44, 40]):
        s.generate.add(ms_per_token * 8.0, 8)
        if i == 4:
            assert s.generate.ms_per_token is not None and s.generate.ms_per_token < 100
    assert s.generate.ms_per_token is not None and 38 <= s.generate.ms_per_token <= 44
    assert s.restore.quantile is None and s.save.quantile is None, "restore and save keep their EWMA"
    for _ in range(20):   # a server that really got slower: the rate follows within the recent measures
        s.generate.add(300.0 * 8, 8)
    assert s.generate.ms_per_token == 300.0


def test_the_generation_rate_holds_when_most_answers_waited_for_other_slots() -> None:
    """Two replicas, two real servers, a machine three times slower than usual (the scale-out e2e test in CI): 13 of
    the last 16 eight-token answers decoded beside other slots' prefills, at 1.4 s a token and more. A quarter-low
    quantile took that for a decode step, so a busy home slot looked 11 s from free, and two sessions computed their
    whole prompts (425 tokens each) on the other server rather than wait for their own files there."""
    s = Speeds.new()
    for i in range(16):
        s.generate.add((95.0 if i % 6 == 0 else 1_400.0 + 50 * i) * 8, 8)
    assert s.generate.ms_per_token == 95.0


def test_a_slot_call_s_wait_is_learnt_apart_from_its_work_and_counted_by_the_restore_decision() -> None:
    s = Speeds.new()
    s.prefill.add(1000.0, 1000)              # 1 ms a token
    s.restore.add(10.0, 1000)                # 0.01 ms a token
    assert s.restore_pays(1000, 100)         # 10 ms for 100 ms of prefill
    s.learn_wait(call_ms=310.0, work_ms=10.0)
    assert s.wait_ms == 300.0
    assert not s.restore_pays(1000, 100)     # ... but the call also waits 300 ms for the server's batch
    assert s.restore_pays(1000, 400)
    s.learn_wait(call_ms=5.0, work_ms=5.0)   # the server said nothing of its own time: the call's time is all work
    assert s.wait_ms is not None and s.wait_ms < 300.0
    before = s.wait_ms
    s.learn_wait(call_ms=0.0, work_ms=3.0)   # nonsense (clocks): nothing learnt
    assert s.wait_ms == before


def test_one_slot_call_that_waited_behind_a_long_prompt_does_not_make_the_next_restores_look_slow() -> None:
    """Two replicas in front of two real servers on a loaded 2-core machine (tests/e2e/test_scale_out_real.py):
    prefill 12-20 ms a token, /slots calls waiting 30-90 ms; a call that comes during another slot's 1,300-token
    prompt waits for all of it, about 18 s. Averaged in, that one call counted 5.4 s against the next restore, more
    than the 5.1 s prefill of the 423 tokens a session's 489-token file spares: the restore would be skipped."""
    s = Speeds.new()
    s.prefill.add(12.0 * 500, 500)
    s.restore.add(5.0, 500)
    for wait in (40.0, 90.0, 30.0, 60.0, 18_000.0):
        s.learn_wait(call_ms=wait + 5.0, work_ms=5.0)
    assert s.wait_ms == 55.0
    assert s.restore_pays(489, 423)


def test_a_server_whose_calls_often_wait_long_counts_those_waits() -> None:
    """A third of the calls behind another slot's long prompt: the restore pays its expected wait, and a prefill of
    423 tokens (5.1 s) is the quicker way; once every call waits that long, the wait is that long."""
    s = Speeds.new()
    s.prefill.add(12.0 * 500, 500)
    s.restore.add(5.0, 500)
    for i in range(16):
        s.learn_wait(call_ms=(18_000.0 if i % 3 == 0 else 60.0) + 5.0, work_ms=5.0)
    assert s.wait_ms is not None and 5_000.0 < s.wait_ms < 6_500.0
    assert not s.restore_pays(489, 423)
    for _ in range(16):
        s.learn_wait(call_ms=18_005.0, work_ms=5.0)
    assert s.wait_ms == 18_000.0


def test_the_first_slot_call_s_wait_is_taken_as_it_is_then_the_longest_is_left_out() -> None:
    s = Speeds.new()
    assert s.wait_ms is None
    s.learn_wait(call_ms=18_005.0, work_ms=5.0)
    assert s.wait_ms == 18_000.0          # nothing to weigh it against
    s.learn_wait(call_ms=65.0, work_ms=5.0)
    assert s.wait_ms == 60.0


def test_the_prefill_rate_is_not_taken_from_prompts_batched_beside_another_slot_s_prefill() -> None:
    """Real llama-server b11434, -np 2, SmolLM2-135M on 2 cores (a ShareGPT run through lpcache): prompts prefill at
    about 4.3 ms a token, but one batched with another slot's 1,288-token prompt reported 66 tokens in 6,013 ms. The
    average made that 30 ms a token for the next decisions; the rate stays the server's."""
    s = Speeds.new()
    measures = [(430.0, 100), (1290.0, 300), (6013.0, 66), (215.0, 50), (860.0, 200), (3000.0, 40), (650.0, 150)]
    for i, (ms, tokens) in enumerate(measures):
        s.prefill.add(ms, tokens)
        if i >= 2:
            assert s.prefill.ms_per_token is not None and s.prefill.ms_per_token <= 4.3 * 1.5, (i, s.prefill)
    assert s.prefill.ms_per_token == 4.3
    for _ in range(20):   # a server that really got slower (a bigger model, a busy machine): followed
        s.prefill.add(2000.0, 100)
    assert s.prefill.ms_per_token == 20.0
