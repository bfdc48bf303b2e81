"""The PyTorch RPC peer of bench/peers.py: a parameter server and two trainers, three processes.

Written after the PyTorch tutorial's batch-update parameter server ("Implementing Batch RPC
Processing Using Asynchronous Executions"): ``torch.distributed.rpc`` on the TensorPipe backend,
a server object behind an ``RRef``, its update method ``@rpc.functions.async_execution`` under
one lock, and a trainer loop of ``rpc_sync(update_and_fetch_weights)`` whose Future resolves
with the fresh weights. The batch is one gradient, so every push is applied at once (an SGD step
on the weights, in place), as gradbus applies pushes asynchronously. The weights returned are a
copy taken under the lock: TensorPipe may still be reading a returned tensor when the next
update writes the weights. Each process runs torch with one intra-op thread, as numpy's step
in the other configurations runs on one.

Everything here imports torch; bench/peers.py imports this module only to run the ``rpc``
configurations.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import warnings

import torch
import torch.distributed.rpc as rpc

LR = 1e-6
TRAINERS = 2
_counters = _stop = None    # this process's shared counters and stop flag (set in _process)


class ParameterServer:
    """The weights (one float32 tensor) and the lock every update takes."""

    def __init__(self, n: int):
        self.weights = torch.zeros(n)
        self.lock = threading.Lock()

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_weights(ps_rref, grad):
        self = ps_rref.local_value()
        fut = torch.futures.Future()
        with self.lock:
            self.weights.add_(grad, alpha=-LR)          # the SGD step, in place
            fut.set_result(self.weights.clone())        # the caller gets the fresh weights
        return fut


def run_trainer(ps_rref, index: int, n: int) -> None:
    """A trainer's loop: push a gradient, get the new weights back, until the stop flag."""
    torch.manual_seed(index)
    grad = torch.randn(n)
    while not _stop.value:
        weights = rpc.rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch_weights,
                               args=(ps_rref, grad))
        del weights
        _counters[index] += 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def _process(rank: int, n: int, port: int, tcp_only: bool, counters, stop) -> None:
    """One process of the world: rank 0 the server, which starts the trainers' loops."""
    global _counters, _stop
    _die_with_parent()
    _counters, _stop = counters, stop
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend")   # init_rpc's own
    if tcp_only:
        opts = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    else:
        opts = rpc.TensorPipeRpcBackendOptions()
    name = "ps" if rank == 0 else f"trainer{rank - 1}"
    rpc.init_rpc(name, rank=rank, world_size=TRAINERS + 1, rpc_backend_options=opts)
    if rank == 0:
        ps_rref = rpc.RRef(ParameterServer(n))
        futs = [rpc.rpc_async(f"trainer{i}", run_trainer, args=(ps_rref, i, n))
                for i in range(TRAINERS)]
        torch.futures.wait_all(futs)
    rpc.shutdown()


def processes(ctx, nbytes: int, port: int, tcp_only: bool, counters, stop) -> list:
    """The world's three processes (not started): the server, then the trainers."""
    return [ctx.Process(target=_process, daemon=True,
                        args=(rank, nbytes // 4, port, tcp_only, counters, stop))
            for rank in range(TRAINERS + 1)]
