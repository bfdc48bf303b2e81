"""Moving names between the members of a broker tier (protocol section 24.4): the mover
behind ``gradbus tier move``, ``rebalance`` and ``drain``.

A move of home partitions H from member A to member B takes A's names of H whole (values,
optimizer state, versions, table rows) into B's shards, while clients keep pushing: B is told
first (its names of H answer RECOVERING, so clients send again shortly), A is fenced (MOVED
from then on; answered once what it accepted of them is applied), each partition's share is
exported from A's primary and imported into B's partitions through B's sequencer (every
replica, in order), then B takes H, every member learns the new map, and A forgets the names.
Each step may be run again: a mover that died is finished by running the same command again.
"""
from __future__ import annotations

import itertools
import time

import msgpack
import numpy as np
import zmq

from gradbus.codecs import messages, security, wire
from gradbus.codecs.errors import Code, GradbusError, error_from
from gradbus.codecs.partition import split_row_key
from gradbus.codecs.tier import TierMap, home_of, parse_member

from .admin import Unanswered, _request_all, status

IMPORT_BYTES = 32 << 20      # exported bytes per import message (at least one entry)
_reqs = itertools.count(int(time.time() * 1e6))


def current_map(url: str, timeout: float = 5.0, curve=None) -> TierMap:
    """The newest map any member holds, asked through the member at ``url``."""
    tm = _map_of(status(url, timeout, curve))
    for i in range(len(tm.members)):
        try:
            got = _map_of(status(tm.url(i), timeout, curve))
        except GradbusError:
            continue
        if got.version > tm.version:
            tm = got
    return tm


def _map_of(st: dict) -> TierMap:
    w = (st.get("tier") or {}).get("map")
    if w is None:
        raise GradbusError("the broker is not a tier member (its status names no tier map)")
    return TierMap.from_wire(w)


def learn_map(tm: TierMap, index: int, map_file: str | None = None, curve=None,
              timeout: float = 2.0) -> TierMap:
    """A member starting: the newest of its command line's map ``tm``, the one kept in
    ``map_file`` and those the other members answer with (each asked for ``timeout``
    seconds, together). A newer map must keep every member of ``tm`` that it names in place;
    one naming fewer members (this one not joined yet) gives this member nothing."""
    from concurrent.futures import ThreadPoolExecutor
    found = []
    if map_file:
        kept = TierMap.load(map_file)
        if kept is not None:
            found.append(kept)
    others = [tm.url(i) for i in range(len(tm.members)) if i != index]

    def ask(url):
        try:       # one of a pair's brokers at a time; nothing listening: not waited for
            for one in url.split(","):
                try:
                    st = _request_all(one, wire.STATUS, timeout, curve, {},
                                      refused_fast=True)[0]["status"]
                    return _map_of(st)
                except GradbusError as e:
                    if e.code != Code.NOT_ACTIVE and not isinstance(e, Unanswered):
                        raise
            return None
        except (GradbusError, ValueError):
            return None
    if others:
        with ThreadPoolExecutor(len(others)) as pool:
            found += [m for m in pool.map(ask, others) if m is not None]
    best = tm
    for m in found:
        n = min(len(m.members), len(tm.members))
        if m.members[:n] != tm.members[:n]:
            raise ValueError(f"a tier map v{m.version} names other members than --tier: "
                             f"{[list(x) for x in m.members]}")
        if m.version > best.version or (best is tm and m.version == tm.version
                                        and len(m.members) < len(tm.members)):
            best = m
    if len(best.members) < len(tm.members):    # not joined yet: a place, and no name
        best = TierMap(best.version, tm.members, best.owners)
    return best


class _Member:
    """One DEALER to one member (one identity for every step sent to it)."""

    def __init__(self, url: str, curve, timeout: float):
        self.url, self.timeout = url.split(",")[0], timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if curve is not None:
            security.client_setup(self.sock, curve)
        self.sock.connect(self.url)

    def ask(self, kind: str, frames=(), t=None, **fields) -> tuple[dict, list]:
        """One request (an INIT keyed by ``msg``, else ``req``) and its answer: header and
        frames; RECOVERING (the member not ready yet) is asked again until the timeout."""
        key = "msg" if kind == wire.INIT else "req"
        deadline = time.monotonic() + self.timeout
        while True:
            ident = next(_reqs)
            head = wire.pack(kind, t, **{key: ident}, **fields) if t else \
                wire.pack(kind, **{key: ident}, **fields)
            self.sock.send_multipart([head, *frames], copy=False)
            h, got = self._answer(key, ident, deadline, kind)
            if h.get("kind") != wire.ERROR:
                return h, got
            if h.get("code") != Code.RECOVERING.value or time.monotonic() + 0.2 > deadline:
                raise error_from(h["code"], h["message"])
            time.sleep(0.2)

    def _answer(self, key: str, ident: int, deadline: float, kind: str) -> tuple[dict, list]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise Unanswered(f"no answer from tier member {self.url} to a {kind} "
                                 f"within {self.timeout:.0f}s")
            got = self.sock.recv_multipart(copy=False)
            h = msgpack.unpackb(got[0].bytes, raw=False)
            if h.get(key) == ident:
                return h, [f.buffer for f in got[1:]]

    def tier(self, step: str, **fields) -> dict:
        return self.ask(wire.ADMIN, op="tier", step=step, **fields)[0]["result"]

    def close(self) -> None:
        self.sock.close(linger=0)


def _imports(state: dict, frames: list, versions: dict):
    """A STATE's blocks and rows as import entries, each one raw frame: ``(entries, descs,
    frames)``."""
    m = messages.from_header(state)
    descs = m.descs(frames, 1 << 62)
    pos, out = 0, []
    for meta in m.blocks:
        n = meta.nframes
        arrs = [np.asarray(wire.decode_tensor(d, f, 1 << 62))
                for d, f in zip(descs[pos:pos + n], frames[pos:pos + n])]
        pos += n
        if isinstance(meta, messages.StateRows):
            names = list(meta.arrays)
            ent = {"key": meta.key, "table": meta.table,
                   "version": versions.get(split_row_key(meta.key)[0], 0),
                   "st": {"version": int(meta.scalars.get("version", 0)),
                          "scalars": meta.scalars}}
        else:
            names = ["", *meta.arrays]
            ent = {"key": meta.key, "layout": meta.layout.to_wire(), "opt": meta.opt,
                   "cons": versions.get(("cons", meta.layout.name)),
                   "st": {"version": meta.version, "scalars": meta.scalars}}
        ent["st"]["arrays"] = [[nm, a.dtype.str, list(a.shape)] for nm, a in zip(names, arrs)]
        flat = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                               for a in arrs]) if arrs else np.zeros(0, np.uint8)
        d, buf = wire.encode_tensor(meta.key, flat, "raw")
        out.append((ent, d, buf))
    return out


def move(url: str, homes, to: int, *, curve=None, timeout: float = 60.0,
         progress=None) -> dict:
    """Move home partitions ``homes`` to member ``to`` (first finishing any move a member
    still waits on); returns what moved. ``progress``: called with a line per step."""
    say = progress or (lambda line: None)
    tm = current_map(url, min(timeout, 5.0), curve)
    if not 0 <= to < len(tm.members):
        raise ValueError(f"the tier has members 0..{len(tm.members) - 1}, not {to}")
    homes = sorted(set(int(h) for h in homes))
    if any(not 0 <= h < tm.partitions for h in homes):
        raise ValueError(f"home partitions are 0..{tm.partitions - 1}")
    conns = [_Member(tm.url(i), curve, timeout) for i in range(len(tm.members))]
    done = {"names": [], "bytes": 0, "version": tm.version}
    try:
        _finish(conns, tm, min(timeout, 5.0), curve, say, done)
        by_src: dict[int, list[int]] = {}
        for h in homes:
            if tm.owners[h] != to:
                by_src.setdefault(tm.owners[h], []).append(h)
        for src, hs in sorted(by_src.items()):
            new = tm.moved(hs, to)
            say(f"map v{new.version}: {len(hs)} home partitions {src} -> {to}")
            conns[to].tier("map", map=_wire(new), incoming=hs)
            _transfer(conns, new, src, to, hs, say, done)
            _commit(conns, new, to, hs, say)
            tm = new
        done["version"] = tm.version
        return done
    finally:
        for c in conns:
            c.close()


def _wire(tm: TierMap) -> dict:
    return tm.to_json()


def _finish(conns, tm: TierMap, timeout: float, curve, say, done) -> None:
    """A move a member still waits on (``incoming`` in its status: a mover that died):
    whatever any other member still holds of those home partitions goes there now. Then
    names a member holds that the map gives another member that does not hold them (a
    member's shards restored from a checkpoint older than a move) go to that member; a name
    both hold is left where it is and named in ``done["conflicts"]``."""
    def statuses():
        out = []
        for c in conns:
            try:
                out.append(status(c.url, timeout, curve))
            except GradbusError:
                out.append(None)
        return out
    sts, finished = statuses(), False
    for to, st in enumerate(sts):
        inc = ((st or {}).get("tier") or {}).get("incoming") or []
        if not inc:
            continue
        say(f"finishing the move of {len(inc)} home partitions to member {to}")
        for src in range(len(conns)):
            if src != to:
                _transfer(conns, tm, src, to, inc, say, done)
        _commit(conns, tm, to, inc, say)
        finished = True
    held = [None if st is None else _names(st) for st in (statuses() if finished else sts)]
    for src, names in enumerate(held):
        for to in range(len(conns)):
            if names is None or to == src or held[to] is None:
                continue
            stray = sorted(n for n in names if tm.owner(n) == to)
            both = [n for n in stray if n in held[to]]
            done.setdefault("conflicts", []).extend(both)
            homes = sorted({home_of(n, tm.partitions) for n in stray if n not in both})
            if not homes:
                continue
            say(f"member {src} holds {len(stray) - len(both)} names of member {to}: moving "
                f"them home")
            conns[to].tier("map", map=_wire(tm), incoming=homes)
            _transfer(conns, tm, src, to, homes, say, done, skip=set(both))
            _commit(conns, tm, to, homes, say)


def _names(st: dict) -> set:
    return {t["name"] for t in (*st.get("tensors", ()), *st.get("tables", ()))}


def _transfer(conns, new: TierMap, src: int, to: int, hs: list, say, done,
              skip=frozenset()) -> None:
    """Fence ``src`` with map ``new``, take its names of home partitions ``hs`` (but
    ``skip``) into ``to`` (told already), partition by partition."""
    a, b = conns[src], conns[to]
    held = a.tier("fence", map=_wire(new))
    names = [t["name"] for t in (*held["tensors"], *held["tables"])
             if home_of(t["name"], new.partitions) in hs and t["name"] not in skip]
    extra = {t["name"]: t["version"] for t in held["tables"]}
    extra.update({("cons", t["name"]): t.get("cons") for t in held["tensors"]})
    parts = held["parts"] if names else []
    for k, p in enumerate(parts):
        state, frames = a.ask(wire.ADMIN, op="tier", step="export", p=p, names=names)
        done["bytes"] += _send_imports(b, _imports(state, frames, extra))
        say(f"  partition {p}: {src} -> {to} ({k + 1}/{len(parts)})")
    if names:
        a.ask(wire.INIT, opt=_ANY_OPT, tensors=[], drop=names)
    done["names"] += names


def _commit(conns, new: TierMap, to: int, hs: list, say) -> None:
    """``hs`` are member ``to``'s now; every member learns the map."""
    conns[to].tier("commit", homes=hs)
    for i, c in enumerate(conns):
        if i != to:
            try:
                c.tier("map", map=_wire(new))
            except Unanswered:
                say(f"  member {i} did not answer: it learns map v{new.version} from the "
                    f"others when it starts")
    say(f"map v{new.version}: home partitions {hs[:8]}{'...' if len(hs) > 8 else ''} on "
        f"member {to}")


_ANY_OPT = {"name": "sgd", "lr": 0.01}    # an INIT's required field; a move's INIT ignores it


def _send_imports(b: _Member, items: list) -> int:
    total, chunk, size = 0, [], 0
    for item in [*items, None]:
        if item is not None:
            chunk.append(item)
            size += item[1]["n"]
        if chunk and (item is None or size >= IMPORT_BYTES):
            b.ask(wire.INIT, [bf for _, _, bf in chunk], [dd for _, dd, _ in chunk],
                  opt=_ANY_OPT, tensors=[], imp=[e for e, _, _ in chunk])
            total += size
            chunk, size = [], 0
    return total


def plan_even(tm: TierMap, members=None) -> dict[int, list[int]]:
    """Which home partitions to give which member so ``members`` (default: all) hold
    shares differing by at most one, moving as few as possible: ``{to: [homes]}``."""
    targets = list(range(len(tm.members))) if members is None else list(members)
    share = {i: tm.homes(i) if i in targets else [] for i in range(len(tm.members))}
    spare = [h for i in range(len(tm.members)) if i not in targets for h in tm.homes(i)]
    base, extra = divmod(tm.partitions, len(targets))
    want = {i: base + (1 if k < extra else 0) for k, i in
            enumerate(sorted(targets, key=lambda i: -len(share[i])))}
    for i in targets:
        while len(share[i]) > want[i]:
            spare.append(share[i].pop())
    out: dict[int, list[int]] = {}
    for i in targets:
        while len(share[i]) < want[i] and spare:
            h = spare.pop()
            share[i].append(h)
            out.setdefault(i, []).append(h)
    return out


def rebalance(url: str, *, members=None, curve=None, timeout: float = 60.0,
              progress=None) -> dict:
    """Even out the home partitions over ``members`` (all: None; ``drain`` leaves one out),
    first finishing any move a member still waits on."""
    done = {"moves": 0, **move(url, [], 0, curve=curve, timeout=timeout, progress=progress)}
    tm = current_map(url, min(timeout, 5.0), curve)
    for to, homes in sorted(plan_even(tm, members).items()):
        r = move(url, homes, to, curve=curve, timeout=timeout, progress=progress)
        done["moves"] += len(homes)
        done["names"] += r["names"]
        done["bytes"] += r["bytes"]
        done["version"] = r["version"]
    return done


def join(url: str, member: str, *, curve=None, timeout: float = 60.0, progress=None) -> dict:
    """Add ``member`` (a broker, or a pair's two, started with ``--tier`` naming every member
    and it last, and ``--tier-index`` its place) to the tier, then even out the home
    partitions over every member."""
    say = progress or (lambda line: None)
    tm = current_map(url, min(timeout, 5.0), curve)
    urls = parse_member(member)
    if urls in tm.members:
        raise ValueError(f"{member} is member {tm.members.index(urls)} of the tier already")
    new = TierMap(tm.version + 1, (*tm.members, urls), tm.owners)
    st = (status(member, min(timeout, 5.0), curve).get("tier") or {})
    if st.get("member") != len(tm.members):
        raise ValueError(f"{member} is not started as member {len(tm.members)} of this tier "
                         f"(start it with --tier naming every member and it last, and "
                         f"--tier-index {len(tm.members)})")
    conns = [_Member(new.url(i), curve, timeout) for i in range(len(new.members))]
    try:
        for c in reversed(conns):            # the new member first: it holds nothing yet
            c.tier("map", map=_wire(new))
    finally:
        for c in conns:
            c.close()
    say(f"map v{new.version}: member {len(tm.members)} ({member}) joined")
    done = rebalance(url, curve=curve, timeout=timeout, progress=progress)
    done["member"] = len(tm.members)
    return done
