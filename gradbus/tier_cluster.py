"""A broker tier on this host (protocol section 24): B members, each a broker (or a broker pair)
with shards of its own, every broker started with the tier's ``--tier`` list and its place.

:class:`TierCluster` is what ``gradbus up --brokers-per-host B`` and the tests run: one
:class:`~gradbus.cluster.LocalCluster` per member, their ports drawn before any starts so that
each member is told every member's URL. ``url`` is the first member's (any member's URL
reaches the whole tier: ``gradbus.connect`` follows the map its WELCOME carries).
"""
from __future__ import annotations

import os
import threading

from gradbus.codecs import net

from .cluster import LocalCluster, RestartPolicy


class TierCluster:
    def __init__(self, brokers: int = 2, shards: int = 1, *, pairs: bool = False,
                 shard_args: list[str] | None = None, broker_args: list[str] | None = None,
                 port: int = 0, **kw):
        """``brokers``: tier members; ``shards``: shards per member; ``pairs``: each member a
        broker pair; ``port``: the first member's client port (0: free, as every other
        member's); ``kw``: every member's :class:`LocalCluster` settings (``replicas``,
        ``inproc``, ``partitions``, ``quiet``, ``data_dir``, ``curve_dir`` ...; with
        ``metrics_port`` P, member i's brokers and shards take ports from P + i x (brokers x
        (1 + shards)), as one cluster's do from P)."""
        if brokers < 1:
            raise ValueError("a tier has at least one broker")
        if kw.get("processes") is False:
            raise ValueError("a tier's brokers run as processes")
        # every member's processes take metrics ports of their own after the one before's;
        # data_dir and curve_dir are shared: shard ids are the tier's, keys are one set
        metrics = kw.pop("metrics_port", None)
        span = (2 if pairs else 1) * (1 + shards)
        self.members = [
            LocalCluster(shards, brokers=2 if pairs else 1, port=port if i == 0 else 0,
                         shard_ids=[f"b{i}-shard-{j}" for j in range(shards)],
                         shard_args=shard_args,
                         metrics_port=metrics + i * span if metrics else metrics, **kw)
            for i in range(brokers)]
        for m in self.members:       # the host's cores are shared by every member's shards
            m.host_shards = brokers * (1 if kw.get("inproc") else shards)
        urls = [self.member_url(i) for i in range(brokers)]
        tier = [a for u in urls for a in ("--tier", u)]
        for i, m in enumerate(self.members):
            # with a data directory the map a move makes survives a whole tier's restart
            kept = ["--tier-map", os.path.join(kw["data_dir"], f"tier-map-b{i}.json")] \
                if kw.get("data_dir") else []
            m.broker_args = [*(broker_args or []), *tier, "--tier-index", str(i), *kept]
        self.urls = urls

    def member_url(self, i: int) -> str:
        """Member ``i``'s client URL (a pair's two, comma-separated), known before it starts."""
        m = self.members[i]
        if m.pair_ports:
            return ",".join(m.broker_url(n) for n in m.broker_names)
        return net.url(m.host, m.port)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def keys(self):
        """The CURVE keys every member's processes and the clients use (None: CURVE off)."""
        return self.members[0].keys

    def start(self) -> "TierCluster":
        try:
            for m in self.members:
                m.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, int]:
        codes: dict[str, int] = {}
        for i, m in enumerate(self.members):
            codes.update({f"b{i}:{n}": c for n, c in m.stop().items()})
        return codes

    def supervise(self, stop, policy=None, say=print, poll: float = 0.2) -> str | None:
        """Each member's :meth:`LocalCluster.supervise` at once (each with its own restart
        count), its lines prefixed with the member; returns when ``stop`` is set, or why the
        first member that gave up did."""
        done = threading.Event()
        why: list[str] = []

        def run(i: int, m: LocalCluster) -> None:
            got = m.supervise(done, policy or RestartPolicy(), lambda text: say(f"b{i}: {text}"),
                              poll)
            if got is not None:
                why.append(f"b{i}: {got}")
                done.set()

        threads = [threading.Thread(target=run, args=(i, m), name=f"tier-supervise-{i}",
                                    daemon=True) for i, m in enumerate(self.members)]
        for t in threads:
            t.start()
        while not done.is_set() and not stop.wait(poll):
            pass
        done.set()
        for t in threads:
            t.join()
        return why[0] if why else None

    def pids(self) -> list[int]:
        return [p for m in self.members for p in m.pids()]

    def __enter__(self) -> "TierCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["TierCluster"]
