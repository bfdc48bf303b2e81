"""A broker tier's member (protocol section 24): the tier's map, which member this broker
is, and the refusal of what another member holds. Alone (no tier) it lets everything by."""
from __future__ import annotations

import logging

from gradbus.codecs.errors import Code, WireError
from gradbus.codecs.tier import TierMap, home_of, name_of

log = logging.getLogger("gradbus.broker")


class TierGate:
    def __init__(self, tier: TierMap | None, index: int, partitions: int, counters,
                 map_file: str | None = None):
        """``map_file``: where the map is kept, written whenever a newer one is taken."""
        if tier is not None and (tier.partitions != partitions
                                 or not 0 <= index < len(tier.members)):
            raise ValueError("a tier map has one owner per partition, and names this broker")
        self.tier, self.index, self.counters = tier, index, counters
        self.incoming: set[int] = set()   # home partitions moving here (24.4): RECOVERING
        self.map_file = map_file
        if tier is not None and map_file:
            tier.save(map_file)

    def owns(self, name: str) -> bool:
        """Whether this member holds ``name`` by its map (alone: every name)."""
        return self.tier is None or self.tier.owner(name) == self.index

    def incoming_name(self, name: str) -> bool:
        tm = self.tier
        if tm is None:
            return False
        h = home_of(name, tm.partitions)
        return h in self.incoming and tm.owners[h] == self.index

    def adopt(self, tm: TierMap, incoming=()) -> None:
        """A newer map from the mover (or the same one again): taken when it keeps this
        member's place and the tier's partitions; ``incoming``: home partitions it gives this
        member that are still moving here (refused RECOVERING until :meth:`commit`)."""
        cur = self.tier
        if tm.partitions != cur.partitions:
            raise WireError(Code.BAD_REQUEST, f"tier: a map of {tm.partitions} partitions, "
                                              f"not {cur.partitions}")
        if tm.members[:len(cur.members)] != cur.members:
            raise WireError(Code.BAD_REQUEST, "tier: a map that does not keep every member "
                                              "in its place")
        if tm.version < cur.version or (tm.version == cur.version and tm != cur):
            raise WireError(Code.BAD_REQUEST, f"tier: map v{tm.version} is not newer than "
                                              f"this member's v{cur.version}")
        bad = [h for h in incoming if not 0 <= h < tm.partitions or tm.owners[h] != self.index]
        if bad:
            raise WireError(Code.BAD_REQUEST, f"tier: incoming home partitions {bad[:8]} are "
                                              f"not this member's in map v{tm.version}")
        if tm.version > cur.version:
            log.info("tier map v%d taken (was v%d)", tm.version, cur.version)
            self.counters["tier_maps"] += 1
            if self.map_file:
                tm.save(self.map_file)       # before anything acts on it
        self.tier = tm
        self.incoming.update(incoming)

    def commit(self, homes) -> None:
        """Home partitions moved here whose names are all in: this member's from now on."""
        self.incoming.difference_update(homes)

    def wire(self) -> dict:
        """WELCOME's tier fields: the map and which member this broker is (none alone)."""
        if self.tier is None:
            return {}
        return {"tier": self.tier.to_wire(), "tier_at": self.index}

    def table_fields(self) -> dict:
        """TABLE's ``tier``: the map, so clients follow a move at once (none alone)."""
        return {} if self.tier is None else {"tier": self.tier.to_wire()}

    def check(self, names) -> None:
        """The names of a write are all this member's, else MOVED (nothing of it kept),
        naming the member that holds the first one that is not."""
        tm = self.tier
        if tm is None:
            return
        for name in names:
            if not isinstance(name, str):
                continue
            h = home_of(name, tm.partitions)
            if h in self.incoming:
                raise WireError(Code.RECOVERING, f"{name!r} is moving to this tier member "
                                                 f"(map v{tm.version}): send it again shortly")
            if (i := tm.owners[h]) != self.index:
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
        return {"member": self.index, "version": tm.version, "members": tm.describe(),
                "incoming": sorted(self.incoming),
                "map": tm.to_json()}
