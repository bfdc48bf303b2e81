"""Prometheus export: an HTTP endpoint per process that serves the latest metrics snapshot.

A process's loop builds a snapshot (see :mod:`gradbus.codecs.stats`) on its own thread, every
heartbeat or so, and hands it over by assigning one reference; the HTTP thread only reads that
reference. So a scrape never touches the loop's live state and never slows the hot path.

>>> exporter = MetricsExporter(port=0)      # doctest: +SKIP
>>> exporter.update(snapshot)                # from the loop
>>> exporter.url                             # http://127.0.0.1:PORT/metrics
"""
from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import make_wsgi_app


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:   # no line on stderr per scrape
        pass


class _Collector:
    def __init__(self, exporter: "MetricsExporter"):
        self.exporter = exporter

    def describe(self):
        return []

    def collect(self):
        snap = self.exporter.snapshot
        for name, metric in sorted(snap.items()):
            kind, help_ = metric[0], metric[1]
            if kind == "histogram":
                _, _, label_names, series = metric
                fam = HistogramMetricFamily(name, help_, labels=list(label_names))
                for labels, (bounds, counts, total) in series.items():
                    cum, buckets = 0, []
                    for b, c in zip((*bounds, float("inf")), counts):
                        cum += c
                        buckets.append(("+Inf" if b == float("inf") else repr(b), cum))
                    fam.add_metric([v for _, v in labels], buckets, total)
                yield fam
                continue
            series = metric[2]
            label_names = [k for k, _ in next(iter(series))] if series else []
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(name, help_, labels=label_names)
            for labels, value in series.items():
                fam.add_metric([v for _, v in labels], float(value))
            yield fam


class MetricsExporter:
    """Serves ``/metrics`` on ``host:port`` (port 0: a free one) from a background thread."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", name: str = "metrics"):
        self.snapshot: dict = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        app = make_wsgi_app(self.registry)
        self.server: WSGIServer = make_server(host, port, app, handler_class=_Quiet)
        self.host, self.port = host, self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={
            "poll_interval": 0.2}, name=f"gradbus-{name}", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def update(self, snapshot: dict) -> None:
        self.snapshot = snapshot

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def parse(text: str) -> dict:
    """``{sample name with labels: value}`` from exposition text (for tests and ``top``)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def client_snapshot(client) -> dict:
    """A client's counters as a metrics snapshot (read from another thread: retried if the
    client's I/O thread changes them meanwhile)."""
    from gradbus.codecs import stats
    for _ in range(5):
        try:
            st = dict(client.stats)
            break
        except RuntimeError:     # resized while copied
            continue
    else:
        st = {}
    wire_b, raw_b = st.get("push_bytes", 0), st.get("push_raw_bytes", 0)
    ring = getattr(getattr(client, "shm", None), "ring", None)
    return {
        "gradbus_client_pushes": stats.counter("Pushes sent.", st.get("pushes", 0)),
        "gradbus_client_pushes_acked": stats.counter("Pushes acknowledged.",
                                                     st.get("pushes_acked", 0)),
        "gradbus_client_push_errors": stats.counter("Pushes refused.", st.get("push_errors", 0)),
        "gradbus_client_resends": stats.counter("Pushes or inits sent again after no answer.",
                                                st.get("resends", 0)),
        "gradbus_client_push_wire_bytes": stats.counter("Gradient bytes sent, encoded.", wire_b),
        "gradbus_client_push_raw_bytes": stats.counter("Gradient bytes before encoding.", raw_b),
        "gradbus_client_compression_ratio": stats.gauge(
            "Raw over wire gradient bytes so far.", raw_b / wire_b if wire_b else 1.0),
        "gradbus_client_updates_received": stats.counter("Weight updates received.",
                                                         st.get("updates_received", 0)),
        "gradbus_client_recv_bytes": stats.counter("Weight bytes received.",
                                                   st.get("recv_bytes", 0)),
        "gradbus_client_unacked_pushes": stats.gauge(
            "Pushes sent and not yet acknowledged (the credit in use).",
            len(getattr(client, "_credit_held", ()))),
        "gradbus_client_broker_up": stats.gauge("1 while the broker answers.",
                                                int(client.broker_alive)),
        "gradbus_client_shm": stats.gauge(
            "1 if this client pushes through shared memory (its ring).",
            int(ring is not None and ring.failed is None)),
        "gradbus_client_shm_freed": stats.counter(
            "Pushes from the ring whose slots the broker gave back (FREE).",
            st.get("shm_freed", 0)),
        "gradbus_client_shm_exhausted": stats.gauge(
            "1 once /dev/shm refused this client a ring segment: pushes go as frames from "
            "then on.", int(ring is not None and ring.failed is not None)),
        "gradbus_client_shm_fallbacks": stats.counter(
            "Pushes sent as frames while this client had shared memory: its ring had no room "
            "(slots wait for FREE) or /dev/shm none for a new segment.",
            ring.stats["pushes_as_frames"] if ring is not None else 0),
    }


def serve_client(client, port: int = 0, host: str = "127.0.0.1",
                 interval: float = 1.0) -> MetricsExporter:
    """Serve a client's metrics (the SDK on request): ``exporter = serve_client(client)``,
    then scrape ``exporter.url``; ``exporter.close()`` when done."""
    exporter = MetricsExporter(port, host, name="client-metrics")
    stop = threading.Event()

    def refresh():
        while not stop.is_set():
            exporter.update(client_snapshot(client))
            stop.wait(interval)
    exporter.update(client_snapshot(client))
    t = threading.Thread(target=refresh, name="gradbus-client-metrics-refresh", daemon=True)
    t.start()
    close = exporter.close

    def close_all():
        stop.set()
        t.join(5)
        close()
    exporter.close = close_all
    return exporter
