"""Who may say what to the broker's core: the roles an authenticated key needs for each
message (the table is :func:`gradbus.codecs.security.permits`), and the refusal of a REGISTER
that would take over the id of a shard alive on another connection. Refusals are counted in
the core's ``errors`` (by code) and logged once per kind of refusal. No I/O here.
"""
from __future__ import annotations

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
    def takes_over(s, identity: bytes, now: float, deadline: float) -> bool:
        """Whether a REGISTER for shard ``s`` (its record, or None for a new id) from
        ``identity`` would take the id of a shard alive on another connection. It may proceed
        when the id is new, its shard is dead, the REGISTER comes on the shard's own
        connection (its routing id: a restart or reconnect, which ROUTER_HANDOVER makes the
        only connection with that id), or the shard's connection has been silent past
        ``deadline`` (liveness)."""
        return not (s is None or not s.alive or identity == s.identity
                    or now - s.last_seen > deadline)

    def register_refusal(self, s, identity: bytes, now: float, deadline: float) -> str | None:
        """None when a REGISTER for shard ``s`` from ``identity`` may proceed (see
        :meth:`takes_over`); else the SHARD_ID_IN_USE message (counted, logged)."""
        if not self.takes_over(s, identity, now, deadline):
            return None
        self.errors[Code.SHARD_ID_IN_USE.value] += 1
        msg = (f"shard id {s.id} is in use by a live shard on another connection (heard "
               f"{now - s.last_seen:.2f}s ago); a replacement may register once that one is "
               f"silent for {deadline:.2f}s")
        self._once(("register", s.id, identity), "refused a register from %r: %s",
                   identity[:32], msg)
        return msg

    def validate_state(self) -> list[str]:
        return [f"{len(self._logged)} refusals remembered as logged, more than the "
                f"{MAX_LOGGED} bound"] if len(self._logged) > MAX_LOGGED else []
