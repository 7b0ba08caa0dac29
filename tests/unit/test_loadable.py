"""Which saved files a server can load beyond the model: its KV layout (from its saves' sizes) and each slot's
context. Figures from the real llama-server b11434: SmolLM2-135M saves 19 tokens in 438,840 bytes with an f16 cache,
233,640 with q8_0; Gemma 3 270M (sliding window of 512) saves (tokens, bytes) as in GEMMA, with or without
--swa-full."""

from __future__ import annotations

from lpcache.backends.loadable import LAYOUT_MIN_TOKENS, Loadable, per_token
from lpcache.backends.slots import Slot
from lpcache.cache.meta_files import Candidate, MetaEntry

F16, Q8 = 438_840 / 19, 233_640 / 19
GEMMA = [(22, 406_628), (41, 757_368), (201, 3_710_968), (513, 9_455_116), (601, 9_726_860), (1001, 10_962_060),
         (2002, 14_053_148), (3002, 17_141_148)]
SMOL_F16 = [(22, 508_004), (107, 2_467_764), (549, 12_658_516), (2153, 49_640_340), (3179, 73_295_796)]
SMOL_Q8 = [(22, 270_404), (106, 1_299_908), (553, 6_778_340), (2124, 26_032_516), (3211, 39_354_788)]


def entry(tokens: int | None, size: int, fingerprint: str | None = "fp") -> MetaEntry:
    return MetaEntry(key="k" * 64, model="m", wpb=10, chain=(1, 2), timestamp=0.0, slot_save_path="/s",
                     fingerprint=fingerprint, n_tokens=tokens, size=size)


def test_bytes_per_token_is_read_only_from_enough_tokens() -> None:
    assert per_token(LAYOUT_MIN_TOKENS - 1, 200_000) is None
    assert per_token(None, 200_000) is None and per_token(100, 0) is None
    assert per_token(19, 233_640) == Q8
    assert abs((per_token(16, 16 * 12_256 + 776) or 0) / Q8 - 1) < 0.01, "a short file's header weighs little"


def test_a_file_of_another_kv_type_is_not_offered_once_a_save_showed_the_servers() -> None:
    loads = Loadable()
    f16_file, q8_file = entry(200, int(200 * F16)), entry(300, int(300 * Q8))
    assert loads.fits(f16_file, None, 0) and loads.fits(q8_file, None, 0)   # nothing known yet: offered
    loads.saved("fp", 19, 233_640)   # the server saves with q8_0 now
    assert loads.fits(q8_file, None, 0) and not loads.fits(f16_file, None, 0)
    assert loads.fits(entry(200, int(200 * F16), fingerprint="other-model"), None, 0)   # another model: its own
    assert loads.fits(entry(None, 0), None, 0), "a file without figures (the Rust lpcache's) is offered as before"


def test_a_refused_layout_is_not_offered_until_a_save_shows_it_again() -> None:
    loads = Loadable()
    old, older = entry(200, int(200 * F16)), entry(500, int(500 * F16))
    assert loads.refused(old), "news: f16 is not this server's"
    assert not loads.fits(older, None, 0) and loads.fits(entry(300, int(300 * Q8)), None, 0)
    loads.saved("fp", 40, int(40 * F16))   # the server was switched back to f16
    assert loads.fits(older, None, 0)
    # refused twice in the layout its saves showed: the server was restarted with another type since
    assert not loads.refused(older) and loads.fits(older, None, 0), "once: maybe no room, a file it cannot open"
    assert loads.refused(older) and not loads.fits(older, None, 0) and loads.fits(entry(300, int(300 * Q8)), None, 0)


def test_one_refusal_of_a_file_like_the_servers_saves_hides_none_of_them() -> None:
    """llama-server answers "no available space in KV cache or invalid slot save file" also when a unified KV cache
    has no room left or it cannot open the file: one such refusal is no news of the layout; a save in between clears
    the doubt, so refusals spread out never hide the server's own files."""
    loads = Loadable()
    for saved in SMOL_F16:
        loads.saved("fp", *saved)
    own = [entry(t, b) for t, b in SMOL_F16]
    assert not loads.refused(own[2])
    assert all(loads.fits(e, None, 0) for e in own)
    loads.saved("fp", *SMOL_F16[1])
    assert not loads.refused(own[3]) and all(loads.fits(e, None, 0) for e in own)
    q8 = entry(*SMOL_Q8[2])
    assert not loads.fits(q8, None, 0)


def test_after_a_restart_one_refusal_tells_the_layout() -> None:
    """A server seen down may come back with another cache type: what its saves showed before is void."""
    loads = Loadable()
    for saved in SMOL_F16:
        loads.saved("fp", *saved)
    loads.restarted()
    assert loads.refused(entry(*SMOL_F16[2]))
    assert not loads.fits(entry(*SMOL_F16[4]), None, 0) and loads.fits(entry(*SMOL_Q8[4]), None, 0)


def test_a_file_larger_than_the_slots_context_is_not_offered_there() -> None:
    loads = Loadable(n_ctx=4096)
    loads.slot_ctx[(None, 1)] = 1024   # GET /slots: slot 1 has a smaller context
    big = entry(2000, 0)
    assert loads.fits(big, None, 0) and not loads.fits(big, None, 1)
    slots = [Slot(0, i, url="http://a", slot_save_path="/s", loadable=loads) for i in range(2)]
    candidate = Candidate(entry=big, shared=3, ratio=1.0, exact=True)
    assert [s.can_read(candidate) for s in slots] == [True, False]


def test_the_models_identity_changes_with_the_servers_build() -> None:
    """llama-server's save format changed within the last few hundred builds: an upgrade behind the same URL starts
    new caches (and a router's models too)."""
    from lpcache.backends.backend import model_fingerprint, router_model_fingerprint

    props = {"model_path": "/m/SmolLM2.gguf", "chat_template": "{{x}}", "bos_token": "<s>", "eos_token": "</s>"}
    model = {"id": "smol", "meta": {"n_params": 135_000_000, "size": 1, "n_vocab": 49152}}
    before = model_fingerprint({**props, "build_info": "b11434-7b6f3f1"}, model)
    assert model_fingerprint({**props, "build_info": "b11434-7b6f3f1"}, model) == before
    assert model_fingerprint({**props, "build_info": "b11502-0c2e91a"}, model) != before
    entry = {"id": "smol", "status": {"args": ["-m", "/m/SmolLM2.gguf"]}}
    assert router_model_fingerprint(entry, "b11434") != router_model_fingerprint(entry, "b11502")


def test_a_sliding_window_models_files_of_every_length_are_offered_after_its_saves_of_any() -> None:
    """Gemma's bytes per token falls from 18.5 KB to 5.7 KB past its window: one layout all the same."""
    for saved in GEMMA:
        loads = Loadable()
        loads.saved("fp", *saved)
        assert all(loads.fits(entry(t, b), None, 0) for t, b in GEMMA), saved
    loads = Loadable()
    for saved in GEMMA[::-1]:
        loads.saved("fp", *saved)
    assert all(loads.fits(entry(t, b), None, 0) for t, b in GEMMA)


def test_a_dense_models_other_cache_type_is_told_once_saves_of_no_more_tokens_are_known() -> None:
    """What the sizes allow to tell without knowing the model: a file of another layout no shorter than the
    server's shortest sample (a shorter one of a heavier layout is told by its refusal)."""
    for mine, other in ((SMOL_F16, SMOL_Q8), (SMOL_Q8, SMOL_F16)):
        loads = Loadable()
        for saved in mine[1::2]:
            loads.saved("fp", *saved)
        assert all(loads.fits(entry(t, b), None, 0) for t, b in mine)
        told = [loads.fits(entry(t, b), None, 0) for t, b in other if t >= mine[1][0]]
        assert told and not any(told)


def test_saves_of_another_layout_replace_the_samples_of_the_old_one() -> None:
    """The server restarted with q8_0 and saved before any old file was tried: its saves are the truth now."""
    loads = Loadable()
    for saved in SMOL_F16:
        loads.saved("fp", *saved)
    loads.saved("fp", *SMOL_Q8[2])
    loads.saved("fp", *SMOL_Q8[0])
    assert all(loads.fits(entry(t, b), None, 0) for t, b in SMOL_Q8)
    assert not any(loads.fits(entry(t, b), None, 0) for t, b in SMOL_F16)


def test_a_slots_context_is_read_again_after_its_server_was_down() -> None:
    loads = Loadable(n_ctx=4096)
    loads.slot_ctx[(None, 1)] = 1024
    loads.restarted()
    assert loads.context(None, 1) == 4096


def test_a_layout_found_refused_gets_no_new_doubt_after_the_servers_next_save() -> None:
    """Restarted from f16 to q8_0, the server saves long q8_0 caches, which short f16 files fit by the rule. Once the
    f16 layout is found refused, a q8_0 save does not offer the f16 files again (each refusal clears the slot)."""
    loads = Loadable()
    for saved in SMOL_Q8[3:]:
        loads.saved("fp", *saved)
    old = entry(*SMOL_F16[2])
    assert not loads.refused(old)          # once: maybe no room
    assert loads.refused(old) and not loads.fits(old, None, 0)
    loads.saved("fp", *SMOL_Q8[3])
    assert not loads.fits(old, None, 0)
    assert loads.refused(old), "a refusal of a layout known refused is no doubt"


def test_a_restore_that_worked_clears_the_doubt_of_an_earlier_refusal() -> None:
    loads = Loadable()
    for saved in SMOL_F16:
        loads.saved("fp", *saved)
    own = entry(*SMOL_F16[2])
    assert not loads.refused(own)
    loads.restored("fp")
    assert not loads.refused(own) and loads.fits(own, None, 0), "two refusals far apart, a restore between"
