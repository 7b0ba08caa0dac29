"""Session ids, file names and prompt comparison (the pure parts of session mode)."""

import pytest

from lpcache.cache.session_ids import is_session_id, session_id
from lpcache.cache.sessions import SessionBook, compare, route_name, route_tag, session_filename

GOOD = "3f9a0c1d5b7e4a2c8d6f1e0b9a7c5d3e"


@pytest.mark.parametrize("value", [
    "", "../../etc/passwd", GOOD.upper(), GOOD + "0", GOOD[:-1], GOOD[:-2] + "..", GOOD[:-1] + "g",
    GOOD + "\n", " " + GOOD, "a" * 4096, GOOD[:16] + "/" + GOOD[17:], "user-42",
])
def test_a_file_name_takes_only_lpcaches_form_of_a_session_id(value: str) -> None:
    # what a client sends is turned into that form first (tests/unit/test_session_ids.py); raw, it never names a file
    with pytest.raises(ValueError):
        session_filename("m", value)


def test_a_good_session_id_and_its_file_name() -> None:
    assert session_id(GOOD) == GOOD
    name = session_filename("openai/Qwen3-8B:Q4", GOOD)
    assert name.endswith(f"_{GOOD}.bin") and "/" not in name and ":" not in name and ".." not in name
    assert len(name) <= 255


def test_route_tags_are_safe_readable_and_distinct() -> None:
    assert route_name("openai/qwen") == "qwen" and route_name("qwen") == "qwen"
    a, b = route_tag("qwen/7b"), route_tag("qwen_7b")
    assert a != b and a.startswith("qwen_7b-") and b.startswith("qwen_7b-")
    assert all(c.isalnum() or c in "_-" for c in route_tag("a b/c:d*e" + "x" * 100))
    assert len(route_tag("x" * 1000)) == 40 + 1 + 8


def msgs(*texts: str) -> list[dict[str, str]]:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return [{"role": roles[i], "content": t} for i, t in enumerate(texts)]


def test_compare_identical_added_and_changed() -> None:
    same = compare(msgs("sys", "hello"), msgs("sys", "hello"))
    assert same.same and same.message is None and same.shared_chars == same.total_chars == 8
    added = compare(msgs("sys", "hello"), msgs("sys", "hello", "answer", "next"))
    assert not added.same and added.message == 2 and added.role == "assistant" and added.shared_chars == 8
    assert "added" in added.reading
    system = compare(msgs("sys A", "hello"), msgs("sys B", "hello"))
    assert system.message == 0 and system.shared_chars == 4 and "system" in system.reading
    last = compare(msgs("sys", "q1", "a1", "question two"), msgs("sys", "q1", "a1", "question 2", "a2"))
    assert last.message == 3 and last.shared_chars == 3 + 2 + 2 + 9 and "last message" in last.reading
    assert last.last_shared_chars == 0          # "question two" vs "a2"
    middle = compare(msgs("sys", "q1", "a1", "q2"), msgs("sys", "q1", "edited", "q2"))
    assert middle.message == 2 and "middle" in middle.reading
    assert "message 2" in middle.log_line()


def test_an_owner_gets_a_file_of_its_own_for_the_same_session_id() -> None:
    plain = session_filename("m", GOOD)
    a, b = session_filename("m", GOOD, owner="a" * 16), session_filename("m", GOOD, owner="b" * 16)
    assert len({plain, a, b}) == 3
    assert all(is_session_id(n.rsplit("_", 1)[1].removesuffix(".bin")) for n in (a, b))   # the same form of name
    assert a.rsplit("_", 1)[0] == plain.rsplit("_", 1)[0]                                # the same route tag


def test_the_book_lists_and_finds_only_the_owners_sessions() -> None:
    book = SessionBook()
    book.seen("fa", GOOD, "m", [], 1.0, owner="a")
    book.seen("fb", GOOD, "m", [], 2.0, owner="b")
    book.seen("fn", GOOD, "m", [], 3.0)
    assert [i.file for i in book.all("a")] == ["fa"] and [i.file for i in book.all()] == ["fn"]
    assert book.of_session(GOOD, owner="b").file == "fb"  # type: ignore[union-attr]
    assert book.of_session(GOOD, owner="c") is None


# ---- the book's memory: summaries of prompts, not the prompts ----

def long_text(n: int, seed: str = "x") -> str:
    return "".join(f"{seed}{i:07d} " for i in range(n // 9 + 1))[:n]


def test_a_long_prompt_is_kept_as_digests_and_compared_to_the_chunk() -> None:
    from lpcache.cache.sessions import CHUNK_MIN_CHARS, TEXT_KEPT_CHARS, Summary

    story = long_text(200_000)
    first = msgs("You write stories.", story)
    summary = Summary.of(first)
    assert summary.kept is None and summary.nbytes < 20_000 < len(story)
    assert Summary.of(msgs("sys", "hello")).kept is not None
    assert sum(len(t) for t in ("sys", "hello")) <= TEXT_KEPT_CHARS

    cut = 150_000 + 37                                  # the story changes in the middle of a chunk
    second = msgs("You write stories.", story[:cut] + " and then something else")
    exact, summed = compare(first, second), compare(summary, second)
    assert exact.message == summed.message == 1 and exact.role == summed.role == "user"
    chunk = summary.chunk
    assert chunk >= CHUNK_MIN_CHARS
    assert summed.message_shared_chars == cut - cut % chunk            # whole chunks: a lower bound
    assert cut - chunk < summed.message_shared_chars <= cut
    assert summed.previous_message_chars == len(story) and summed.message_chars == len(second[1]["content"])

    grown = msgs("You write stories.", story, "an answer", "a question")   # the whole old prompt shared: exact
    c = compare(summary, grown)
    assert c.message == 2 and c.shared_chars == len("You write stories.") + len(story)
    assert compare(summary, first).same
    assert compare(summary, msgs("You write stories!", story)).message_shared_chars == 0   # first chunk differs
    longer_last = msgs("You write stories.", story + " more")
    assert compare(summary, longer_last).last_shared_chars == len(story)


def test_the_book_is_bounded_by_count_and_bytes() -> None:
    from lpcache.cache.sessions import SessionBook, Summary

    book = SessionBook(limit=3)
    for i in range(5):
        book.seen(f"f{i}", f"{i:032x}", "m", msgs("sys", f"hello {i}"), float(i))
    assert len(book) == 3 and [info.file for info in book.all()] == ["f4", "f3", "f2"]

    big = msgs("sys", long_text(300_000))
    per_session = Summary.of(big).nbytes
    book = SessionBook(limit=1024, budget=3 * per_session)
    for i in range(10):
        book.seen(f"f{i}", f"{i:032x}", "m", big, float(i))
    assert len(book) == 3 and book.bytes <= 3 * per_session
    assert book.bytes == sum(i.summary.nbytes for i in book.all() if i.summary is not None)
    again = book.seen("f9", f"{9:032x}", "m", big, 10.0)
    assert again.comparison is not None and again.comparison.same

    tiny = SessionBook(budget=100)                       # one summary alone over the budget: not compared
    info = tiny.seen("f", "0" * 32, "m", big, 0.0)
    assert info.summary is None and tiny.bytes == 0
    assert tiny.seen("f", "0" * 32, "m", big, 1.0).comparison is None
