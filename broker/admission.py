"""Who may say what to the broker's core: the roles an authenticated key needs for each
message (the table is :func:`gradbus.codecs.security.permits`), and the refusal of a REGISTER
that would take over the id of a shard alive on another connection, or (with CURVE) the id
another key registered. Refusals are counted in the core's ``errors`` (by code) and logged
once per kind of refusal. No I/O here.
"""
from __future__ import annotations

import hmac
import logging

from gradbus.codecs import security
from gradbus.codecs.errors import Code

log = logging.getLogger("gradbus.broker")

MAX_LOGGED = 1024    # distinct refusals logged; past that they are still counted, not logged


class Admission:
    def __init__(self, errors):
        self.errors = errors              # the core's errors counter (code -> count)
        self._logged: set[tuple] = set()  # (what, ...) refusals logged once

    def _once(self, key: tuple, msg: str, *args) -> None:
        if key not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add(key)
            log.warning(msg, *args)

    def role_refusal(self, roles, backend: bool, kind: str) -> str | None:
        """None when a message of ``kind`` from a key with ``roles`` (None: CURVE off) may be
        acted on; else the FORBIDDEN message (counted, logged once per kind and roles)."""
        if security.permits(roles, backend, kind):
            return None
        self.errors[Code.FORBIDDEN.value] += 1
        have = ", ".join(sorted(roles)) or "no role"
        msg = (f"{kind} needs {security.needs(backend, kind)}; this connection's CURVE key "
               f"has {have}")
        self._once(("role", backend, kind, frozenset(roles)), "refused on the %s: %s",
                   "backend" if backend else "frontend", msg)
        return msg

    @staticmethod
    def claim(s, identity: bytes, key: str | None, token: bytes | None, now: float,
              deadline: float) -> str | None:
        """Why a REGISTER for shard ``s`` (its record, or None for a new id) from connection
        ``identity`` (CURVE ``key``, None with CURVE off; ``token``, the sending process's)
        may not take the id, else None. A routing id is no credential: what binds a shard's
        name to a connection is an accepted REGISTER, and what lets a new connection take a
        live shard's name is its CURVE key (with CURVE) and the token of the process that
        registered it (the same process reconnecting). It may proceed when the id is new,
        the REGISTER comes on the shard's own connection, its shard is dead or silent past
        ``deadline`` (liveness), or it carries the registered process's token. With CURVE, a
        name is bound to the key that first registered it: another key never takes it."""
        if s is None:
            return None
        if key is not None and s.key is not None and key != s.key:
            return (f"shard id {s.id} is bound to another CURVE key; register this shard "
                    "under another id")
        if (identity == s.identity or not s.alive or now - s.last_seen > deadline
                or (token is not None and s.token is not None
                    and hmac.compare_digest(token, s.token))):
            return None
        return (f"shard id {s.id} is in use by a live shard on another connection (heard "
                f"{now - s.last_seen:.2f}s ago); a replacement may register once that one is "
                f"silent for {deadline:.2f}s")

    def register_refusal(self, s, identity: bytes, key: str | None, token: bytes | None,
                         now: float, deadline: float) -> str | None:
        """None when a REGISTER for shard ``s`` may proceed (see :meth:`claim`); else the
        SHARD_ID_IN_USE message (counted, logged once per shard and connection)."""
        msg = self.claim(s, identity, key, token, now, deadline)
        if msg is None:
            return None
        self.errors[Code.SHARD_ID_IN_USE.value] += 1
        self._once(("register", s.id, identity), "refused a register from %r: %s",
                   identity[:32], msg)
        return msg

    def validate_state(self) -> list[str]:
        return [f"{len(self._logged)} refusals remembered as logged, more than the "
                f"{MAX_LOGGED} bound"] if len(self._logged) > MAX_LOGGED else []
