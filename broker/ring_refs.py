"""What the broker's entries still reference in clients' shared-memory rings.

A push whose tensors are in its client's ring (a descriptor's ``r``: ``[segment, offset]``)
holds its slots, and the ring segments they lie in, while any of its entries is queued or in a
batch some in-sync replica has not applied (protocol section 21). :class:`RingRefs` counts
both, per push and per segment:

* a push's count reaching 0 puts it in :attr:`RingRefs.freed` (the core tells its client with
  FREE that the slots may be reused);
* a segment with a count is never removed, even when its owner is dead
  (:meth:`RingRefs.referenced`): the loop's sweep removes a dead client's segment as soon as
  its count is 0, whatever other clients have in flight;
* a segment the sweep removed is remembered (:attr:`RingRefs.swept`, the last
  :data:`MAX_SWEPT`): a push naming one (sent by a client just before it died, read after the
  sweep) is refused before any replica could read it, so replicas never split over a ring
  that one of them still had mapped and another could no longer open.

No I/O here.
"""
from __future__ import annotations

from collections import OrderedDict

from gradbus.codecs.errors import Code, WireError

MAX_SWEPT = 4096      # removed segment names remembered (a dead client's last pushes arrive
                      # within a loop turn or two of its death, long before this many sweeps)


class RingRefs:
    def __init__(self):
        self.live: dict[tuple, int] = {}     # push ref -> its entries still reading the ring
        self.segs: dict[str, int] = {}       # ring segment -> entries still referencing it
        self.freed: list[tuple] = []         # pushes whose ring slots nobody needs any more
        self.swept: OrderedDict[str, None] = OrderedDict()    # removed segments, oldest first

    def hold(self, ref: tuple, seg: str) -> None:
        """One entry of push ``ref`` references segment ``seg``."""
        self.live[ref] = self.live.get(ref, 0) + 1
        self.segs[seg] = self.segs.get(seg, 0) + 1

    def release(self, pairs) -> None:
        """Entries ``(push ref, segment)`` that no longer reference the ring (applied by every
        replica that waited for them, or failed)."""
        live, segs = self.live, self.segs
        for ref, seg in pairs:
            n = live[ref] - 1
            if n:
                live[ref] = n
            else:
                del live[ref]
                self.freed.append(ref)
            n = segs[seg] - 1
            if n:
                segs[seg] = n
            else:
                del segs[seg]

    def referenced(self, seg: str) -> bool:
        return seg in self.segs

    def removed(self, names) -> None:
        """The loop's sweep removed these segments."""
        for name in names:
            self.swept[name] = None
            self.swept.move_to_end(name)
        while len(self.swept) > MAX_SWEPT:
            self.swept.popitem(last=False)

    def check(self, descs) -> None:
        """Refuse (BAD_FIELD) a message whose descriptors reference a segment swept already."""
        if not self.swept:
            return
        for d in descs:
            if d.ref is not None and d.ref[0] in self.swept:
                raise WireError(Code.BAD_FIELD, f"{d.key}: segment {d.ref[0]} is gone (its "
                                                "owner died)")

    def validate_state(self, pairs) -> list[str]:
        """``pairs``: every ``(push ref, segment)`` the queued and in-flight entries hold."""
        live: dict = {}
        segs: dict = {}
        for ref, seg in pairs:
            live[ref] = live.get(ref, 0) + 1
            segs[seg] = segs.get(seg, 0) + 1
        problems = []
        if live != self.live:
            problems.append(f"shared-memory refs held {self.live}, entries hold {live}")
        if segs != self.segs:
            problems.append(f"ring segments held {self.segs}, entries hold {segs}")
        if len(self.swept) > MAX_SWEPT:
            problems.append(f"{len(self.swept)} swept segments remembered, more than "
                            f"{MAX_SWEPT}")
        return problems
