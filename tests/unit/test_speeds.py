from lpcache.speeds import MIN_TOKENS, Rate, Speeds


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
