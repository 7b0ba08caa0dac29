"""What a slot's state is in Redis and the Lua scripts that change it: a claim takes the lease and reads the slot's
state, a release writes the new state and drops the lease together, a republish writes again what this replica
holds. A slot's content travels as a small JSON document (`content_doc`, `content_of`)."""

from __future__ import annotations

from typing import Any

import orjson

from lpcache.backends.placement import Want
from lpcache.backends.slots import Content, Slot
from lpcache.fleet.leases import GRANT

# Claim: the lease (as leases._ACQUIRE does), the last token granted on this slot before, and the slot's state in the
# map, which then says the slot is busy with this replica's request (written the shared map's way, so every mirror
# learns it). KEYS: lease, token counter, granted hash, slots hash, version counter, change stream. ARGV: value
# after the token, ttl ms, slot name, replica, maxlen, what the request will leave in the slot (JSON). A lease that
# already names this holder is its own grant (the client sent the call again when the first answer was lost): its
# token is returned, with the state this claim wrote (busy: what the slot held is then unknown).
CLAIM = """
local held = redis.call('GET', KEYS[1])
if held then
  local at = string.find(held, ' ', 1, true)
  if at and string.sub(held, at + 1) == ARGV[1] then
    return {string.sub(held, 1, at - 1), '', redis.call('HGET', KEYS[4], ARGV[3]) or ''}
  end
  return {0, redis.call('PTTL', KEYS[1])}
end
""" + GRANT + """
local before = redis.call('HGET', KEYS[3], ARGV[3]) or ''
redis.call('HSET', KEYS[3], ARGV[3], text)
local state = redis.call('HGET', KEYS[4], ARGV[3]) or ''
local v = redis.call('INCR', KEYS[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'ns', 'slots', 'key', ARGV[3], 'op', 'put',
           'replica', ARGV[4], 'version', v)
redis.call('HSET', KEYS[4], ARGV[3],
           v .. ':{"token":' .. text .. ',"replica":"' .. ARGV[4] .. '","busy":true,"pending":' .. ARGV[6] .. '}')
return {text, before, state}
"""
# Release (ARGV[6] "1"), or a new phase of the holder's work ("0"): only while the lease is this one's, write the
# slot's state the shared map's way (and delete the lease). KEYS: lease, version counter, change stream, slots hash.
# ARGV: lease value, replica, maxlen, slot name, payload, release.
# A slot's state written the shared map's way (its version, the change stream, the hash), from the locals counter,
# stream, slots, name, payload, maxlen and replica: one fragment for the scripts below.
PUT_STATE = """
local v = redis.call('INCR', counter)
redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'ns', 'slots', 'key', name, 'op', 'put',
           'replica', replica, 'version', v)
redis.call('HSET', slots, name, v .. ':' .. payload)
return v
"""
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[6] == '1' then redis.call('DEL', KEYS[1]) end
local counter, stream, slots, name, payload, maxlen, replica = KEYS[2], KEYS[3], KEYS[4], ARGV[4], ARGV[5], ARGV[3],
  ARGV[2]
""" + PUT_STATE


# A slot's state written again after Redis lost its data (`republish`), the map's way, unless the slot is leased now
# or Redis already has a state of a newer token (another replica's, written since: last-writer-wins would bring an
# older belief back). KEYS: version counter, change stream, slots hash, lease. ARGV: slot name, payload, its token,
# maxlen, replica.
REPUBLISH = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local cur = redis.call('HGET', KEYS[3], ARGV[1])
if cur then
  local at = string.find(cur, ':', 1, true)
  local ok, doc = pcall(cjson.decode, string.sub(cur, (at or 0) + 1))
  if ok and type(doc) == 'table' and tonumber(doc['token'] or 0) >= tonumber(ARGV[3]) then return 0 end
end
local counter, stream, slots, name, payload, maxlen, replica = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[4],
  ARGV[5]
""" + PUT_STATE


def content_doc(content: Content | None) -> dict[str, Any] | None:
    """What another replica needs of a slot's content to choose slots and to save it before replacing it."""
    if content is None:
        return None
    return {"key": content.key, "chain": list(content.chain), "saved": content.saved, "keep": content.keep,
            "session": content.session, "model": content.model, "tokens": content.tokens,
            "fingerprint": content.fingerprint}


def pending_doc(want: Want | None, restore: str | None, slot: Slot | None = None,
                writes: Content | None = None) -> dict[str, Any] | None:
    """What a claim tells the other replicas of the request that will hold `slot`: what it will leave there (under
    the name its save will write), its max_tokens (for their wait plans) and the file it restores first; for
    lpcache's own save of an idle slot, the cache it `writes`."""
    pending = content_doc(want.pending(slot) if want is not None else writes)
    if pending is not None and want is not None and want.answer_tokens:
        pending["answer_tokens"] = want.answer_tokens
    if pending is not None and restore is not None:
        pending["restore"] = restore
    return pending


def content_of(doc: Any) -> Content | None:
    """A slot's content as another replica described it (its prompt is not shared: an unsaved prefix cache of
    another replica is not saved again here, only ever replaced)."""
    if not isinstance(doc, dict):
        return None
    try:
        session = doc.get("session")
        return Content(str(doc["key"]), tuple(int(d) for d in doc["chain"]), saved=bool(doc.get("saved")),
                       keep=bool(doc.get("keep")) and session is not None, session=session,
                       model=str(doc.get("model") or ""),
                       tokens=doc.get("tokens") if isinstance(doc.get("tokens"), int) else None,
                       fingerprint=doc.get("fingerprint"))
    except (KeyError, TypeError, ValueError):
        return None


def trusted(before: str, state: str) -> dict[str, Any] | None:
    """The slot's state as a claim read it, when it says what the slot holds: written by the holder of the grant
    before (`before`; empty: unknown) and not busy. None when that holder never said (it died mid-request)."""
    _, _, payload = state.partition(":")
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("busy") or (before and str(doc.get("token")) != before):
        return None
    return doc


def text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
