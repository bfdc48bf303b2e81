"""The PyTorch RPC peer of bench/peers.py: a parameter server and its trainers, one process each.

Written after the PyTorch tutorial's batch-update parameter server ("Implementing Batch RPC
Processing Using Asynchronous Executions"): ``torch.distributed.rpc`` on the TensorPipe backend,
a server object behind an ``RRef``, its update method ``@rpc.functions.async_execution`` under
one lock, and a Future that resolves with the server's weights. As in the tutorial, the Future
resolves with the weights tensor itself, not a copy (``clone=True``, the ``rpc_clone``
configuration, returns a copy taken under the lock instead: a new tensor per update). The batch
is one gradient, so every push is applied at once (an SGD step on the weights, in place), as
gradbus applies pushes asynchronously.

A trainer keeps ``depth`` calls in flight (``rpc_async``), waits for the oldest, and counts an
update when it holds the weights that call returned: the same staleness as a gradbus worker
with ``depth`` pushes in flight.

With ``servers`` S > 1 (the ``rpc2`` configuration) the model is split over S parameter-server
processes, as the PyTorch parameter-server tutorial spreads a model's parameters over servers:
server i owns the i-th of S equal parts of the weights (rank 0 creates the others' objects with
``rpc.remote``), and a trainer's update is one ``rpc_async`` per server, each with its part of
the gradient, resolved (``torch.futures.collect_all``) when every server has returned its
part's weights tensor. A trainer keeps ``depth`` updates in flight: ``depth`` calls per server.
An update moves the same bytes as with one server. Each process runs torch with one intra-op thread, as numpy's
step in the other configurations runs on one.

Everything here imports torch; bench/peers.py imports this module only to run the ``rpc``
configurations.
"""
from __future__ import annotations

import collections
import ctypes
import os
import signal
import threading
import time
import warnings

import throughput  # the model's parts (bench/ is on the path, as for every bench module)
import torch
import torch.distributed.rpc as rpc

LR = 1e-6
_counters = _stop = _lat = None    # this process's shared counters, stop flag and samples


class ParameterServer:
    """The weights (one float32 tensor) and the lock every update takes."""

    def __init__(self, n: int, clone: bool):
        self.weights = torch.zeros(n)
        self.lock = threading.Lock()
        self.clone = clone

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_weights(ps_rref, grad):
        self = ps_rref.local_value()
        fut = torch.futures.Future()
        with self.lock:
            self.weights.add_(grad, alpha=-LR)          # the SGD step, in place
            # the caller gets the fresh weights (the tutorial returns the parameter itself)
            fut.set_result(self.weights.clone() if self.clone else self.weights)
        return fut


def run_trainer(ps_rrefs: list, index: int, n: int, depth: int, pause: float = 0.0) -> None:
    """A trainer's loop: ``depth`` updates in flight (an update: one call to each server in
    ``ps_rrefs`` with its part of the gradient); each time the oldest returns, its weights are
    the trainer's, until the stop flag."""
    torch.manual_seed(index)
    grads = [torch.randn(m) for m in throughput.parts(n, len(ps_rrefs))]   # a tensor each: no views
    owners = [r.owner() for r in ps_rrefs]
    lat = _lat[index]
    waiting: collections.deque = collections.deque()
    k = 0
    while not _stop.value:
        lat.sent(k)
        futs = [rpc.rpc_async(owner, ParameterServer.update_and_fetch_weights, args=(r, g))
                for owner, r, g in zip(owners, ps_rrefs, grads)]
        fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
        fut.add_done_callback(lambda _f, k=k: lat.acked(k))
        waiting.append((k, fut))
        k += 1
        if len(waiting) >= depth:
            j, fut = waiting.popleft()
            weights = fut.wait()            # the fresh weights (every part's), this trainer's now
            lat.fresh(j)
            del weights
            _counters[index] += 1
            if pause:
                time.sleep(pause)       # the next gradient's computation, elsewhere
    for _, fut in waiting:
        fut.wait()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def _process(rank: int, trainers: int, n: int, port: int, tcp_only: bool, clone: bool,
             depth: int, counters, stop, lat, place: tuple | None = None,
             pause: float = 0.0, servers: int = 1) -> None:
    """One process of the world: ranks 0..servers-1 the servers, rank 0 starting the trainers'
    loops (after creating every server's part of the model).
    ``place``, where given, is (network namespace, the server's address, this process's
    interface): the process joins the namespace before it starts a thread (bench/hosts.py)."""
    global _counters, _stop, _lat
    _die_with_parent()
    _counters, _stop, _lat = counters, stop, lat
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    if place is not None:
        import hosts_net
        ns, addr, ifname = place
        hosts_net.enter(ns)
        # init_rpc's Gloo group takes its interface from GLOO_SOCKET_IFNAME, TensorPipe's
        # listeners from TP_SOCKET_IFNAME
        os.environ.update(MASTER_ADDR=addr, TP_SOCKET_IFNAME=ifname, GLOO_SOCKET_IFNAME=ifname)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend")   # init_rpc's own
    if tcp_only:
        opts = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    else:
        opts = rpc.TensorPipeRpcBackendOptions()
    name = f"ps{rank}" if rank < servers else f"trainer{rank - servers}"
    rpc.init_rpc(name, rank=rank, world_size=servers + trainers, rpc_backend_options=opts)
    if rank == 0:
        sizes = throughput.parts(n, servers)
        ps_rrefs = [rpc.RRef(ParameterServer(sizes[0], clone))] + [
            rpc.remote(f"ps{i}", ParameterServer, args=(sizes[i], clone))
            for i in range(1, servers)]
        futs = [rpc.rpc_async(f"trainer{i}", run_trainer,
                              args=(ps_rrefs, i, n, depth, pause)) for i in range(trainers)]
        torch.futures.wait_all(futs)
    rpc.shutdown()


def processes(ctx, trainers: int, nbytes: int, port: int, tcp_only: bool, clone: bool,
                depth: int, counters, stop, lat, places: list | None = None,
                pause: float = 0.0, servers: int = 1) -> list:
    """The world's processes (not started): the ``servers`` servers, then the trainers;
    ``places[rank]`` says where each runs (see :func:`_process`; one server only), all on this
    host's loopback without it."""
    if places and servers != 1:
        raise ValueError("places are for one server")
    return [ctx.Process(target=_process, daemon=True,
                        args=(rank, trainers, nbytes // 4, port, tcp_only, clone, depth,
                              counters, stop, lat, places[rank] if places else None, pause,
                              servers))
            for rank in range(servers + trainers)]
