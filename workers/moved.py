"""A push a broker tier member refused with MOVED (protocol 24.4): its name moved to another
member after the push was encoded. The push's bytes are taken back from the message the
client kept for resends (out of its push ring where they went there), so the tier client can
send them, unchanged, to the member that holds the name now."""
from __future__ import annotations

from gradbus.codecs import wire

_KINDS = frozenset({wire.PUSH, wire.INIT})


def moved_push(frames: list, shm) -> dict | None:
    """``frames`` (a PUSH as sent) as :meth:`Client._submit_push` takes it again: descriptors
    without ring refs, each tensor's bytes, ``acks`` and the version claimed. None when they
    cannot be read back (a ring slot already reused), or for an INIT (refused whole: the
    caller learns where its names are)."""
    h = wire.unpack_header(frames[0], _KINDS)
    if h["kind"] != wire.PUSH:
        return None
    t = [dict(d) for d in h.get("t", [])]
    bufs = list(frames[1:])
    if any("r" in d for d in t):
        if shm is None:
            return None
        try:
            wire.resolve_refs(t, bufs, shm.mapper)
        except Exception:      # noqa: BLE001 - a ring that cannot be read: not resent
            return None
    for d in t:
        d.pop("r", None)
    extra = {"ver": h["ver"]} if isinstance(h.get("ver"), int) else {}
    return {"descs": t, "bufs": [bytes(wire.frame_buffer(b)) for b in bufs],
            "acks": h.get("acks", 1), "extra": extra}
