"""bench/floor.py's ``shm`` pipeline over gradbus's local links (gradbus/codecs/link.py), the
transport gradbus's own processes of one host use, instead of ZeroMQ sockets.

A ZeroMQ message crosses each end's I/O thread; a link is a Unix stream socket written by the
sending thread and read by the receiving one. The floor over links is then the least a push of
gradbus's shape costs as gradbus moves it: four crossings (worker, broker, shard, broker,
worker), headers only, the gradient in the worker's ring and the weights on the shard's board,
no protocol. The broker routes by the worker index in the push's header, and back by the one
that came with it.
"""
from __future__ import annotations

import os
import select
import socket
import time

import floor

from gradbus import memory
from gradbus.codecs import link

CONNECT_TIMEOUT = 60.0


def address() -> str:
    """A fresh abstract socket name for one pipeline's broker."""
    return f"gradbus-bench-floor-{os.getpid()}-{os.urandom(4).hex()}"


def _connect(name: str, role: bytes, identity: bytes) -> link.Link:
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        lnk = link.connect(name, role, identity)
        if lnk is not None:
            return lnk
        if time.monotonic() > deadline:
            raise TimeoutError(f"no floor broker at {name} after {CONNECT_TIMEOUT:.0f}s")
        time.sleep(0.02)


def _wait(lnk: link.Link, poller, timeout_ms: int) -> list | None:
    """The link's next message, waiting at most ``timeout_ms``; None if none came."""
    frames = lnk.recv()
    if frames is None and poller.poll(timeout_ms):
        frames = lnk.recv()
    return frames


def broker(name: str, workers: int) -> None:
    memory.keep_freed_memory()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    listener.setblocking(False)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    links: dict[int, link.Link] = {}
    shard, clients, early = None, {}, []     # early: pushes that came before the shard
    while True:
        for fd, _ in poller.poll(1000):
            if fd == listener.fileno():
                new = link.accept(listener)
                if new is not None:
                    links[new.fd] = new
                    poller.register(new.fd, select.POLLIN)
                continue
            lnk = links[fd]
            for frames in _drain(lnk):
                if len(frames) == 3:                        # an introduction
                    role, identity = link.introduction(frames)
                    if role == link.SHARD:
                        shard = lnk
                        for held in early:
                            shard.send(held)
                        early.clear()
                    else:
                        clients[int(identity)] = lnk
                elif lnk is shard:                          # an ack: [worker, ack]
                    clients[int(frames[0])].send(frames[1:])
                elif shard is not None:                     # a push's header
                    shard.send(frames)
                else:
                    early.append(frames)
            if lnk.closed:                                  # a worker that ended
                poller.unregister(fd)
                links.pop(fd).close()


def _drain(lnk: link.Link):
    """The whole messages the link has now, until it has none or its peer closed it."""
    while True:
        try:
            frames = lnk.recv()
        except link.LinkClosed:
            return
        if frames is None:
            return
        yield frames


def shard(name: str, n: int, rings: list, board: str, slots: int,
          step: str = "numpy") -> None:
    memory.keep_freed_memory()
    lnk = _connect(name, link.SHARD, b"shard")
    poller = select.poll()
    poller.register(lnk.fd, select.POLLIN)

    def recv():
        while True:
            frames = _wait(lnk, poller, 1000)
            if frames is not None:
                header = frames[0]
                return b"%d" % floor.SLOT.unpack(header)[0], header

    try:
        floor.shm_shard_loop(recv, lambda route, ack: lnk.send([route, ack]), n, rings, board,
                             slots, step)
    except link.LinkClosed:         # the broker ended: so does the pipeline
        pass


def worker(name: str, index: int, n: int, ring: str, board: str, slots: int, counters, stop,
           depth: int, lat) -> None:
    lnk = _connect(name, link.CLIENT, b"%d" % index)
    poller = select.poll()
    poller.register(lnk.fd, select.POLLIN)
    try:
        floor.shm_worker_loop(lambda header: lnk.send([header]),
                              lambda: _wait(lnk, poller, 200) is not None, index, n, ring,
                              board, slots, counters, stop, depth, lat)
    finally:
        lnk.close()
