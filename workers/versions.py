"""Which version each name is at, as far as the consistency models need it.

The broker's consistency model per tensor (learnt from the catalog), the latest version the
broker names in its heartbeats, the version each name was last pulled at, and, for bsp, the
version the next pull waits for. User threads read and write it; the agent only records the
heartbeats' versions.
"""
from __future__ import annotations

from gradbus.codecs import specs


class Versions:
    def __init__(self):
        self.cons: dict[str, dict] = {}         # name -> consistency model (from the broker)
        self.server: dict[str, int] = {}        # name -> version named in heartbeats
        self.pulled: dict[str, int] = {}        # name -> version last returned by a read
        self.bsp_next: dict[str, int] = {}      # name -> version the next read waits for

    def learn(self, t: dict) -> None:
        """Record the model a catalog entry names (one the SDK cannot parse is left out)."""
        try:
            self.cons[t["name"]] = specs.consistency_from_wire(t.get("cons"))
        except ValueError:
            pass

    def modeled(self, names) -> list[str]:
        """The names among ``names`` under a model other than async."""
        cons = self.cons
        return [n for n in names if n in cons and cons[n]["mode"] != "async"]

    def on_heartbeat(self, tv) -> bool:
        """The versions a broker heartbeat names; True when it named any."""
        if not isinstance(tv, dict):
            return False
        self.server.update({k: v for k, v in tv.items()
                            if isinstance(k, str) and isinstance(v, int)})
        return True

    def push_version(self, names: list[str], version: int | None, current) -> int | None:
        """The version a push of ``names`` carries: ``version`` if given, else the oldest its
        modeled names were read at (``current(name)`` for one never pulled); a bsp name's next
        read then waits for the step."""
        modeled = self.modeled(names)
        if version is None and modeled:
            version = min(self.pulled.get(n, current(n)) for n in modeled)
        for n in modeled:
            if self.cons[n]["mode"] == "bsp":
                self.bsp_next[n] = int(version) + 1
        return version

    def needed(self, name: str, min_version: int | None) -> int:
        """The version a pull waits for: the caller's, raised by the tensor's consistency model
        (ssp with policy delay: at most S behind the broker's latest; bsp: past the step this
        client last pushed)."""
        need = -1 if min_version is None else min_version
        cons = self.cons.get(name)
        if cons is None or cons["mode"] == "async":
            return need
        if cons["mode"] == "ssp" and cons["policy"] == "delay" and name in self.server:
            need = max(need, self.server[name] - cons["n"])
        if cons["mode"] == "bsp":
            need = max(need, self.bsp_next.get(name, -1))
        return need
