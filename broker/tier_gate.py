"""A broker tier's member (protocol section 24): the tier's map, which member this broker
is, and the refusal of what another member holds. Alone (no tier) it lets everything by."""
from __future__ import annotations

from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.tier import TierMap, name_of


class TierGate:
    def __init__(self, tier: TierMap | None, index: int, partitions: int, counters):
        if tier is not None and (tier.partitions != partitions
                                 or not 0 <= index < len(tier.members)):
            raise ValueError("a tier map has one owner per partition, and names this broker")
        self.tier, self.index, self.counters = tier, index, counters

    def wire(self) -> dict:
        """WELCOME's tier fields: the map and which member this broker is (none alone)."""
        if self.tier is None:
            return {}
        return {"tier": self.tier.to_wire(), "tier_at": self.index}

    def check(self, names) -> None:
        """The names of a write are all this member's, else MOVED (nothing of it kept),
        naming the member that holds the first one that is not."""
        tm = self.tier
        if tm is None:
            return
        for name in names:
            if isinstance(name, str) and (i := tm.owner(name)) != self.index:
                self.counters["tier_moved"] += 1
                raise WireError(Code.MOVED, f"{name!r} is held by tier member {i} "
                                            f"({tm.url(i)}), not by this one "
                                            f"({self.index}); tier map v{tm.version}")

    def check_keys(self, descs) -> None:
        """A PUSH's tensor descriptors."""
        if self.tier is not None:
            self.check(name_of(d.key) for d in descs)

    def check_init(self, h) -> None:
        """An INIT's tensors and tables."""
        if self.tier is not None:
            tables = h.tables if isinstance(h.tables, (list, tuple)) else ()
            self.check(getattr(t, "name", None) for t in (*h.tensors, *tables))

    def check_catalog(self, names, catalog) -> None:
        """A CATALOG's names the catalog does not know."""
        if self.tier is not None and names:
            self.check(n for n in names if n not in catalog.tensors and n not in catalog.tables)

    def status(self) -> dict | None:
        """STATUS's ``tier``: which member, the map's version and each member's share."""
        tm = self.tier
        if tm is None:
            return None
        return {"member": self.index, "version": tm.version, "members": tm.describe()}
