"""Local links: multipart messages between two processes of one host over a Unix stream socket,
written and read by the processes' own threads.

A ZeroMQ message between two processes passes through each one's I/O thread: four thread
wake-ups per message where a socket written by the sending thread and read by the receiving one
has one. On two busy cores that is most of a push's round trip (bench/peers.py ``--hops``), so
a peer on the broker's host (one that took up its shared-memory offer) sends and receives what
it would on its DEALER over a link instead; the bytes of its tensors already travel in shared
memory, so a link carries headers and references, rarely more.

Framing (both ways): a message is ``u32 n`` (frames), then ``n`` x ``u64`` frame lengths, then
the frames' bytes, little-endian, back to back. The connecting side's first message is
``[MAGIC, role, identity]``: ``role`` ``b"client"`` or ``b"shard"``, ``identity`` what its
DEALER's routing id would be. The listener (the broker) binds an abstract Unix socket
(:func:`listen`), a name only processes of its network namespace can reach, and accepts only
peers of its own user (``SO_PEERCRED``).

A :class:`Link` never blocks: a message that does not fit the socket's buffer is queued whole
(``pending``) and written out by :meth:`Link.flush` when the socket is writable; a message that
would take the queue past ``limit`` bytes is refused (``send`` returns False, the caller counts
it), never half-sent. Sends are thread safe (one lock per link); one thread reads.
"""
from __future__ import annotations

import collections
import errno
import os
import select
import socket
import struct
import threading

import numpy as np

MAGIC = b"gradbus-link-1"
CLIENT, SHARD = b"client", b"shard"
ROLES = (CLIENT, SHARD)
MAX_FRAMES = 1 << 20              # frames in one message
MAX_MESSAGE = 1 << 38             # bytes in one message (frames and lengths)
READ_CHUNK = 256 << 10            # bytes read at a time from the socket, into a buffer each
                                  # reading thread keeps and parses messages out of
BIG = 1 << 20                     # a message body at least this long is read in place
IOV_MAX = 512                     # buffers per sendmsg call
DEFAULT_LIMIT = 64 << 20          # bytes a link queues before it refuses messages
_N = struct.Struct("<I")
_HEADS = [struct.Struct(f"<I{n}Q") for n in range(9)]   # a message's framing, by frame count
_LENS = [struct.Struct(f"<{n}Q") for n in range(9)]      # ... its frame lengths
_PEERCRED = struct.Struct("3i")
_POLL_IN_OUT = select.POLLIN | select.POLLOUT
_reader = threading.local()       # .chunk: the thread's read buffer, shared by the links it reads


def _chunk() -> memoryview:
    chunk = getattr(_reader, "chunk", None)
    if chunk is None:
        chunk = _reader.chunk = memoryview(bytearray(READ_CHUNK))
    return chunk


class LinkClosed(ConnectionError):
    """The link's peer went away (or sent what is not a link's framing)."""


def byte_view(frame) -> memoryview:
    """The bytes of a frame (bytes, bytearray, memoryview, numpy array, zmq.Frame) as a flat
    byte view."""
    buf = getattr(frame, "buffer", None)      # a zmq.Frame
    if buf is None:
        buf = memoryview(frame) if not isinstance(frame, np.ndarray) else \
            memoryview(np.ascontiguousarray(frame))
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


class Link:
    """One end of a local link (see the module's docstring)."""

    def __init__(self, sock: socket.socket, limit: int = DEFAULT_LIMIT):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.limit = limit
        self.lock = threading.Lock()
        self.out: collections.deque = collections.deque()   # views not yet written
        self.pending = 0                  # their bytes
        self.closed = False
        self.bad: str | None = None       # what was wrong with what the peer sent
        self.refused = 0                  # messages refused with the queue full
        self.rbuf = bytearray()           # bytes read, not yet a whole message
        self.big: bytearray | None = None   # a large message's body, being read in place
        self.big_lens: list | None = None
        self.big_got = 0
        self.ready: collections.deque = collections.deque()   # whole messages, not yet taken
        self.drained = False              # the last read took all the socket had

    def fileno(self) -> int:
        return self.fd

    # -- writing ---------------------------------------------------------------------------------
    def send(self, frames) -> bool:
        """Queue one message and write what the socket takes now; False when the link is
        closed or its queue would pass ``limit`` (the message then goes nowhere)."""
        views = [byte_view(f) for f in frames]
        lens = [v.nbytes for v in views]
        n = len(lens)
        head = (_HEADS[n] if n < len(_HEADS) else struct.Struct(f"<I{n}Q")).pack(n, *lens)
        size = len(head) + sum(lens)
        with self.lock:
            if self.closed:
                return False
            if self.pending:
                if self.pending + size > self.limit:
                    self.refused += 1
                    return False
            elif n < IOV_MAX:
                # nothing queued (the usual case): one write of the whole message, queued only
                # for what the socket did not take
                sent = self._sendmsg([head, *views])
                if sent == size:
                    return True
                if self.closed:
                    return False
                self._queue(memoryview(head), views, size)
                self._drop_sent(sent)
                return True
            self._queue(memoryview(head), views, size)
            self._write()
            return not self.closed

    def _queue(self, head: memoryview, views: list, size: int) -> None:
        self.out.append(head)
        self.out.extend(v for v in views if v.nbytes)
        self.pending += size

    def flush(self) -> bool:
        """Write what the socket takes of what is queued; True once nothing is."""
        with self.lock:
            if self.pending and not self.closed:
                self._write()
            return not self.pending

    def _write(self) -> None:
        out = self.out
        while out:
            n = self._sendmsg([out[i] for i in range(min(len(out), IOV_MAX))])
            if not n:
                return
            self._drop_sent(n)

    def _sendmsg(self, bufs: list) -> int:
        """Write what the socket takes of ``bufs`` now; the bytes written (0 when it takes
        none now, or when the link failed: it is closed then)."""
        try:
            return self.sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._close()
            return 0

    def _drop_sent(self, n: int) -> None:
        """Take the ``n`` bytes just written off the front of the queue."""
        out = self.out
        self.pending -= n
        while n:
            first = out[0]
            if n >= first.nbytes:
                n -= first.nbytes
                out.popleft()
            else:
                out[0] = first[n:]
                n = 0

    # -- reading ---------------------------------------------------------------------------------
    def recv(self) -> list | None:
        """The next whole message (a list of frames: bytes, or views of one buffer for a large
        message), or None when none has arrived whole yet (or the last read emptied the socket:
        poll it before asking again). Raises :class:`LinkClosed` once the
        peer closed the link and every message it sent was taken."""
        if not self.ready:
            if self.drained and not self.closed:
                self.drained = False        # the last read emptied the socket: a poll first,
                return None                 # not a read that fails (a syscall and an exception)
            self._read()
        if self.ready:
            return self.ready.popleft()
        if self.closed:
            raise LinkClosed("the link's peer closed it")
        return None

    @property
    def buffered(self) -> bool:
        """Whole messages were read and not yet taken: readiness the socket will not show."""
        return bool(self.ready)

    def _read(self) -> None:
        sock, chunk = self.sock, _chunk()
        for _ in range(64):                 # bounded: other links get their turn
            if self.big is not None:
                view = memoryview(self.big)[self.big_got:]
                try:
                    n = sock.recv_into(view)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    n = 0
                view.release()
                if n == 0:
                    self._close()
                    return
                self.big_got += n
                if self.big_got == len(self.big):
                    self._take_big()
                continue
            try:
                n = sock.recv_into(chunk)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if not n:
                self._close()
                return
            rbuf = self.rbuf
            if rbuf:
                rbuf += chunk[:n]
                with memoryview(rbuf) as view:
                    pos = self._parse(view, len(rbuf))
                del rbuf[:pos]
            else:                          # whole messages straight from what was read
                pos = self._parse(chunk, n)
                if pos < n and self.bad is None:
                    rbuf += chunk[pos:n]
            if self.bad is not None:
                rbuf.clear()
                return
            if self.ready and n < READ_CHUNK:
                self.drained = True
                return

    def _parse(self, buf: memoryview, end: int) -> int:
        """Take the whole messages in ``buf[:end]`` (and start reading a large one in place);
        returns how many bytes were taken."""
        pos = 0
        while True:
            have = end - pos
            if have < 4:
                break
            n = _N.unpack_from(buf, pos)[0]
            if n > MAX_FRAMES:
                self._bad(f"{n} frames")
                return pos
            head = 4 + 8 * n
            if have < head:
                break
            lens = (_LENS[n] if n < len(_LENS) else struct.Struct(f"<{n}Q")).unpack_from(
                buf, pos + 4)
            body = sum(lens)
            if body > MAX_MESSAGE:
                self._bad(f"a {body} B message")
                return pos
            if have < head + body:
                if body >= BIG:              # read the rest of it in place
                    start = pos + head
                    self.big = bytearray(body)
                    got = end - start
                    self.big[:got] = buf[start:end]
                    self.big_lens, self.big_got = list(lens), got
                    pos = end
                break
            off = pos + head
            frames = []
            for k in lens:
                frames.append(bytes(buf[off:off + k]))
                off += k
            self.ready.append(frames)
            pos = off
        return pos

    def _take_big(self) -> None:
        view, frames, off = memoryview(self.big), [], 0
        for k in self.big_lens:
            frames.append(view[off:off + k])
            off += k
        self.ready.append(frames)
        self.big = self.big_lens = None
        self.big_got = 0

    def _bad(self, what: str) -> None:
        self._close()
        self.bad = what             # what was read is dropped once its view is released

    def _close(self) -> None:
        self.closed = True

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.out.clear()
            self.pending = 0
        try:
            self.sock.close()
        except OSError:
            pass


# ----------------------------------------------------------------------------- the two ends
def listen(cluster: str) -> tuple[socket.socket, str]:
    """A listening socket on a fresh abstract name for ``cluster``; returns it and the name
    peers connect to."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"gradbus-{cluster}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        s.bind("\0" + name)
        s.listen(128)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s, name


def accept(listener: socket.socket) -> Link | None:
    """A peer's new link, when one is waiting and it is this process's user; None otherwise."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            return None
        raise
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _PEERCRED.size))
    if uid != os.getuid():
        sock.close()
        return None
    return Link(sock)


def connect(name: str, role: bytes, identity: bytes, limit: int = DEFAULT_LIMIT) -> Link | None:
    """A link to the listener at abstract ``name``, introduced as ``role`` with ``identity``;
    None when it cannot be reached (another host or network namespace, a broker gone)."""
    if type(name) is not str or not name or len(name) > 100 or "\0" in name:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + name)
    except OSError:
        s.close()
        return None
    link = Link(s, limit)
    if not link.send([MAGIC, role, identity]):
        link.close()
        return None
    return link


def introduction(frames) -> tuple[bytes, bytes] | None:
    """``(role, identity)`` of a link's first message, or None when it is not one."""
    if (len(frames) != 3 or bytes(frames[0]) != MAGIC or bytes(frames[1]) not in ROLES
            or not 0 < len(frames[2]) <= 255):
        return None
    return bytes(frames[1]), bytes(frames[2])


class LinkSocket:
    """A link behind the calls of a ZeroMQ DEALER that a peer's loop makes (``send``,
    ``send_multipart``, ``recv_multipart``, ``poll``, ``close``), so that a loop written for
    the DEALER runs over a link unchanged. ``recv_multipart`` raises ``zmq.Again`` when no whole
    message is there (``take`` returns None instead); once the peer closed the link (or a
    message could not be queued) it does so for good and ``lost`` is set: the loop makes a new
    connection."""

    def __init__(self, lnk: Link):
        self.link = lnk
        self.lost = False
        self._poll = select.poll()          # one per link: the loop polls every turn
        self._flags = 0

    def fileno(self) -> int:
        return self.link.fd

    def send(self, msg, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        self._sent(self.link.send([msg]))

    def send_multipart(self, frames, flags: int = 0, copy: bool = True,
                       track: bool = False) -> None:
        self._sent(self.link.send(frames))

    def _sent(self, ok: bool) -> None:
        if not ok:
            self.lost = True

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> list:
        frames = self.take()
        if frames is None:
            import zmq
            raise zmq.Again()
        return frames

    def take(self) -> list | None:
        """The next whole message, or None when none is there (:meth:`recv_multipart` without
        the exception, for a loop that drains every turn)."""
        if self.lost:
            return None
        try:
            return self.link.recv()
        except LinkClosed:
            self.lost = True
            return None

    def poll(self, timeout: int | None = None, flags: int = 1) -> int:
        """POLLIN (1) when a message can be taken, else 0 after ``timeout`` ms; writes what is
        queued meanwhile."""
        lnk = self.link
        if lnk.buffered or self.lost or lnk.closed:
            return 1
        if lnk.pending:
            lnk.flush()
        flags = _POLL_IN_OUT if lnk.pending else select.POLLIN
        if flags != self._flags:
            self._poll.register(lnk.fd, flags)
            self._flags = flags
        got = self._poll.poll(timeout)
        if got and got[0][1] & select.POLLOUT:
            lnk.flush()
        return 1 if got and got[0][1] & (select.POLLIN | select.POLLHUP | select.POLLERR) else 0

    def close(self, linger: int | None = None) -> None:
        self.link.close()
