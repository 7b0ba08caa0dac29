"""Which saved files a server can load into a slot, beyond the model's identity (`backend.model_fingerprint`).

Two things the model's identity does not tell:

- **The KV cache's layout.** llama-server does not say its cache type (`-ctk` / `-ctv`), and a file saved under
  another type is refused on restore (400, "invalid slot save file") after the slot was already cleared. But every
  save reports the tokens it wrote (`n_saved`) and the bytes (`n_written`), and a meta entry keeps both. Bytes per
  token is the layout's, but not a constant of it: on a dense model it is (f16 about twice q8_0, a header of a few
  hundred bytes spread over the tokens), while a sliding-window model's window layers stop growing past the window
  (Gemma 3 270M, real llama-server b11434: 18.5 KB a token up to 512 tokens, 5.7 KB a token at 3,000). What holds
  for every layout is that a longer file of it is no smaller and has no more bytes per token. So per model identity a
  server's saves are kept as samples (the latest of each length's power of two), and a file is not offered there when
  it breaks that rule against one of them by more than LAYOUT_TOLERANCE: a q8_0 file is smaller than an f16 save of
  fewer tokens, or has fewer bytes per token than an f16 save of more tokens. The server's one message for a refused
  restore ("no available space in KV cache or invalid slot save file") also covers a unified KV cache with no room
  left and a file it cannot open, so a refused file that fits the samples is first taken for such a cause; a second
  one before the next save (or one that breaks the rule, or one after a restart) voids the samples (the server was
  restarted with another cache type, found so before its first save) and marks that file's bytes per token as not
  this server's until a save shows a layout again, so the other files of the old type are not tried.
- **The slot's context.** A file holding more tokens than the slot's context (`n_ctx` per slot: `/props`'
  `default_generation_settings`, and per slot in `GET /slots`, which may differ between slots) cannot be loaded.

Files without these figures (saved by the Rust lpcache, or by an older lpcache) are offered as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpcache.cache.meta_files import MetaEntry

LAYOUT_MIN_TOKENS = 16     # a file's bytes per token is read only from this many tokens (its header then weighs <5%)
LAYOUT_MIN_BYTES = 256     # bytes per token below which a file is no KV cache's (the stand-in's small files): not read
LAYOUT_TOLERANCE = 0.05    # bytes (and bytes per token) within this share: not a break of the layout's rule
REFUSED_KEPT = 8           # refused layouts remembered per model identity

Sample = tuple[int, int]   # (tokens, bytes) of one saved file


def per_token(tokens: int | None, size: int | None) -> float | None:
    """Bytes per token of a saved file, when it holds enough tokens to tell."""
    if not tokens or tokens < LAYOUT_MIN_TOKENS or not size or size < LAYOUT_MIN_BYTES * tokens:
        return None
    return size / tokens


def same_layout(a: float, b: float) -> bool:
    """Two bytes-per-token figures alike: a file refused is taken for the layout of those alike to it."""
    return abs(a - b) <= LAYOUT_TOLERANCE * max(a, b)


def consistent(file: Sample, saved: Sample) -> bool:
    """Whether two files can be of one layout: the longer one is no smaller, and has no more bytes per token."""
    (short, short_bytes), (long, long_bytes) = sorted((file, saved))
    tol = 1 + LAYOUT_TOLERANCE
    return short_bytes <= long_bytes * tol and long_bytes / long <= short_bytes / short * tol


@dataclass
class Layout:
    """One model identity's KV layout on one server: samples of its saves since it was last in doubt (by the power
    of two of their length), and the bytes per token of the files it refused to load since."""

    samples: dict[int, Sample] = field(default_factory=dict)
    refused: list[float] = field(default_factory=list)
    doubted: bool = False   # a file that fits the samples was refused since the last save

    def loads(self, tokens: int | None, size: int | None) -> bool:
        bytes_per_token = per_token(tokens, size)
        if bytes_per_token is None or tokens is None or size is None:
            return True
        if self.refuses(bytes_per_token):
            return False
        return all(consistent((tokens, size), s) for s in self.samples.values())

    def refuses(self, bytes_per_token: float) -> bool:
        """A file of these bytes per token is of a layout the server refused since its last save of it."""
        return any(same_layout(bytes_per_token, r) for r in self.refused)

    def saved(self, tokens: int, size: int) -> None:
        if not all(consistent((tokens, size), s) for s in self.samples.values()):
            self.samples.clear()   # the server saves in another layout now (restarted with another cache type)
        self.samples[tokens.bit_length()] = (tokens, size)
        self.doubted = False
        bytes_per_token = size / tokens
        self.refused = [r for r in self.refused if not same_layout(r, bytes_per_token)]


@dataclass
class Loadable:
    """What one backend can load: per model identity its layout, and its slots' contexts (shared by its slots)."""

    n_ctx: int | None = None                                        # a slot's context, from /props
    slot_ctx: dict[tuple[str | None, int], int] = field(default_factory=dict)   # (model, slot id) -> GET /slots
    layouts: dict[str, Layout] = field(default_factory=dict)       # model identity -> layout

    def saved(self, fingerprint: str | None, tokens: int | None, size: int | None) -> None:
        """A save on this server wrote `tokens` in `size` bytes: a sample of its layout now."""
        if fingerprint is None or tokens is None or size is None or per_token(tokens, size) is None:
            return
        self.layouts.setdefault(fingerprint, Layout()).saved(tokens, size)

    def refused(self, entry: MetaEntry) -> bool:
        """The server refused to load a present file that fits the slot ("invalid slot save file"). A file that fits
        what the server's saves showed is first taken for another cause (no room in a unified KV cache, a file it
        cannot open): the samples stand. Otherwise (or at the second such refusal before a save) the file's layout
        is taken for not this server's, and what its saves showed is in doubt (it may have been restarted with
        another cache type) until a save shows it again. True when the file told its layout."""
        bytes_per_token = per_token(entry.n_tokens, entry.size)
        if entry.fingerprint is None or bytes_per_token is None or entry.n_tokens is None or entry.size is None:
            return False
        layout = self.layouts.setdefault(entry.fingerprint, Layout())
        like_saves = all(consistent((entry.n_tokens, entry.size), s) for s in layout.samples.values()) \
            and not layout.refuses(bytes_per_token)
        if layout.samples and like_saves and not layout.doubted:
            layout.doubted = True
            return False
        layout.samples.clear()
        layout.doubted = False
        if not layout.refuses(bytes_per_token):
            layout.refused = [*layout.refused, bytes_per_token][-REFUSED_KEPT:]
        return True

    def restored(self, fingerprint: str | None) -> None:
        """The server loaded a file of this model: a refusal before it was no news of the layout either."""
        layout = self.layouts.get(fingerprint) if fingerprint is not None else None
        if layout is not None:
            layout.doubted = False

    def restarted(self) -> None:
        """The server was (re)started: its slots' contexts are read again (`GET /slots`, `/props`), and its layout
        is known again from its next save (it may have another cache type now)."""
        self.slot_ctx.clear()
        for layout in self.layouts.values():
            layout.samples.clear()
            layout.doubted = False

    def context(self, model: str | None, slot_id: int) -> int | None:
        return self.slot_ctx.get((model, slot_id), self.n_ctx)

    def fits(self, entry: MetaEntry, model: str | None, slot_id: int) -> bool:
        """Whether the slot `slot_id` (of `model` on a router) can load the entry's file: it fits its context, and
        its layout is not known to be another than the server's."""
        n_ctx = self.context(model, slot_id)
        if n_ctx is not None and entry.n_tokens is not None and entry.n_tokens > n_ctx:
            return False
        if entry.fingerprint is None:
            return True
        layout = self.layouts.get(entry.fingerprint)
        return layout is None or layout.loads(entry.n_tokens, entry.size)
