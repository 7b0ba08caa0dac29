"""Which saved files a server can load into a slot, beyond the model's identity (`backend.model_fingerprint`).

Two things the model's identity does not tell:

- **The KV cache's layout.** llama-server does not say its cache type (`-ctk` / `-ctv`), and a file saved under
  another type is refused on restore (400, "invalid slot save file") after the slot was already cleared. But every
  save reports the tokens it wrote (`n_saved`) and the bytes (`n_written`): bytes per token is the layout's (f16 about
  twice q8_0, q8_0 about 1.9x q4_0, a header of a few hundred bytes spread over the tokens), and a meta entry keeps
  both. Per model identity, a server's layout is learnt from each of its saves; a file whose bytes per token differ
  from it by more than LAYOUT_TOLERANCE is not offered for restore there. A restore the server refuses of a file that
  is present marks that file's layout as not this server's until a save shows it again (a server restarted with
  another cache type is found so before its first save), so one failed restore stops the others of the old type.
- **The slot's context.** A file holding more tokens than the slot's context (`n_ctx` per slot: `/props`'
  `default_generation_settings`, and per slot in `GET /slots`, which may differ between slots) cannot be loaded.

Files without these figures (saved by the Rust lpcache, or by an older lpcache) are offered as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpcache.cache.meta_files import MetaEntry

LAYOUT_MIN_TOKENS = 16     # a file's bytes per token is read only from this many tokens (its header then weighs <5%)
LAYOUT_MIN_BYTES = 256     # bytes per token below which a file is no KV cache's (the stand-in's small files): not read
LAYOUT_TOLERANCE = 0.05    # bytes per token within this share of the server's: the same layout
REFUSED_KEPT = 8           # refused layouts remembered per model identity


def per_token(tokens: int | None, size: int | None) -> float | None:
    """Bytes per token of a saved file, when it holds enough tokens to tell."""
    if not tokens or tokens < LAYOUT_MIN_TOKENS or not size or size < LAYOUT_MIN_BYTES * tokens:
        return None
    return size / tokens


def same_layout(a: float, b: float) -> bool:
    return abs(a - b) <= LAYOUT_TOLERANCE * max(a, b)


@dataclass
class Layout:
    """One model identity's KV layout on one server: the bytes per token of its latest save, and the layouts it
    refused to load since."""

    current: float | None = None
    refused: list[float] = field(default_factory=list)

    def loads(self, bytes_per_token: float | None) -> bool:
        if bytes_per_token is None:
            return True
        if self.current is not None:
            return same_layout(bytes_per_token, self.current)
        return not any(same_layout(bytes_per_token, r) for r in self.refused)


@dataclass
class Loadable:
    """What one backend can load: per model identity its layout, and its slots' contexts (shared by its slots)."""

    n_ctx: int | None = None                                        # a slot's context, from /props
    slot_ctx: dict[tuple[str | None, int], int] = field(default_factory=dict)   # (model, slot id) -> GET /slots
    layouts: dict[str, Layout] = field(default_factory=dict)       # model identity -> layout

    def saved(self, fingerprint: str | None, tokens: int | None, size: int | None) -> None:
        """A save on this server wrote `tokens` in `size` bytes: its layout now."""
        bytes_per_token = per_token(tokens, size)
        if fingerprint is None or bytes_per_token is None:
            return
        layout = self.layouts.setdefault(fingerprint, Layout())
        layout.current = bytes_per_token
        layout.refused = [r for r in layout.refused if not same_layout(r, bytes_per_token)]

    def refused(self, entry: MetaEntry) -> bool:
        """The server refused to load a present file that fits the slot: its layout is taken for not this server's
        (the layout its saves showed included: the server may have been restarted with another cache type) until a
        save shows it again. A file refused for another cause (a broken one) costs the others of its layout no more
        than waiting for the server's next save. True when the file told its layout."""
        bytes_per_token = per_token(entry.n_tokens, entry.size)
        if entry.fingerprint is None or bytes_per_token is None:
            return False
        layout = self.layouts.setdefault(entry.fingerprint, Layout())
        if layout.current is not None and same_layout(layout.current, bytes_per_token):
            layout.current = None
        if not any(same_layout(bytes_per_token, r) for r in layout.refused):
            layout.refused = [*layout.refused, bytes_per_token][-REFUSED_KEPT:]
        return True

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
        return layout is None or layout.loads(per_token(entry.n_tokens, entry.size))
