"""Consistency models: the staleness of a push against the tensors it carries (async, SSP with
refuse, staleness-scaled weights), BSP barriers holding a step's pushes until N workers' are
in, and table reads parked until a BSP step is applied."""
from __future__ import annotations

from gradbus.codecs.errors import Code, WireError


class Consistency:
    def __init__(self, settings, meters, members):
        self.settings = settings
        self.meters = meters
        self.members = members
        self.barriers: dict[str, dict] = {}    # bsp tensor -> the step's held pushes
        self.parked_reads: list = []           # (client, typed ROWS) waiting for a bsp step

    def check(self, tensors: dict, ver: int | None, client):
        """Staleness of a push against each tensor's consistency model: refuses it (STALE),
        returns per-tensor gradient weights (staleness-scaled learning rate) and, for a bsp
        tensor, the barrier to hold it at."""
        weights, barrier = {}, None
        modes = {t.cons["mode"] for t in tensors.values()}
        if "bsp" in modes and len({(t.cons["mode"], t.cons["n"]) for t in tensors.values()}) > 1:
            raise WireError(Code.BAD_REQUEST, "a push with a bsp tensor may only carry tensors "
                                              "of the same bsp setting")
        for name, t in tensors.items():
            if ver is None:
                if t.cons["mode"] == "bsp":
                    raise WireError(Code.BAD_REQUEST, f"{name} is bsp: a push must say which "
                                                      "version it was computed on (ver)")
                continue
            st = max(0, t.version - ver)
            self.meters.h_staleness.observe(st)
            client.staleness = st if client.staleness is None else \
                0.9 * client.staleness + 0.1 * st
            if t.cons["mode"] == "ssp" and t.cons["policy"] == "refuse" and st > t.cons["n"]:
                client.errors[Code.STALE.value] += 1
                raise WireError(Code.STALE, f"{name}: computed on version {ver}, {st} behind "
                                            f"{t.version} (ssp allows {t.cons['n']})")
            if t.cons["mode"] == "bsp":
                if ver < t.version:
                    client.errors[Code.STALE.value] += 1
                    raise WireError(Code.STALE, f"{name}: step {ver} is over (now {t.version})")
                barrier = self.barriers.setdefault(name, {"held": [], "clients": set(),
                                                          "n": t.cons["n"], "tensor": t})
            if t.cons["scale"] and st > 1:
                weights[name] = 1.0 / st
        return weights, barrier

    @staticmethod
    def hold(barrier: dict, client, h, routed: list, weights: dict) -> None:
        barrier["held"].append((client, h, routed, weights))
        barrier["clients"].add(client.identity)

    def release(self, enqueue) -> None:
        """Release every bsp step whose gradients are in: from N workers, or from every
        connected client when fewer than N are connected (workers join and leave between
        steps; one that disappears is forgotten after its liveness window).
        ``enqueue(client, h, routed, weights, step)`` queues a held push."""
        for name, b in list(self.barriers.items()):
            if not b["held"] or len(b["clients"]) < min(b["n"], max(1, len(self.members.clients))):
                continue
            del self.barriers[name]
            for client, h, routed, weights in b["held"]:
                enqueue(client, h, routed, weights, True)
            self.meters.counters["bsp_steps"] += 1

    @staticmethod
    def must_wait(tbl, need) -> bool:
        """A read of a bsp table with ``min`` waits until the table reached that version and no
        step is being applied."""
        return (isinstance(need, int) and tbl.cons["mode"] == "bsp"
                and (tbl.stepping or tbl.version < need))

    def park(self, ident: bytes, h) -> None:
        if len(self.parked_reads) >= self.settings.max_parked_reads:
            raise WireError(Code.BAD_REQUEST, "too many reads waiting for bsp steps")
        self.parked_reads.append((ident, h))

    def wake(self, tables: dict, read) -> list:
        """Forward the parked reads of bsp tables whose step is now applied (``read(client,
        h)`` forwards one)."""
        if not self.parked_reads:
            return []
        actions, keep = [], []
        for ident, h in self.parked_reads:
            tbl = tables.get(h.table)
            client = self.members.clients.get(ident)
            if client is None or tbl is None:
                continue
            if tbl.stepping or tbl.version < h.min:
                keep.append((ident, h))
                continue
            try:
                actions += read(client, h)
            except WireError as e:
                actions.append(self.meters.err(ident, e.code, str(e.args[0]), req=h.req))
        self.parked_reads = keep
        return actions

    def ring_segments(self) -> set[str]:
        """The clients' ring segments the pushes held for bsp steps reference (they are
        sequenced when their step is complete)."""
        return {d["r"][0] for b in self.barriers.values() for _, h, _, _ in b["held"]
                for d in h.t if isinstance(d, dict) and "r" in d}

    def validate_state(self) -> list[str]:
        problems = []
        for name, b in self.barriers.items():
            if not b["clients"] >= {c.identity for c, *_ in b["held"]}:
                problems.append(f"bsp barrier {name} holds pushes of clients it does not count")
        if len(self.parked_reads) > self.settings.max_parked_reads:
            problems.append(f"{len(self.parked_reads)} reads parked")
        return problems
