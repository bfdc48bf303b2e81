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
with ``depth`` pushes in flight. Each process runs torch with one intra-op thread, as numpy's
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


def run_trainer(ps_rref, index: int, n: int, depth: int, pause: float = 0.0) -> None:
    """A trainer's loop: ``depth`` updates in flight; each time the oldest returns, its weights
    are the trainer's, until the stop flag."""
    torch.manual_seed(index)
    grad = torch.randn(n)
    owner = ps_rref.owner()
    lat = _lat[index]
    waiting: collections.deque = collections.deque()
    k = 0
    while not _stop.value:
        lat.sent(k)
        fut = rpc.rpc_async(owner, ParameterServer.update_and_fetch_weights,
                            args=(ps_rref, grad))
        fut.add_done_callback(lambda _f, k=k: lat.acked(k))
        waiting.append((k, fut))
        k += 1
        if len(waiting) >= depth:
            j, fut = waiting.popleft()
            weights = fut.wait()                       # the fresh weights, this trainer's now
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
             pause: float = 0.0) -> None:
    """One process of the world: rank 0 the server, which starts the trainers' loops.
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
    name = "ps" if rank == 0 else f"trainer{rank - 1}"
    rpc.init_rpc(name, rank=rank, world_size=trainers + 1, rpc_backend_options=opts)
    if rank == 0:
        ps_rref = rpc.RRef(ParameterServer(n, clone))
        futs = [rpc.rpc_async(f"trainer{i}", run_trainer, args=(ps_rref, i, n, depth, pause))
                for i in range(trainers)]
        torch.futures.wait_all(futs)
    rpc.shutdown()


def processes(ctx, trainers: int, nbytes: int, port: int, tcp_only: bool, clone: bool,
                depth: int, counters, stop, lat, places: list | None = None,
                pause: float = 0.0) -> list:
    """The world's processes (not started): the server, then the trainers; ``places[rank]``
    says where each runs (see :func:`_process`), all on this host's loopback without it."""
    return [ctx.Process(target=_process, daemon=True,
                        args=(rank, trainers, nbytes // 4, port, tcp_only, clone, depth,
                              counters, stop, lat, places[rank] if places else None, pause))
            for rank in range(trainers + 1)]
