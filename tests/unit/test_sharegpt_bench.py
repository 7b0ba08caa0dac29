"""The pure parts of bench/sharegpt.py, bench/aiperf_records.py and bench/sharegpt_scenario.py: the reader of a
JSON list cut short, the choice of conversations, the ideal, the reading of aiperf's raw records, the listing of
errors. No server."""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from ..conftest import load_bench

sg = load_bench("sharegpt")
sc = load_bench("sharegpt_scenario")
ar = load_bench("aiperf_records")


def item(cid: str, *turns: str, first: str = "human") -> dict[str, Any]:
    """A ShareGPT item alternating `first` and the other role, one message per text."""
    roles = ("human", "gpt") if first == "human" else ("gpt", "human")
    return {"id": cid, "conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


ITEMS = [
    item("a_0", "Hello", "Hi!", "How are you?", "Fine."),
    item("b_0", "Zoë says 日本語 🎉 \"quoted\" \\ back\nslash", "ok"),
    item("c_1", "continued", "x", first="gpt"),
    item("d_0", "```py\nprint('x')\n```", "code", "**bold** _md_", "y", "MiXeD CaSe", "z"),
    item("e_0", "last one", "answer"),
]


def dumped(items: list[dict[str, Any]]) -> bytes:
    return json.dumps(items, indent=2, ensure_ascii=False).encode()


# ------------------------------------------------------------------------------------------------ the reader


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_a_whole_file_gives_every_item(chunk: int) -> None:
    stats = sg.ReadStats()
    got = list(sg.read_conversations(io.BytesIO(dumped(ITEMS)), stats, chunk=chunk))
    assert got == ITEMS
    assert (stats.items, stats.truncated) == (5, False)


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_a_file_cut_inside_an_item_keeps_the_whole_ones(chunk: int) -> None:
    data = dumped(ITEMS)
    cut = data.index(b'"d_0"') + 40          # inside the fourth item's first message
    stats = sg.ReadStats()
    got = list(sg.read_conversations(io.BytesIO(data[:cut]), stats, chunk=chunk))
    assert got == ITEMS[:3]
    assert stats.truncated and stats.items == 3 and stats.tail_chars > 0 and stats.error


def test_a_cut_inside_a_multibyte_character_and_after_a_comma() -> None:
    data = dumped(ITEMS)
    inside = data.index("日本".encode()) + 1   # the middle of a 3-byte character of the second item
    assert list(sg.read_conversations(io.BytesIO(data[:inside]), chunk=3)) == ITEMS[:1]
    after_comma = data.index(b"\n  },", data.index(b'"b_0"')) + len(b"\n  },")   # the second item's end
    stats = sg.ReadStats()
    assert list(sg.read_conversations(io.BytesIO(data[:after_comma]), stats)) == ITEMS[:2]
    assert stats.truncated


def test_not_a_list_is_refused() -> None:
    with pytest.raises(ValueError):
        list(sg.read_conversations(io.BytesIO(b'{"id": 1}')))


# ------------------------------------------------------------------------------------------------ the choice


def many(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        for _ in range(rnd.randint(1, 6)):
            turns += [" ".join(rnd.choice(["word", "Ünïcode", "`code`", "# md"]) for _ in range(rnd.randint(1, 120))),
                      "answer"]
        out.append(item(f"id{i}", *turns, first=rnd.choice(["human", "human", "human", "gpt"])))
    out.append(item("blank", "   ", "a", "second", "b"))            # a human turn of whitespace only
    out.append({"id": "sys", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}]})
    return out


def test_the_choice_is_deterministic_and_holds_its_limits() -> None:
    items = many(300)
    first = sg.select(items, 20, seed=1, budget=1500, answer_tokens=32)
    again = sg.select(items, 20, seed=1, budget=1500, answer_tokens=32)
    other = sg.select(items, 20, seed=2, budget=1500, answer_tokens=32)
    assert [c.id for c in first] == [c.id for c in again]
    assert [c.id for c in first] != [c.id for c in other]
    assert len(first) == 20 and len({c.id for c in first}) == 20
    by_id = {i["id"]: i for i in items}
    for c in first:
        source = by_id[c.id]["conversations"]
        assert source[0]["from"] == "human"
        assert 2 <= len(c.turns) <= 4
        assert all(t.strip() for t in c.turns)
        assert c.turns == [m["value"] for m in source[::2]]          # texts exactly as written
        assert c.tokens == sg.byte_bound(c.turns, 32) <= 1500
    assert "blank" not in {c.id for c in sg.select(items, 1000, seed=1, budget=10**9)}
    assert "sys" not in {c.id for c in sg.select(items, 1000, seed=1, budget=10**9)}


def test_a_real_count_keeps_the_byte_bound_choices_and_lets_long_ones_in() -> None:
    items = many(300)
    asked: list[int] = []

    def count(turns: Any) -> int:
        asked.append(len(turns))
        return sg.byte_bound(turns, 32) // 4        # as if the tokenizer packed four bytes a token

    bound = sg.select(items, 1000, seed=3, budget=1000, answer_tokens=32)
    counted = sg.select(items, 1000, seed=3, budget=1000, answer_tokens=32, count=count)
    assert {c.id for c in bound} < {c.id for c in counted}       # the same ones, and long ones besides
    assert all(c.tokens == sg.byte_bound(c.turns, 32) // 4 <= 1000 for c in counted)
    assert all(2 <= n <= 4 for n in asked)                         # asked only about eligible conversations
    first = sg.select(items, 5, seed=3, budget=1000, answer_tokens=32, count=count)
    assert [c.id for c in first] == [c.id for c in counted[:5]]   # the same order, cut at n


def test_aiperf_lines_hold_the_human_turns_the_cap_and_the_think_time() -> None:
    chosen = [sg.Conversation("x_0", ["Zoë?", "second"]), sg.Conversation("y_0", ["only", "two"])]
    lines = [json.loads(line) for line in sg.aiperf_lines(chosen, 32, think_ms=250)]
    assert lines[0] == {"session_id": "x_0", "turns": [{"text": "Zoë?", "output_length": 32},
                                                         {"text": "second", "output_length": 32, "delay": 250}]}
    assert "delay" not in json.dumps(sg.aiperf_lines(chosen, 32))


# ------------------------------------------------------------------------------------------------ the ideal


def test_the_ideal_on_hand_made_tokens() -> None:
    prompts = [[1, 2, 3, 4],              # new: 4
               [1, 2, 3, 4, 5, 6, 7, 8],  # the first, its answer [5, 6], then 2 new
               [1, 2, 9],                 # shares [1, 2]: 1
               [1, 2, 3, 4, 5, 9],        # shares the first prompt and its answer's first token: 1
               [1, 2, 3, 4],              # the first prompt again: 0
               [7, 7]]                    # nothing shared: 2
    answers = [[5, 6], [10], [], [], [], []]
    assert ar.ideal_counts(prompts, answers) == [4, 2, 1, 1, 0, 2]


def test_a_request_never_shares_with_its_own_answer() -> None:
    assert ar.ideal_counts([[1, 2], [3]], [[3, 4], []]) == [2, 1]


def brute(prompts: list[list[int]], answers: list[list[int]]) -> list[int]:
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for j in range(i):
            seen = prompts[j] + answers[j]
            n = 0
            while n < min(len(p), len(seen)) and p[n] == seen[n]:
                n += 1
            best = max(best, n)
        out.append(len(p) - best)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_ideal_matches_a_pass_over_every_earlier_request(seed: int) -> None:
    rnd = random.Random(seed)
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    for _ in range(40):
        if prompts and rnd.random() < 0.7:   # a later turn of an earlier request, or a cut of one
            j = rnd.randrange(len(prompts))
            base = prompts[j] + answers[j]
            base = base[:rnd.randint(0, len(base))]
        else:
            base = []
        prompts.append(base + [rnd.randint(0, 3) for _ in range(rnd.randint(0, 5))])
        answers.append([rnd.randint(0, 3) for _ in range(rnd.randint(0, 3))])
    assert ar.ideal_counts(prompts, answers) == brute(prompts, answers)


# ------------------------------------------------------------------------------------------------ aiperf's records


def sse(*values: str, name: str = "data") -> dict[str, Any]:
    return {"perf_ns": 1, "packets": [{"name": name, "value": v} for v in values]}


def record(conversation: str, turn: int, start: int, end: int, messages: list[dict[str, Any]],
           responses: list[dict[str, Any]], error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"conversation_id": conversation, "turn_index": turn, "request_start_ns": start,
                         "request_end_ns": end}, "payload": {"messages": messages}, "status": 200,
            "responses": responses, **({"error": error} if error else {})}


def chunk(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


def test_a_record_gives_its_answer_and_lists_what_is_not_json() -> None:
    final = json.dumps({"choices": [], "usage": {"prompt_tokens": 12},
                        "timings": {"prompt_n": 3, "cache_n": 9}})
    r = ar.parse_record(record("c", 1, 5, 9, [{"role": "user", "content": "q"}],
                               [sse(json.dumps({"choices": [{"delta": {"role": "assistant", "content": None}}]})),
                                sse(chunk("Hel")), sse("not json {"), sse(chunk("lo")),
                                sse(json.dumps({"error": {"message": "boom"}})), sse("keep-alive", name="comment"),
                                sse(final), sse("[DONE]")]))
    assert (r.conversation, r.turn, r.answer) == ("c", 1, "Hello")
    assert r.not_json == ["not json {"]
    assert r.error_events == ['{"message": "boom"}']
    assert r.other_fields == ["comment: keep-alive"]
    assert (r.usage_prompt, r.prompt_n, r.cache_n) == (12, 3, 9)
    failed = ar.parse_record(record("c", 0, 1, 2, [], [], error={"type": "ClientError", "code": 500,
                                                                 "message": "Server disconnected"}))
    assert failed.error == "ClientError 500: Server disconnected" and failed.answer == ""


def test_answers_fed_back_and_requests_in_flight(tmp_path: Path) -> None:
    q1, q2 = {"role": "user", "content": "first"}, {"role": "user", "content": "second"}
    lines = [record("c", 1, 20, 30, [q1, {"role": "assistant", "content": "Hi"}, q2], [sse(chunk("Bye"))]),
             record("c", 0, 0, 10, [q1], [sse(chunk("Hi"))]),
             record("d", 0, 5, 25, [q1], [sse(chunk("x"))]),
             record("d", 1, 26, 40, [q1, {"role": "assistant", "content": "not what it said"}, q2], [])]
    (tmp_path / "profile_export_raw.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    sent = ar.read_raw(tmp_path)
    assert [(s.conversation, s.turn) for s in sent] == [("c", 0), ("d", 0), ("c", 1), ("d", 1)]   # as sent
    assert ar.fed_back(sent) == (2, 1)
    assert ar.in_flight_max(sent) == 2


def test_a_record_whose_text_holds_unicode_line_breaks_is_read_whole(tmp_path: Path) -> None:
    # aiperf writes what it sent unescaped; real chats hold U+2028, U+2029, U+0085, form feeds and vertical tabs
    text = "first\u2028second\u2029third\x85fourth\x0cfifth\x0bsixth\x1cseventh \U0001f600 中文"
    q = {"role": "user", "content": text}
    lines = [record("c", 0, 1, 10, [q], [sse(chunk(text))]), record("c", 1, 11, 20, [q, {"role": "assistant",
             "content": text}, q], [sse(chunk("ok"))])]
    (tmp_path / "profile_export_raw.jsonl").write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines)
                                                       + "\n")
    sent = ar.read_raw(tmp_path)
    assert [s.messages[0]["content"] for s in sent] == [text, text]
    assert sent[0].answer == text
    assert ar.fed_back(sent) == (1, 1)


def test_sse_lines_split_where_the_format_says_and_nowhere_else() -> None:
    # what httpx's iter_lines does not: U+2028, U+2029 and U+0085 are characters inside an event's JSON, not ends
    # of lines; CR LF may come in two chunks; a multi-byte character may be cut between chunks
    common = load_bench("_common")
    text = "x\u2028y\u2029z\x85 é 🙂"
    stream = b"data: " + json.dumps({"delta": text}, ensure_ascii=False).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    want = ["data: " + json.dumps({"delta": text}, ensure_ascii=False), "", "data: [DONE]", ""]
    for cut in range(1, len(stream)):
        for second in range(cut, len(stream), 7):
            assert list(common.sse_lines([stream[:cut], stream[cut:second], stream[second:]])) == want
    assert list(common.sse_lines([b"a\rb\nc\r", b"\nd"])) == ["a", "b", "c", "d"]


# ------------------------------------------------------------------------------------------------ setups


def test_setup_names() -> None:
    assert sc.parse_setup("alone-ram0") == sc.Setup("alone-ram0", None, "ram0", True)
    assert sc.parse_setup("lpcache-auto-ramsmall-nosid") == sc.Setup("lpcache-auto-ramsmall-nosid", "auto",
                                                                      "ramsmall", False)
    assert [sc.parse_setup(n).name for n in sc.DEFAULT_SETUPS.split(",")] == sc.DEFAULT_SETUPS.split(",")
    bare = sc.parse_setup("bare-ramdef")
    assert bare == sc.Setup("bare-ramdef", sc.BARE, "ramdef", True) and bare.label == "a bare proxy, no cache"
    for bad in ("alone", "lpcache-ram0", "lpcache-fast-ram0", "alone-ram9", "solo-ram0", "bare", "bare-auto-ramdef",
                "bare-fast"):
        with pytest.raises(ValueError):
            sc.parse_setup(bad)


def test_why_lpcache_did_not_start_names_the_variable() -> None:
    log = ("lpcache failed to start; its log:\nTraceback (most recent call last):\n  ...\n"
           "lpcache.config.ConfigError: BIG_THRESHOLD_WORDS='auto': invalid literal for int()\n"
           "exited with status 2\n")
    env = {"LLAMA_URL": "http://x", "META_DIR": "/m", "BIG_THRESHOLD_WORDS": "auto"}
    assert sc.start_reason(log, env).startswith("lpcache.config.ConfigError: BIG_THRESHOLD_WORDS='auto'")


def test_every_error_is_counted_and_listed_and_lpcache_figures_are_read_by_label() -> None:
    run = {"setup": "lpcache-defaults-ram0", "label": "lpcache, defaults", "ram": "ram0", "sessions": True,
           "variant": "defaults", "requests": 10, "errors": 1, "computed": 50, "prompt_tokens": 90, "ideal": 40,
           "x_ideal": 1.25, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "ttft_later_turns_p50_s": 0.5, "duration_s": 9.0,
           "error_list": {"ClientError 500: Server disconnected": 1},
           "error_events": {'{"message": "all slots busy"}': 2}, "not_json_events": {": ping": 3},
           "lpcache": {'lpcache_saves_total{result="ok"}': 7, 'lpcache_saves_total{result="failed"}': 1,
                       'lpcache_background_saves_total{result="ok"}': 2,
                       'lpcache_restores_total{result="ok"}': 4, 'lpcache_restores_total{result="failed"}': 1,
                       'lpcache_slot_file_bytes_total{action="save"}': 3e6,
                       'lpcache_slot_file_bytes_total{action="restore"}': 5e6,
                       'lpcache_prefill_missed_tokens_total{kind="threshold"}': 123}}
    assert sc.run_errors(run) == 6
    cells = sc.row(run)
    assert cells[3] == 6 and cells[-3:] == ["9", "4/1", "3"]
    listed = "\n".join(sc.notes([run]))
    for text in ("Server disconnected", "all slots busy", "not JSON: : ping", 'kind="threshold"'):
        assert text in listed
    skipped = {**{k: run[k] for k in ("setup", "label", "ram", "sessions", "variant")}, "skipped": "no auto yet"}
    assert sc.row(skipped)[-1] == "skipped" and "no auto yet" in sc.notes([skipped])[0]


def test_aiperf_log_problems_are_counted_by_text(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "aiperf.log").write_text(
        "2026-12-02 05:09:07.539 - aiperf.metrics - WARNING - OSL mismatch: got 12 tokens\n"
        "2026-12-02 05:09:08.001 - aiperf.metrics - WARNING - OSL mismatch: got 12 tokens\n"
        "2026-12-02 05:09:09.000 - worker - ERROR - Failed to parse response\n"
        "2026-12-02 05:09:10.000 - worker - INFO - fine\n")
    assert ar.log_problems(tmp_path) == {"WARNING: OSL mismatch: got 12 tokens": 2,
                                         "ERROR: Failed to parse response": 1}
    assert ar.log_problems(tmp_path / "missing") == {}


def test_setups_not_run_keep_their_last_figures_for_the_same_workload(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    settings: dict[str, Any] = {"answer_tokens": 32, "concurrency": 8, "think_ms": 0, "lpcache_env": {}}
    prep = {"conversations": [{"id": "a", "turns": 2, "tokens": 9}], "small_mib": 117}
    old = {"settings": settings, "prepare": prep,
           "results": [{"setup": "lpcache-defaults-ram0", "old": True}, {"setup": "alone-ram0", "old": True}]}
    monkeypatch.setattr(sc, "RESULTS", tmp_path / "sharegpt.json")
    sc.RESULTS.write_text(json.dumps(old))
    new: dict[str, Any] = {"settings": settings, "prepare": prep, "results": [{"setup": "alone-ram0", "old": False}]}
    assert sc.merged(new, ["alone-ram0"]) == [{"setup": "alone-ram0", "old": False},
                                              {"setup": "lpcache-defaults-ram0", "old": True}]
    other = {**new, "settings": {**settings, "answer_tokens": 64}}
    assert sc.merged(other, ["alone-ram0"]) == [{"setup": "alone-ram0", "old": False}]


# ------------------------------------------------------------------------------------------------ the fast profile


def test_fast_setup_names() -> None:
    assert sc.parse_setup("fast-auto") == sc.Setup("fast-auto", "auto", sc.FAST, True)
    nosid = sc.parse_setup(" fast-defaults-nosid ")
    assert nosid == sc.Setup("fast-defaults-nosid", "defaults", sc.FAST, False)
    assert nosid.fast and not sc.parse_setup("lpcache-auto-ram0").fast
    assert nosid.label == "lpcache, defaults, fast stand-in"
    assert {"fast-defaults", "fast-auto"} <= set(sc.DEFAULT_SETUPS.split(","))
    for bad in ("fast", "fast-ram0", "fast-auto-ram0", "fast-nosid", "alone-fast", "lpcache-auto-fast",
                "fast-fast", "fast-auto-nosid-nosid"):
        with pytest.raises(ValueError):
            sc.parse_setup(bad)


def prepared(**cpu: Any) -> Any:
    return sc.Prepared([sg.Conversation("a", ["x", "y"], 1000), sg.Conversation("b", ["z"] * 4, 3000)],
                       sg.ReadStats(), {"bytes_per_token": 23056.6, "n_written": 1, "n_saved": 1}, 4000, 20, None,
                       {}, Path("d.jsonl"), cpu)


def test_the_stand_in_is_the_cpu_over_the_factor_with_a_real_cache_s_weight() -> None:
    prep = prepared(prefill_ms_per_token=3.2, gen_ms_per_token=25.0)
    stand_in = sc.stand_in_of(prep, 100)
    assert stand_in == {"slots": 2, "n_ctx": 8192, "fast_factor": 100, "prefill_ms_per_token": 0.032,
                        "gen_ms_per_token": 0.25, "kv_bytes_per_token": 23057}
    argv = sc.stand_in_argv(stand_in)
    assert argv[argv.index("--prefill-ms-per-token") + 1] == "0.032"
    assert argv[argv.index("--kv-bytes-per-token") + 1] == "23057"
    assert argv[argv.index("--n-ctx") + 1] == "8192"
    from lpcache.mock_llama.__main__ import build_parser, config_from
    config = config_from(build_parser().parse_args(["0", *argv]))   # flags the stand-in takes
    assert (config.prefill_ms_per_token, config.gen_ms_per_token, config.kv_bytes_per_token) == (0.032, 0.25, 23057)


def test_the_cpu_rates_are_the_quickest_runs() -> None:
    rates = sc.cpu_rates([{"prompt_n": 1000, "prompt_ms": 4000.0, "predicted_n": 32, "predicted_ms": 640.0},
                          {"prompt_n": 1000, "prompt_ms": 3000.0, "predicted_n": 32, "predicted_ms": 960.0}], 1.234)
    assert (rates["prefill_ms_per_token"], rates["gen_ms_per_token"], rates["load_1m"]) == (3.0, 20.0, 1.23)
    assert "3.000 ms a token" in sc.cpu_text({"cpu": rates}) and sc.cpu_text({}) == ""
    given = sc.given_rates("3.2,21")
    assert (given["prefill_ms_per_token"], given["gen_ms_per_token"]) == (3.2, 21.0)
    assert "as given" in sc.cpu_text({"cpu": given})
    for bad in ("3.2", "3.2,x", "0,21", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            sc.given_rates(bad)


def test_the_fast_runs_are_estimated_from_the_cpu_rates_over_the_factor() -> None:
    args = argparse.Namespace(answer_tokens=32, concurrency=8, fast_factor=100.0)
    prep = prepared(prefill_ms_per_token=4.0, gen_ms_per_token=10.0)
    fast = sc.estimate_s(sc.parse_setup("fast-auto"), prep, args)
    slow = sc.estimate_s(sc.parse_setup("lpcache-auto-ram0"), prep, args)
    assert sc.RUN_OVERHEAD_S < fast < slow
    quicker = sc.estimate_s(sc.parse_setup("fast-auto"), prep, argparse.Namespace(**{**vars(args), "fast_factor": 1e6}))
    assert quicker < fast


def test_stand_in_tokens_count_words_symbols_and_the_answers() -> None:
    one = sc.stand_in_tokens(["Hello, world"], 32)
    two = sc.stand_in_tokens(["Hello, world", "again"], 32)
    assert two - one == 32 + len(sc.tokenize("<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nagain"
                                                   "<|im_end|>\n"))


LOG = "\n".join([   # as lpcache logs them
    "2026-12-02 07:30:01,004 INFO lpcache.swap: slot_save url=http://h:1 slot=0 file=aa model=-: ok tokens=100 "
    "bytes=2305700 ms=40",
    "2026-12-02 07:30:02,004 INFO lpcache.swap: slot_restore url=http://h:1 slot=1 file=aa model=-: ok tokens=100 "
    "bytes=2305700 ms=9",
    "2026-12-02 07:30:03,004 WARNING lpcache.swap: slot_save url=http://h:1 slot=1 file=bb model=-: failed status=500 "
    "reason='x bytes=3'",
    "2026-12-02 07:30:04,004 INFO lpcache.saving: save_verdict backend=http://h:1 model= worth=false tokens=120 "
    "need_rate=0.500: caches like this one are not saved",
    "2026-12-02 07:30:05,004 INFO lpcache.swap: slot_save url=http://h:1 slot=1 file=cc model=-: ok tokens=10 "
    "bytes=230570 ms=4",
])


def test_saves_and_verdicts_are_read_from_lpcache_s_log() -> None:
    assert sc.logged_saves(LOG) == (2, 2305700 + 230570)
    assert sc.logged_saves("") == (0, 0)
    assert sc.save_verdicts(LOG) == ["save_verdict backend=http://h:1 model= worth=false tokens=120 need_rate=0.500: "
                                     "caches like this one are not saved"]


def fast_result(setup: str, saves: float, written: float, background: float = 0, shutdown: int = 0,
                decisions: dict[str, float] | None = None) -> dict[str, Any]:
    s = sc.parse_setup(setup)
    return {"setup": s.name, "label": s.label, "ram": s.ram, "sessions": s.sessions, "variant": s.variant,
            "requests": 174, "errors": 0, "computed": 5000, "prompt_tokens": 40000, "ideal": None, "x_ideal": None,
            "lpcache": {'lpcache_saves_total{result="ok"}': saves, 'lpcache_background_saves_total{result="ok"}': 1,
                        'lpcache_restores_total{result="ok"}': 3, 'lpcache_restores_total{result="failed"}': 0,
                        'lpcache_slot_file_bytes_total{action="save"}': written,
                        'lpcache_slot_file_bytes_total{action="restore"}': 7e9,
                        'lpcache_background_save_bytes_total': background, "lpcache_cache_need_rate": 0.25,
                        **{f'lpcache_save_decisions_total{{decision="{k}"}}': v
                           for k, v in (decisions or {}).items()}},
            "shutdown": {"saves": 1 if shutdown else 0, "bytes": shutdown},
            "logged": {"saves": int(saves), "bytes": int(written)}, "stand_in_stats": {"saves": 5, "restores": 3},
            "save_verdicts": ["save_verdict backend=x worth=false"], "settled": True}


def test_a_fast_row_counts_every_byte_written_and_auto_s_decisions() -> None:
    r = fast_result("fast-auto", 4, 3_000_000, background=500_000, shutdown=20_000,
                    decisions={"probe_too_short": 170, "worth": 4, "not_worth": 0})
    assert sc.written_bytes(r) == 3_520_000   # restores' reads left out
    cells = sc.fast_row(r)
    assert len(cells) == len(sc.FAST_HEADERS)
    assert cells[4:] == [5000, 40000, "6", "3/0", "3,520,000", "probe_too_short 170, worth 4", "0.25"]
    assert sc.fast_row(fast_result("fast-defaults", 1, 1))[9] == "-"
    skipped = {**{k: r[k] for k in ("setup", "label", "ram", "sessions", "variant")}, "skipped": "no"}
    assert sc.fast_row(skipped)[-1] == "skipped" and len(sc.fast_row(skipped)) == len(sc.FAST_HEADERS)


def test_the_verdict_compares_auto_with_the_defaults_of_the_same_session_mode() -> None:
    runs = [fast_result("fast-defaults", 10, 1_000_000), fast_result("fast-auto", 0, 999_999, shutdown=1),
            fast_result("fast-defaults-nosid", 3, 100), fast_result("fast-auto-nosid", 2, 50, background=51)]
    met, not_met = sc.fast_verdicts(runs)
    assert "with session ids" in met and "1,000,000 bytes" in met and met.endswith("met.") and "not met" not in met
    assert "without session ids" in not_met and not_met.endswith("not met.")   # 101 bytes against 100
    assert sc.fast_verdicts(runs[:1]) == []                                      # no pair, no verdict
    skipped = {**runs[1], "skipped": "lpcache did not start"}
    assert "not measured" in sc.fast_verdicts([runs[0], skipped])[0]


def report_with(results: list[dict[str, Any]]) -> dict[str, Any]:
    settings = {"conversations": 2, "seed": 1, "concurrency": 8, "answer_tokens": 32, "think_ms": 0, "min_turns": 2,
                "max_turns": 4, "budget": 6000, "lpcache_env": {}, "setups": [r["setup"] for r in results],
                "fast_factor": 100}
    prep = {"read_items": 9, "truncated": True, "kv": {"bytes_per_token": 23057.0, "n_written": 2, "n_saved": 1},
            "working_set_tokens": 4000, "small_mib": 20, "n_ctx": 8192, "conversations": [
                {"id": "a", "turns": 2, "tokens": 1000}, {"id": "b", "turns": 4, "tokens": 3000}],
            "cpu": sc.cpu_rates([{"prompt_n": 1000, "prompt_ms": 3000.0, "predicted_n": 32, "predicted_ms": 640.0}],
                                0.5)}
    return {"aiperf": "0.13.0", "command": "aiperf profile", "minutes": 3.0, "settings": settings, "prepare": prep,
            "results": results}


def test_the_page_has_the_fast_table_after_the_ram_tables(tmp_path: Path) -> None:
    cpu_run = {"setup": "lpcache-auto-ram0", "label": "lpcache, auto", "ram": "ram0", "sessions": True,
               "variant": "auto", "requests": 10, "errors": 0, "computed": 50, "prompt_tokens": 90, "ideal": 40,
               "x_ideal": 1.25, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "ttft_later_turns_p50_s": 0.5,
               "duration_s": 9.0, "date": "2026-12-02 07:00", "commit": "abc", "load_1m_before": 1.0,
               "load_1m_after": 2.0}
    stand_in = {"slots": 2, "n_ctx": 8192, "fast_factor": 100, "prefill_ms_per_token": 0.03,
                "gen_ms_per_token": 0.25, "kv_bytes_per_token": 23057}
    fast = [{**fast_result("fast-defaults", 10, 2e6), "stand_in": stand_in, "duration_s": 20.0},
            {**fast_result("fast-auto", 0, 0), "stand_in": stand_in, "duration_s": 20.0}]
    page = sc.markdown(report_with([cpu_run, *fast]), "Machine: test")
    ram0 = page.index("### `--cache-ram 0`")
    title = page.index("### Fast profile: a stand-in 100 times faster than this CPU")
    assert ram0 < title < page.index("Runs:") and page.endswith(sc.END)
    section = page[title:page.index("Runs:")]
    assert "--prefill-ms-per-token 0.03" in section and "3.000 ms a token" in section and "no ideal" in section
    assert "`auto` wrote 0 bytes" in section and "met." in section and "not met" not in section
    assert "| lpcache, auto, fast stand-in (`fast-auto`)" in section
    assert "fast-auto" not in page[:title]                         # not in the RAM tables
    sc.plot(report_with([cpu_run, *fast])["results"], tmp_path / "plot.png")   # the fast rows have no ideal to plot
    assert (tmp_path / "plot.png").stat().st_size > 0
    older = report_with([cpu_run])
    del older["prepare"]["cpu"]
    assert "Fast profile" not in sc.markdown(older, "Machine: test")   # results of before the fast profile


def test_slot_handovers_are_read_from_llama_server_s_log() -> None:
    """Lines as llama-server b11434 writes them (minutes.seconds.ms.us): slot 1 stood idle 52.9 ms between two
    requests, slot 0 10.7 ms and then 1.2 s across a minute's turn; a launch with no release before it (a slot's
    first request) and a release with no launch after it (the run's last) are no hand-overs."""
    log = b"""0.31.100.000 I slot launch_slot_: id  0 | task 400 | processing task, is_child = 0
0.32.208.966 I slot print_timing: id  1 | task 477 |    graphs reused =        388
0.32.209.146 I slot      release: id  1 | task 477 | stop processing: n_tokens = 60, truncated = 0
0.32.262.442 I slot get_availabl: id  1 | task -1 | selected slot by id (1)
0.32.262.000 I slot launch_slot_: id  1 | task 497 | processing task, is_child = 0
0.32.766.053 I slot      release: id  0 | task 487 | stop processing: n_tokens = 154, truncated = 0
0.32.776.753 I slot launch_slot_: id  0 | task 526 | processing task, is_child = 0
0.59.900.000 I slot      release: id  0 | task 526 | stop processing: n_tokens = 200, truncated = 0
1.01.100.000 I slot launch_slot_: id  0 | task 600 | processing task, is_child = 0
1.02.000.000 I slot      release: id  1 | task 497 | stop processing: n_tokens = 208, truncated = 0
"""
    figures = sc.slot_handovers(log)
    assert figures == {"handovers": 3, "handover_ms_p50": 52.9, "handover_idle_s": 1.26,
                       "handovers_long": [[59.9, 0, 1.2]]}   # the one of 0.1 s or more: when, which slot, how long
    assert sc.slot_handovers(b"no slot lines at all\n") == {"handovers": 0, "handover_ms_p50": None,
                                                           "handover_idle_s": 0, "handovers_long": []}


def test_an_lpcache_run_is_set_beside_the_server_alone_with_the_same_ram_request_by_request() -> None:
    alone = {"setup": "alone-ramdef", "ram": "ramdef", "variant": None,
             "computed_by_request": {"a#0": 50, "a#1": 20, "b#0": 70, "b#1": 300}}
    other_ram = {"setup": "alone-ram0", "ram": "ram0", "variant": None, "computed_by_request": {"a#0": 1}}
    auto = {"setup": "lpcache-auto-ramdef", "ram": "ramdef", "variant": "auto",
            "computed_by_request": {"a#0": 50, "a#1": 90, "b#0": 70, "b#1": 280, "c#0": 5}}
    lines = sc.beside_alone([other_ram, alone, auto])
    assert lines == ["- lpcache-auto-ramdef beside alone-ramdef, request by request (4 of the same conversations' "
                     "turns): 2 computed the same prompt tokens, 1 more (+70 tokens), 1 fewer (-20); net +50."]
    assert sc.beside_alone([auto]) == [] and sc.beside_alone([{**alone, "skipped": "x", "computed_by_request": {}},
                                                              auto]) == []
