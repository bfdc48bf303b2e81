"""The client SDK: :class:`Client`, the user's side of a connection to a gradbus cluster.

The work is split by what each part owns: the agent thread moves bytes (:mod:`.agent`) and
decides nothing; what it knows and decides is :class:`~gradbus.workers.agent_state.AgentState`
(socket-free, fed events, returning actions); commands are :mod:`.commands`; the credit window
is :mod:`.credit`; blocks, codecs, error feedback and accumulation are :mod:`.pipeline`; the
consistency models' versions are :mod:`.versions`; resending is :mod:`.resend`; fresh weights
land in a :class:`~gradbus.workers.cache.WeightCache` that ``pull()`` reads without a round
trip. Results come back as ``concurrent.futures.Future`` objects.

Flow control: at most ``window`` pushes are unacknowledged at once; ``push()`` blocks for a free
slot (``timeout`` seconds, then :class:`BackPressureError`). The broker acknowledges every push
once the shard applied it; ``acks=0`` only resolves the Future at send time.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future

import numpy as np
import zmq

from gradbus.codecs import cores, net, passes, security, specs, wire
from gradbus.codecs import shm as shmem
from gradbus.codecs import tensor as tcodec
from gradbus.codecs.errors import (
    BrokerUnavailableError,
    ClosedError,
    Code,
    GradbusError,
    ShardUnavailableError,
    error_from,
)
from gradbus.codecs.partition import DEFAULT_BLOCK_BYTES, TensorLayout, block_elems_for
from gradbus.codecs.tier import TierMap

from .agent import Agent
from .agent_state import AgentState
from .cache import WeightCache
from .commands import CheckTable, Read, Refresh, Request, SendMessage, Stop, Track, Watch
from .credit import CreditWindow
from .pipeline import PushPipeline
from .push_ops import PushMethods
from .resend import RECOVERING_RETRY, RESEND_AFTER, RESEND_MAX, ResendTimer
from .shm_io import ClientShm
from .table_ops import TableMethods
from .versions import Versions

log = logging.getLogger("gradbus.client")

DEFAULT_WINDOW = 32          # unacknowledged pushes per client ...
DEFAULT_WINDOW_BYTES = 128 << 20   # ... and their bytes (one push may exceed it, alone)
DEFAULT_TIMEOUT = 30.0       # seconds for init/pull/flush round trips
MAX_SPIN_US = 100_000        # microseconds a waiting caller may poll the link without sleeping
REWRITTEN_WAIT = 0.5        # seconds a pull waits for the update of a rewritten board block


class Client(PushMethods, TableMethods):
    """A connection to a gradbus cluster. Thread-safe; use as a context manager.

    >>> with gradbus.connect("tcp://127.0.0.1:5555") as c:   # doctest: +SKIP
    ...     c.init({"w": np.zeros(10, np.float32)}, optimizer=gradbus.SGD(lr=0.1))
    ...     c.push({"w": np.ones(10, np.float32)}).result()
    ...     w = c.pull(min_version=1)["w"]

    ``curve``: a :class:`gradbus.Curve` (this client's key pair and the broker's public key)
    for a broker with CURVE on; None reads them from ``$GRADBUS_SECURITY_CURVE_SECRET`` and
    ``$GRADBUS_SECURITY_CURVE_SERVER_KEY`` when set; False: CURVE off. A broker that refuses
    the key raises :class:`gradbus.SecurityError` at once. ``curve_configure(sock)`` is called
    on every socket after that setup.

    ``error_feedback``: True keeps what a chain leaves out and adds it to the next push, for
    every lossy chain but plain ``bf16`` (with or without zstd), whose round-to-nearest error is
    at most 2**-9 of each value; ``"all"`` for bf16 too; False for none.

    ``spin_us``: where the client reaches its broker over a local link (same host), a thread
    waiting in a push's ``result()`` reads the answer off the link itself; with ``spin_us`` it
    polls the link without sleeping for up to that many microseconds first. A shorter round trip
    for a core spent while waiting (0: it sleeps at once). None, the default, judges from the
    host: 500 us where it has cores to spare (at least 4 usable and, by its load average, a
    quarter of them idle), else 0 (:class:`gradbus.codecs.cores.Spin`).

    ``threads``: threads that copy a big tensor (512 KiB and more) into the push ring and out
    of the shards' weights boards in pieces at once (None or 0: ``$GRADBUS_CLIENT_THREADS``,
    else one per 8 usable cores, 1 to 4; 1 on a host of fewer than 4 cores).
    """

    def __init__(self, url: str | None = None, *, client_id: bytes | str | None = None,
                 window: int = DEFAULT_WINDOW, timeout: float = DEFAULT_TIMEOUT,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, codec: str = "raw",
                 max_tensor_bytes: int = wire.MAX_TENSOR_BYTES, curve_configure=None,
                 error_feedback: bool | str = True, seed: int | None = None,
                 window_bytes: int = DEFAULT_WINDOW_BYTES,
                 resend_after: float | None = RESEND_AFTER,
                 curve: security.Curve | bool | None = None, shm: bool | None = None,
                 spin_us: int | None = None, threads: int | None = None):
        # one broker, or a broker pair's two (protocol section 23)
        self.urls = net.broker_urls(url or net.default_broker())
        self._at = 0
        tcodec.parse_chain(codec)
        if isinstance(client_id, str):
            client_id = client_id.encode()
        self.client_id = client_id or uuid.uuid4().bytes
        if spin_us is not None and (type(spin_us) is not int
                                    or not 0 <= spin_us <= MAX_SPIN_US):
            raise ValueError(f"spin_us must be None or an int in 0..{MAX_SPIN_US}, "
                             f"not {spin_us!r}")
        # None: judged from the host (a caller spins where the host has cores to spare)
        self.spin = cores.Spin(spin_us, cores.CALLER_SPIN_US)
        if threads is not None and (type(threads) is not int or threads < 0):
            raise ValueError(f"threads must be None or an int >= 0, not {threads!r}")
        n_copiers = cores.client_threads(threads)
        if resend_after is not None and resend_after <= 0:
            raise ValueError("resend_after must be positive (or None: never resend)")
        self.resend_after = resend_after
        self.timeout = timeout
        self.block_bytes = block_bytes
        self.codec = codec
        self.max_tensor_bytes = max_tensor_bytes
        self.curve_configure = curve_configure
        # CURVE keys: given, else from $GRADBUS_SECURITY_CURVE_SECRET and _SERVER_KEY; False: off
        self.curve = security.Curve.from_env() if curve is None else (curve or None)
        if self.curve is not None and not isinstance(self.curve, security.Curve):
            raise TypeError("curve must be a gradbus.Curve, False or None")
        self.stats = collections.Counter()
        # Message ids start from the wall clock in microseconds, so a worker restarted with the
        # same client_id never reuses an id the broker's duplicate window still remembers.
        self._ids = itertools.count(time.time_ns() // 1000)
        self._lock = threading.Lock()           # around handing commands to the agent
        self._cond = threading.Condition()      # what readers and the credit window wait on
        self.credit = CreditWindow(window, window_bytes, self._cond)
        self._rng = np.random.default_rng(seed)
        self.pipeline = PushPipeline(None, error_feedback, self._rng)
        self.versions = Versions()
        self._closed = False
        self._tables: dict[str, dict] = {}           # table name -> its settings (from the broker)
        self._rewritten: dict[str, float] = {}       # name -> since when a pull could not read it
        self.passes = passes.shared(n_copiers) if n_copiers > 1 else None
        self.ctx = zmq.Context()
        try:
            at, welcome = net.hello_any(self.ctx, self.urls, 0, "client", timeout,
                                        curve_configure, curve=self.curve)
            self._at = at
            host, _ = net.split_url(self.url)
            # a client of a broker pair reads and pushes frames: its shared memory would be
            # the active broker's, and it may move to the other
            self.shm = ClientShm.offered(welcome, shmem.wanted(shm) and len(self.urls) == 1,
                                         window_bytes, self.passes)
            self.partitions = welcome["partitions"]
            # a broker tier's member (protocol section 24): the map of who holds which name
            self.tier_map = TierMap.from_wire(welcome["tier"]) if welcome.get("tier") else None
            self.tier_at = int(welcome.get("tier_at") or 0)
            # weights read as frames are followed by conflated delivery (no shared memory)
            self.cache = self.pipeline.cache = WeightCache(self.partitions,
                                                           conflated=self.shm is None)
            self.cache.down = set(welcome.get("down") or [])
            self.state = AgentState(
                welcome, cache=self.cache, cond=self._cond, credit=self.credit,
                versions=self.versions, stats=self.stats, next_id=self._ids.__next__,
                max_tensor_bytes=max_tensor_bytes,
                resend=ResendTimer(resend_after, max(RESEND_MAX, resend_after))
                if resend_after else None, shm=self.shm, brokers=len(self.urls))
            self.agent = Agent(self.ctx, self.client_id, self.state, self._lock,
                               spin=self.spin)
            link_name = (welcome.get("shm") or {}).get("link") if self.shm is not None else None
            self.agent.open(self.url, net.url(host, welcome["events"]), self.curve,
                            curve_configure, link_name, urls=self.urls, at=at)
        except BaseException:
            self.ctx.destroy(linger=0)
            if getattr(self, "shm", None) is not None:
                self.shm.close()
            if self.passes is not None:
                passes.release(self.passes)
            raise
        self.agent.start()

    # -- what other parts own, under the names tools and tests read ---------------------------
    @property
    def url(self) -> str:
        """The client URL of the broker this client talks to (of a pair: the one it is on)."""
        agent = getattr(self, "agent", None)
        return self.urls[agent.at if agent is not None and agent.urls else self._at]

    window = property(lambda self: self.credit.window)
    window_bytes = property(lambda self: self.credit.window_bytes)
    error_feedback = property(lambda self: self.pipeline.error_feedback)

    @property
    def cache_stats(self) -> dict:
        """The weights cache's counters (updates taken, gaps, snapshots, ...), a copy."""
        return dict(self.cache.stats)
    _credit_held = property(lambda self: self.credit.held)
    _residual = property(lambda self: self.pipeline.residual)
    _cons = property(lambda self: self.versions.cons)
    _server_versions = property(lambda self: self.versions.server)

    # -- helpers ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")
        if isinstance(self.agent.error, security.SecurityError):   # the broker refused us
            raise security.SecurityError(self.agent.error.args[0])
        if self.agent.error is not None:
            raise GradbusError(f"client I/O thread failed: {self.agent.error!r}")

    def _send_message(self, frames_fn, fut: Future) -> None:
        """Send an init (``frames_fn(msg)``): answered by INIT_OK or ERROR, resent until then."""
        with self._lock:
            self._check_open()
            msg = next(self._ids)
            self.agent.submit(SendMessage(msg, frames_fn(msg), fut))

    def _request(self, kind: str, timeout: float | None = None, **fields) -> dict:
        fut: Future = Future()
        with self._lock:
            self._check_open()
            req = next(self._ids)
            self.agent.submit(Request(req, [wire.pack(kind, req=req, **fields)], fut))
        return fut.result(timeout if timeout is not None else self.timeout)

    def _catalog(self, names: list) -> dict:
        """The broker's CATALOG_REPLY for ``names``, asked again after a back-off while a
        restarted broker says RECOVERING (its shards not all back), up to the timeout."""
        deadline = time.monotonic() + self.timeout
        delay = RECOVERING_RETRY
        while True:
            try:
                return self._request(wire.CATALOG, names=names)
            except GradbusError as e:
                if e.code != Code.RECOVERING or time.monotonic() + delay > deadline:
                    raise
            self.stats["recovering_retries"] += 1
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _layouts(self, names) -> dict[str, TensorLayout]:
        missing = [n for n in names if n not in self.cache.layouts]
        found = {n: self.cache.layouts[n] for n in names if n in self.cache.layouts}
        if missing:
            reply = self._catalog(missing)
            for t in reply["tensors"]:
                found[t["name"]] = TensorLayout.from_wire(t)
                self.versions.learn(t)
            absent = [n for n in missing if n not in found]
            if absent:
                raise error_from(Code.UNKNOWN_KEY.value, f"no such tensor: {', '.join(absent)}")
        return found

    # -- public API -----------------------------------------------------------------------
    def init(self, tensors: dict, optimizer: specs.Optimizer | None = None,
             timeout: float | None = None, consistency: str | None = None,
             stale_policy: str = "refuse", scale_lr: bool = False) -> dict[str, np.ndarray]:
        """Create parameters (no-op for names that exist) and return their current weights.

        ``tensors`` maps a name to an array (the initial values) or an initializer such as
        ``gradbus.Normal((784, 128), std=0.01)``. ``consistency``: ``"async"`` (default),
        ``"ssp:S"`` (bounded staleness; ``stale_policy`` ``"refuse"``: a push computed on
        weights more than S versions old fails with StaleError, ``"delay"``: ``pull`` waits
        until the weights are at most S versions behind) or ``"bsp:N"`` (a step is applied once
        N workers' gradients are in; ``pull`` after a push waits for the step). ``scale_lr``:
        each gradient is scaled by 1/staleness. Pushes of such tensors carry the version the
        weights were pulled at, unless ``push(version=...)`` says otherwise.
        """
        cons = specs.parse_consistency(consistency, stale_policy, scale_lr)
        optimizer = optimizer or specs.SGD(lr=0.01)
        opt = optimizer.to_wire()
        specs.optimizer_from_wire(opt)
        if not isinstance(tensors, dict) or not tensors:
            raise ValueError("init takes a non-empty dict of name -> array or initializer")
        metas, descs, bufs = [], [], []
        for name, val in tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            if isinstance(val, specs.Initializer):
                dt = np.dtype(val.dtype)
                shape = tuple(int(s) for s in val.shape)
                rule = val.to_wire()
            else:
                arr = np.asarray(val)
                if arr.dtype.name not in tcodec.PARAM_DTYPES:
                    raise ValueError(f"{name}: parameters must be float32 or float64, "
                                     f"not {arr.dtype}")
                dt, shape, rule = arr.dtype, arr.shape, {"name": "given"}
            if not shape or any(s <= 0 for s in shape):
                shape = shape or (1,)
                if any(s <= 0 for s in shape):
                    raise ValueError(f"{name}: shape {shape} has an empty dimension")
            layout = TensorLayout(name, dt.name, tuple(shape), block_elems_for(dt.itemsize,
                                                                            self.block_bytes))
            metas.append({**layout.to_wire(), "init": rule})
            if rule["name"] == "given":
                flat = np.ascontiguousarray(val, dtype=dt).reshape(-1).copy()
                for i, key in enumerate(layout.block_keys()):
                    a, b = layout.block_range(i)
                    d, buf = wire.encode_tensor(key, flat[a:b], "raw")
                    descs.append(d)
                    bufs.append(buf)
        fut: Future = Future()
        extra = {"cons": cons} if cons["mode"] != "async" or cons["scale"] else {}
        self._send_message(lambda msg: [wire.pack(wire.INIT, descs, msg=msg, opt=opt,
                                                  tensors=metas, **extra), *bufs], fut)
        fut.result(timeout or self.timeout)
        if extra:   # the model the broker holds (an existing tensor keeps its own)
            for t in self._request(wire.CATALOG, names=list(tensors))["tensors"]:
                self.versions.learn(t)
        return self.pull(list(tensors), timeout=timeout)

    def pull(self, keys=None, min_version: int | None = None,
             timeout: float | None = None, out: dict | None = None) -> dict[str, np.ndarray]:
        """The freshest local weights, at once. Tensors not yet followed are fetched first
        (subscribe, then snapshot). With ``min_version``, waits until every requested tensor has
        at least that many gradients applied. Arrays are read-only and never change.
        ``out``: name -> a writable array of the tensor's dtype and size (C-contiguous) that
        the weights are copied into, and returned in place of a new one (keys default to its
        names)."""
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        if isinstance(keys, str):
            keys = [keys]
        if keys is None and out:
            keys = list(out)
        if keys is None:
            keys = list(self.cache.layouts)
            if not keys:
                keys = [t["name"] for t in self._request(wire.CATALOG)["tensors"]]
        names = list(keys)
        out = out or {}
        if not out.keys() <= set(names):
            raise ValueError(f"out names tensors not pulled: {sorted(out.keys() - set(names))}")
        todo = [n for n in names if not self.cache.tracked(n)]
        layouts = self._layouts(todo + [n for n in out if n not in todo])
        for n, a in out.items():
            if (not isinstance(a, np.ndarray) or not a.flags.writeable
                    or not a.flags.c_contiguous or a.dtype != layouts[n].dtype
                    or a.size != layouts[n].size):
                raise ValueError(f"out[{n!r}] must be a writable C-contiguous {layouts[n].dtype} "
                                 f"array of {layouts[n].size} elements")
        if todo:
            fut: Future = Future()
            with self._lock:
                self._check_open()
                self.agent.submit(Track([layouts[n] for n in todo], fut))
            fut.result(timeout)
        deadline = time.monotonic() + timeout
        watching: tuple = ()
        try:
            while True:
                got = self._wait_weights(names, out, min_version, timeout, deadline,
                                         watching)
                if type(got) is dict:
                    return got
                # live partitions (read from their boards) are behind: follow their updates
                # while waiting, to be woken when they change
                watching = got
                with self._lock:
                    self._check_open()
                    self.agent.submit(Watch(watching, True))
        finally:
            if watching:
                with self._lock:
                    if not self._closed:
                        self.agent.submit(Watch(watching, False))

    def _wait_weights(self, names: list, out: dict, min_version, timeout: float,
                      deadline: float, watching: tuple) -> dict | tuple:
        """The weights once every tensor of ``names`` is at its needed version; or, when live
        partitions of them are behind and not ``watching`` yet, those partitions."""
        refreshed = False
        asked = None      # (TABLE messages taken, until when) once the table was asked for
        with self._cond:
            while True:
                if self.agent.error is not None or self._closed:
                    self._check_open()
                ready = all(self.cache.tracked(n) for n in names)
                if ready and all(self.cache.version(n) >= self.versions.needed(n, min_version)
                                 for n in names):
                    got = {n: (out[n] if self.cache.read_into(n, out[n]) else None)
                           if n in out else self.cache.tensor(n) for n in names}
                    if all(v is not None for v in got.values()):
                        self._read(names, False)
                        for n in names:
                            # what was read, not what the board holds by now
                            self.versions.pulled[n] = self.cache.read_versions[n]
                            if self._rewritten:
                                self._rewritten.pop(n, None)
                        return got
                    # a block was rewritten in its board since its update: the newer update
                    # is on its way; should it not come, the block is snapshot again
                    self._refresh_rewritten(names, got)
                elif ready and not watching:
                    live = self.cache.live_parts(names)
                    if live:
                        return live
                if ready:       # behind: a credit for newer weights (conflated delivery),
                    # for the partitions with a block below the version needed only
                    self._read(names, True, {n: self.versions.needed(n, min_version)
                                             for n in names})
                if ready and not refreshed and any(self.cache.unreadable_live(n)
                                                   for n in names):
                    refreshed = True     # a live block's board slot is gone: find it again
                    self.agent.submit(Refresh([k for n in names
                                               for k in self.cache.stale_keys(n)]))
                if self.state.broker_silent:
                    raise BrokerUnavailableError(
                        f"the broker at {self.url} has been silent for over "
                        f"{self.state.silence_after:.1f}s")
                down = set().union(*(self.cache.unavailable(n) for n in names
                                     if n in self.cache.layouts))
                if down:
                    # the table held may be stale (a TABLE dropped on the way, or behind an
                    # ACK that came on the local link): said only once the broker's own
                    # table, asked for now, says so too, or it did not come in time
                    if asked is None:
                        asked = (self.cache.tables,
                                 time.monotonic() + self.state.silence_after)
                        self.agent.submit(CheckTable())
                    elif self.cache.tables > asked[0] or time.monotonic() >= asked[1]:
                        raise ShardUnavailableError(
                            f"partitions {sorted(down)[:8]} of {names} have no live shard")
                left = deadline - time.monotonic()
                if left <= 0:
                    have = {n: self.cache.version(n) for n in names if n in self.cache.layouts}
                    raise TimeoutError(f"weights not at version {min_version} after "
                                       f"{timeout}s (have {have})")
                self.agent.reader.recall()      # the answers it waits for: the agent's to read
                self._cond.wait(min(left, 0.1))

    def _refresh_rewritten(self, names: list, got: dict) -> None:
        """Some of ``names`` could not be read (``got[n]`` None): a block's board bytes were
        rewritten since the update that named them. The newer update is on its way; once one
        has been awaited for ``REWRITTEN_WAIT`` the blocks are snapshot again. Called under
        the condition."""
        now = time.monotonic()
        for n in names:
            if got[n] is not None:
                self._rewritten.pop(n, None)
                continue
            since = self._rewritten.setdefault(n, now)
            if now - since >= REWRITTEN_WAIT:
                del self._rewritten[n]
                self.stats["board_refreshes"] += 1
                self.agent.submit(Refresh(self.cache.stale_keys(n)))

    def _read(self, names, waiting: bool, needs: dict | None = None) -> None:
        """The application read tensors ``names`` (``waiting``: waits for the versions
        ``needs``, name -> version), under the condition: a client that follows them by
        conflated delivery grants the broker credits for them (waiting: for the partitions
        behind only; one whose blocks are new enough has nothing to wait for)."""
        if not self.state.conflated:
            return
        parts = (self.cache.parts_of(names) if needs is None
                 else self.cache.parts_behind(needs))
        if parts:
            seqs = tuple(self.cache.parts[p].last_seq for p in parts)
            with self._lock:
                if not self._closed:
                    self.agent.submit(Read(parts, seqs, waiting))

    @property
    def broker_alive(self) -> bool:
        """False once the broker has been silent (no heartbeat, no reply) past its liveness."""
        return not self.state.broker_silent

    def version(self, name: str) -> int:
        """Gradients applied to ``name`` in the freshest weights this client holds (-1 until it
        holds every block). UnknownKeyError for a name this client does not follow."""
        with self._cond:
            try:
                v = self.cache.version(name)
            except KeyError:
                raise error_from(Code.UNKNOWN_KEY.value, f"{name!r} is not followed by this "
                                                         "client (pull it first)") from None
            self._read((name,), False)
        return v

    def flush(self, timeout: float | None = None) -> None:
        """Send what local accumulation holds back, then wait until every push sent so far is
        acknowledged (applied or refused)."""
        held = self._flush_accumulated() if self.pipeline.pending() else []
        self._wait_acked(timeout)
        for f in held:   # what accumulation held back was refused: say so here, not silently
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _wait_acked(self, timeout: float | None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.agent.reader.recall()
        with self._cond:
            while self.credit.held:
                if self.agent.error is not None:
                    self._check_open()
                if self.state.broker_silent:
                    raise BrokerUnavailableError(
                        f"{len(self.credit)} pushes unacknowledged and the broker at "
                        f"{self.url} is silent")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.credit)} pushes unacknowledged")
                self._cond.wait(min(left, 0.1))

    def status(self, timeout: float | None = None) -> dict:
        """The broker's status map (shards, workers, tensors, counters)."""
        return self._request(wire.STATUS, timeout=timeout)["status"]

    def close(self, timeout: float = 10.0) -> None:
        """Flush (up to ``timeout``), then stop the I/O thread and close every socket."""
        if self._closed:
            return
        try:
            if self.agent.error is None:
                self.flush(timeout)
        except (TimeoutError, GradbusError) as e:
            # closing goes on: the pushes in question are reported, not raised from close()
            log.warning("closing with %d pushes unacknowledged or refused: %s",
                        len(self.credit), e)
        finally:
            with self._lock:
                self._closed = True
                try:
                    self.agent.submit(Stop())
                except zmq.Again:
                    pass   # the agent has stopped already (it failed): nothing reads the pipe
            self.agent.join(timeout=5)
            with self._lock:
                self.agent.pipe_out.close(linger=0)
            if not self.agent.is_alive():     # it notifies through the pipe until it stops
                self.agent.reader.close()
            self.ctx.term()
            if self.shm is not None:
                self.shm.close()
            if self.passes is not None:
                passes.release(self.passes)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(url: str | None = None, **kw):
    """Connect to a broker's client URL (default ``$GRADBUS_BROKER`` or tcp://127.0.0.1:5555).
    A :class:`Client`; where that broker is a member of a broker tier of several, a
    :class:`~.tier_client.TierClient` connected to every member (the same calls)."""
    c = Client(url, **kw)
    if c.tier_map is None or len(c.tier_map.members) == 1:
        return c
    from .tier_client import TierClient
    return TierClient(c, kw)


__all__ = ["Client", "connect", "DEFAULT_WINDOW", "DEFAULT_WINDOW_BYTES"]
