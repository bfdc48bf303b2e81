"""Status and metrics: read-only views of the broker core for ops commands (STATUS), the
partition table dump and the Prometheus exporter. Nothing here changes state (except that the
rates are brought up to the time asked for)."""
from __future__ import annotations

import math

from gradbus.codecs import stats

#: counters exported as ``gradbus_broker_<name>_total``: (name, counters key, help)
_BROKER_COUNTERS = (
    ("pushes_received", "pushes_received", "Pushes accepted from clients."),
    ("pushes_applied", "pushes_applied", "Pushes applied and acknowledged."),
    ("push_wire_bytes", "push_wire_bytes", "Gradient bytes received, as encoded on the wire."),
    ("push_decoded_bytes", "push_decoded_bytes",
     "Gradient bytes received, decoded (dense parameter bytes)."),
    ("batches", "batches", "Batch messages sent to shards."),
    ("duplicates", "duplicates", "Pushes or inits received again (resends) and not applied again."),
    ("busy_refusals", "busy",
     "Pushes or inits refused with BUSY: the broker held its byte cap (--max-pending-mb)."),
    ("failovers", "failovers", "Partitions whose primary was replaced by a standby."),
    ("shard_deaths", "shards_lost",
     "Shards declared dead (silent past liveness, bye, or restarted)."),
    ("fenced_partitions", "fenced_partitions",
     "Stale partitions a returning shard was told to drop."),
    ("pair_voters_rebuilt", "voters_rebuilt",
     "A pair's broker without the votes: stale copies of its partitions' own voters caught "
     "up again so that they count (protocol section 23)."),
    ("partition_moves", "moves", "Partition moves finished (rebalance, drain, a new shard)."),
    ("replayed_batches", "replayed", "Batches replayed from an update log."),
    ("standbys_synced", "standbys_synced",
     "Standbys that finished catching up on a partition."),
    ("shm_freed", "shm_freed",
     "Pushes read from clients' shared-memory rings whose slots were given back (FREE)."),
    ("shm_relayed", "shm_relayed",
     "Batches of pushes that arrived as frames, handed to shards through the broker's ring."),
    ("shm_inlined", "shm_inlined",
     "Batches turned back into frames for a shard or log that does not read shared memory."),
    ("links_opened", "links_opened",
     "Local links opened by clients and shards on the broker's host (introduced and routed)."),
    ("links_refused", "links_refused",
     "Local links closed at once: a bad introduction, a live shard's identity, too many links."),
    ("links_impersonated", "links_impersonated",
     "Messages on the backend socket under the identity of a shard's open local link: dropped."),
    ("delivered_updates", "deliveries",
     "UPDATEs sent to clients that follow partitions by conflated delivery (frames readers)."),
    ("delivered_bytes", "delivered_bytes",
     "Tensor bytes in those UPDATEs."),
    ("updates_skipped", "updates_skipped",
     "Published UPDATEs a conflated follower skipped (it had not read what it held): each "
     "is one follower's copy not sent."),
    ("shm_fallbacks", "shm_relay_full",
     "Batches that should have gone to shards through shared memory and went as frames: the "
     "broker's ring had no room (or /dev/shm none for a new segment)."),
)


def status(core, now: float) -> dict:
    tb, members, rb, sq, m = core.table, core.members, core.rebalance, core.sequencer, core.meters
    shards = []
    _, load = rb.loads(now)
    for s in sorted(members.shards.values(), key=lambda s: s.id):
        primary = sum(1 for o in tb.owners if o == s.id)
        shards.append({"id": s.id, "alive": s.alive, "partitions": len(s.partitions),
                       "primary": primary, "standby": sum(
                           1 for sb in tb.standbys if s.id in sb),
                       "syncing": sum(1 for v in tb.syncing.values() if s.id in v),
                       "bytes": s.bytes,
                       "load": [round(x, 4) for x in load.get(s.id, (0.0, 0.0))],
                       "inflight": s.inflight, "shm": s.shm,
                       "last_seen_s": round(now - s.last_seen, 3), "info": s.info})
    workers = [{"id": c.identity.hex(), "pushes": c.pushes, "errors": dict(c.errors),
                "pushes_per_s": round(c.rate * math.exp(-max(0.0, now - c.rate_at) / 5.0), 2),
                "staleness": None if c.staleness is None else round(c.staleness, 2),
                "shm": c.shm, "last_seen_s": round(now - c.last_seen, 3)}
               for c in members.clients.values()]
    tensors = [{"name": n, "dtype": t.layout.dtype, "shape": list(t.layout.shape),
                "blocks": t.layout.nblocks, "version": t.version,
                "optimizer": t.opt.get("name")} for n, t in sorted(core.catalog.tensors.items())]
    tables = [{"name": n, "dim": t.cfg["dim"], "dtype": t.cfg["dtype"],
               "optimizer": t.cfg["opt"]["name"], "version": t.version,
               "rows": sum(r[0] for r in t.rows.values()),
               "bytes": sum(r[1] for r in t.rows.values()),
               "expiry_s": t.cfg["expiry"], "min_count": t.cfg["min_count"]}
              for n, t in sorted(core.catalog.tables.items())]
    urls = {s.id: s.info["metrics_url"] for s in members.shards.values()
            if s.alive and s.info.get("metrics_url")}
    if core.metrics_url or urls:
        urls = {"broker": core.metrics_url, **urls}
    h = m.h_staleness
    return {"uptime_s": round(now - core.recovery.started, 3), "partitions": core.P,
            "metrics_url": core.metrics_url,
            "metrics_urls": urls,
            "partitions_assigned": sum(1 for o in tb.owners if o),
            "partitions_down": tb.down(), "table_version": tb.version,
            "replicas": tb.replicas,
            "under_replicated": tb.under_replicated(),
            "failovers": rb.failovers[-20:],
            "moves": rb.move_log[-20:],
            "moves_in_progress": [{"p": p, **mv} for p, mv in sorted(rb.moves.items())],
            "draining": sorted(rb.draining),
            "shards": shards, "workers": workers, "tensors": tensors, "tables": tables,
            "shm": core.shm is not None,
            "shm_relays_in_flight": len(sq.relay_live),
            "pending_bytes": sq.pending_bytes, "held_bytes": sq.held_bytes,
            "counters": dict(m.counters),
            "staleness": {"count": h.count, "p50": h.quantile(0.5), "p99": h.quantile(0.99),
                          "mean": round(h.sum / h.count, 3) if h.count else None},
            "errors": dict(m.errors),
            **({"pair": core.pair_status(now)} if core.pair_status is not None else {}),
            **({"tier": core.tier.status()} if core.tier.tier is not None else {})}


def metrics(core, now: float) -> dict:
    """A snapshot for the Prometheus exporter (built on the loop's thread)."""
    m, members, sq = core.meters, core.members, core.sequencer
    c = m.counters
    alive = {s.id: int(s.alive) for s in members.shards.values()}
    wire_b, dec_b = c.get("push_wire_bytes", 0), c.get("push_decoded_bytes", 0)
    out = {f"gradbus_broker_{name}": stats.counter(help_, c.get(key, 0))
           for name, key, help_ in _BROKER_COUNTERS}
    pair = core.pair_status(now) if core.pair_status is not None else None
    out.update({   # every broker: a lone one is active and has no peer to miss
        "gradbus_broker_pair_active": stats.gauge(
            "1 while this broker is active (a broker without a peer always is), 0 while "
            "the standby of its pair.", int(pair is None or pair["role"] == "active")),
        "gradbus_broker_pair_peer_unheard": stats.gauge(
            "1 while this broker of a pair does not hear its peer on the pair link (no "
            "standby ready, or both brokers active); 0 without a peer.",
            int(pair is not None and pair["peer"]["role"] == "silent"))})
    if pair is not None:
        out.update({
            "gradbus_broker_pair_takeovers_total": stats.counter(
                "Times this broker took over as the active one of its pair.",
                pair["takeovers"]),
            "gradbus_broker_pair_epoch": stats.gauge(
                "The broker epoch: this broker's while active, else the highest it knows.",
                pair["epoch"]),
            "gradbus_broker_pair_quorum": stats.gauge(
                "1 while this broker of a pair acts: active, with a majority of every "
                "partition's voters (its copies, and the peer when they are even).",
                int(bool(pair.get("quorum"))))})
    tm = core.tier.tier
    if tm is not None:
        out.update({
            "gradbus_broker_tier_partitions": stats.gauge(
                "Home partitions of the broker tier's map this member holds (the names whose "
                "home partition they are are sequenced here).", tm.share(core.tier.index)),
            "gradbus_broker_tier_map_version": stats.gauge(
                "The version of the broker tier's map this member answers.", tm.version),
            "gradbus_broker_tier_moved_total": stats.counter(
                "Writes refused MOVED: their tensor or table is held by another tier member.",
                c.get("tier_moved", 0))})
    out.update({
        "gradbus_broker_compression_ratio": stats.gauge(
            "Decoded over wire bytes of all pushes so far.", dec_b / wire_b if wire_b else 1.0),
        "gradbus_broker_partition_moves_in_progress": stats.gauge(
            "Partition moves under way.", len(core.rebalance.moves)),
        "gradbus_broker_errors": stats.labelled("counter", "Errors by code.", "code",
                                                dict(m.errors)),
        "gradbus_broker_pending_bytes": stats.gauge(
            "Tensor bytes queued in the broker, not yet sent to shards.", sq.pending_bytes),
        "gradbus_broker_held_bytes": stats.gauge(
            "Tensor bytes the broker holds: queued, and in batches not yet applied "
            "(at most --max-pending-mb, or one larger message).", sq.held_bytes),
        "gradbus_broker_pending_entries": stats.gauge(
            "Entries queued in the broker.", sum(len(v) for v in sq.pending_entries.values())),
        "gradbus_broker_inflight_batches": stats.labelled(
            "gauge", "Batches sent to a shard and not yet applied (its used credit).",
            "shard", {s.id: s.inflight for s in members.shards.values()}),
        "gradbus_broker_shard_credit": stats.gauge("Batches allowed in flight per shard.",
                                                   core.settings.shard_credit),
        "gradbus_broker_shard_up": stats.labelled("gauge", "1 if the shard is alive.",
                                                  "shard", alive),
        "gradbus_broker_shard_silent": stats.labelled(
            "gauge", "1 if the shard was declared dead without saying bye (silent past "
            "liveness, or replaced by a new process under its id) and has not come back.",
            "shard", {s.id: int(not s.alive and not s.left) for s in members.shards.values()}),
        "gradbus_broker_replicas": stats.gauge("Copies of each partition wanted (--replicas).",
                                               core.table.replicas),
        "gradbus_broker_partitions_without_standby": stats.gauge(
            "Partitions served by a live primary with no in-sync standby to fail over to.",
            core.table.without_standby()),
        "gradbus_broker_max_pending_bytes": stats.gauge(
            "The byte cap on held_bytes (--max-pending-mb): at it, pushes are answered BUSY.",
            core.settings.max_pending_bytes),
        "gradbus_broker_shm": stats.gauge(
            "1 if the broker offers shared memory to peers on its host.",
            int(core.shm is not None)),
        "gradbus_broker_shm_exhausted": stats.gauge(
            "1 once /dev/shm refused the broker a segment (its probe, or its relay ring): "
            "those bytes go as frames from then on.", int(c.get("shm_exhausted", 0) > 0)),
        "gradbus_broker_delivery_cache_bytes": stats.gauge(
            "Bytes in conflated delivery's last-value caches (at most one value per block of "
            "the partitions frames readers follow).", core.delivery.cache_bytes()),
        "gradbus_broker_partitions_down": stats.gauge(
            "Partitions with no live primary.", len(core.table.down())),
        "gradbus_broker_under_replicated_partitions": stats.gauge(
            "Partitions with fewer in-sync copies than --replicas.",
            core.table.under_replicated()),
        "gradbus_broker_workers": stats.gauge("Clients currently known.", len(members.clients)),
        "gradbus_broker_batch_entries": stats.histogram(
            "Entries (pushes and inits) per partition batch.", m.h_batch),
        "gradbus_broker_push_to_visible_seconds": stats.histogram(
            "From a push's arrival to the publish of the weights it changed.", m.h_visible),
        "gradbus_broker_push_to_ack_seconds": stats.histogram(
            "From a push's arrival to its acknowledgement.", m.h_ack),
        "gradbus_broker_staleness": stats.histogram(
            "Versions a push's weights were behind the tensor's on arrival (pushes that "
            "say which version they were computed on).", m.h_staleness),
    })
    return out


def table(core) -> dict:
    """The partition table: per partition its primary, in-sync standbys, standbys catching
    up, epoch and last seq."""
    tb, rb = core.table, core.rebalance
    rb.fold_rates(core.now)
    return {"owners": [o or "" for o in tb.owners], "standbys": tb.standbys,
            "syncing": [sorted(tb.syncing.get(p, ())) for p in range(core.P)],
            "epochs": tb.epochs, "seqs": core.sequencer.seq, "down": tb.down(),
            "bytes": tb.pbytes,
            "rates": [round(r, 3) for r in rb.prate.tolist()],
            "version": tb.version}
