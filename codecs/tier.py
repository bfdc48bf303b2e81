"""A broker tier's map: which broker of the tier sequences each tensor and table.

A tier is B brokers (each one broker, or a broker pair), each with shards of its own. Every
name (a dense tensor, an embedding table) has a *home partition*, CRC-32 of the name mod P, and
the tier's map gives each of the P home partitions one member: that member alone accepts
the name's inits and pushes and serves its weights, so every per-partition guarantee of one
broker (order, acks, the duplicate window, replicas, staleness) holds unchanged. The map is
versioned and answered by every member (WELCOME, STATUS); a member refuses a write for a name
it does not hold with ``MOVED``, naming the member that does (protocol section 24).

Members are written as the SDK and shards take a broker: one client URL, or a pair's two
comma-separated. The first map (version 1) spreads home partitions round-robin,
``p mod B``; CRC-32 spreads names that differ in their last characters evenly over it.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass

from .partition import split_key, split_row_key

MAX_MEMBERS = 64


def home_of(name: str, partitions: int) -> int:
    """The home partition of tensor or table ``name``."""
    return zlib.crc32(name.encode("utf-8")) % partitions


def name_of(key: str) -> str:
    """The tensor or table a wire key belongs to: ``"w/3"`` -> ``"w"``, ``"emb#5"`` ->
    ``"emb"``; any other key is its own name."""
    row = split_row_key(key)
    if row is not None:
        return row[0]
    try:
        return split_key(key)[0]
    except ValueError:
        return key


def parse_member(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip() for u in str(text).split(",") if u.strip())
    if not 1 <= len(urls) <= 2 or not all(u.startswith(("tcp://", "ipc://")) for u in urls):
        raise ValueError(f"a tier member is one broker's client URL or a pair's two, "
                         f"comma-separated (tcp://HOST:PORT), not {text!r}")
    return urls


@dataclass(frozen=True)
class TierMap:
    version: int
    members: tuple[tuple[str, ...], ...]    # each member's client URLs (one, or a pair's two)
    owners: tuple[int, ...]                 # home partition -> member index

    @classmethod
    def spread(cls, members, partitions: int) -> "TierMap":
        """Version 1: home partition p to member p mod B."""
        ms = tuple(m if isinstance(m, tuple) else parse_member(m) for m in members)
        if not 1 <= len(ms) <= MAX_MEMBERS:
            raise ValueError(f"a tier has 1 to {MAX_MEMBERS} members, not {len(ms)}")
        if len({u for m in ms for u in m}) != sum(len(m) for m in ms):
            raise ValueError("a tier names each broker once")
        if partitions < len(ms):
            raise ValueError(f"{len(ms)} tier members need at least as many partitions "
                             f"(--partitions {partitions})")
        return cls(1, ms, tuple(p % len(ms) for p in range(partitions)))

    @property
    def partitions(self) -> int:
        return len(self.owners)

    def owner(self, name: str) -> int:
        return self.owners[home_of(name, len(self.owners))]

    def moved(self, homes, to: int, members=None) -> "TierMap":
        """The next version: ``homes`` given to member ``to`` (of ``members``: this map's,
        or those with new ones added at the end)."""
        ms = self.members if members is None else tuple(members)
        own = list(self.owners)
        for h in homes:
            own[h] = to
        return TierMap(self.version + 1, ms, tuple(own))

    def homes(self, i: int) -> list[int]:
        """The home partitions member ``i`` holds."""
        return [h for h, o in enumerate(self.owners) if o == i]

    def url(self, i: int) -> str:
        """Member ``i`` as a client takes it (a pair's URLs comma-separated)."""
        return ",".join(self.members[i])

    def share(self, i: int) -> int:
        """How many home partitions member ``i`` holds."""
        return sum(1 for o in self.owners if o == i)

    def to_wire(self) -> dict:
        return {"v": self.version, "members": [list(m) for m in self.members],
                "owners": bytes(self.owners)}      # member indices < MAX_MEMBERS: a byte each

    @classmethod
    def from_wire(cls, d) -> "TierMap":
        """A map as WELCOME or STATUS carry it; ValueError if it does not hold together."""
        try:
            version, members, owners = int(d["v"]), d["members"], d["owners"]
            ms = tuple(parse_member(",".join(m)) for m in members)
            own = tuple(int(o) for o in owners)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a tier map: {e}") from None
        if version < 1 or not ms or not own or any(not 0 <= o < len(ms) for o in own):
            raise ValueError("not a tier map: version, members or owners out of range")
        return cls(version, ms, own)

    def to_json(self) -> dict:
        """The map as JSON takes it (status, the map file)."""
        return {"v": self.version, "members": [list(m) for m in self.members],
                "owners": list(self.owners)}

    def save(self, path: str) -> None:
        """Write the map to ``path`` (whole or not at all: a temporary file renamed)."""
        tmp = f"{path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "TierMap | None":
        """The map kept at ``path``; None where there is none yet; ValueError for a file
        that holds no map."""
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a tier map ({e})") from None
        return cls.from_wire(d)

    def describe(self) -> list[dict]:
        """Each member and its share of home partitions, for status."""
        return [{"member": i, "urls": list(m), "partitions": self.share(i)}
                for i, m in enumerate(self.members)]


__all__ = ["TierMap", "home_of", "name_of", "parse_member"]
