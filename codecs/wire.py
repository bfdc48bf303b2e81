"""The gradbus wire format. This module is the only one that packs or unpacks a message;
:mod:`.messages` turns an unpacked header into a typed message, every field checked.

A message is a list of ZeroMQ frames::

    [routing frames...]  header  tensor_0  tensor_1 ...  tensor_{n-1}

* routing frames are added and removed by ROUTER sockets (identity) and XPUB (topic); they are not
  part of the message proper.
* ``header`` is a msgpack map: ``{"v": PROTOCOL, "kind": str, ...kind fields..., "t": [desc...]}``.
* Each tensor frame is raw bytes described by one entry of ``"t"``, in order::

      {"k": key, "d": dtype, "s": [shape], "c": codec chain, "n": encoded bytes,
       "x": xxh3-64 checksum of the encoded bytes, "ver": version (optional),
       "base": for delta weights, the publish seq the frame is a change on (optional),
       "cnt": for gradients, how many gradients the frame sums (optional, default 1),
       "ids": for a table's rows, the row ids as little-endian int64 bytes; the frame then
              holds the rows, shape [len(ids), dim] (optional),
       "r": the bytes are in a shared-memory segment, not in the frame, which is then empty:
            [segment, offset] (a client's push ring) or [segment, offset, stamp] (a shard's
            weights board); see :mod:`gradbus.codecs.shm` (optional)}

Tensors never travel pickled. A receiver validates, before using anything: the frame count against
``len(t)``, the protocol version, the kind against its allow-list, the required header fields and
their types (:data:`SCHEMA`), the dtype allow-list, that the shape is a list of non-negative ints
whose decoded size is under the cap, that each frame's length equals its ``n`` (and, for fixed-size
chains, the length the chain gives for the shape: :func:`tensor.encoded_len_fixed`), and, where the
tensor is decoded, the checksum and every count and length inside the payload.
A violation raises :class:`~gradbus.codecs.errors.WireError` with a code.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash
import zmq

from . import device
from . import tensor as tcodec
from .errors import Code, WireError

PROTOCOL = 1
MAX_HEADER_BYTES = 4 << 20        # a header above this is refused before unpacking
MAX_TENSORS = 65536               # tensors in one message
MAX_TENSOR_BYTES = 1 << 30        # default cap on one decoded tensor (1 GiB)
MAX_COUNT = 1 << 20               # most gradients one frame may sum (its ``cnt``): a tensor's
                                  # version moves by at most this much per push
MAX_NDIM = 8
# Per-container limits for header unpacking: a 4 MiB header of millions of empty lists would
# otherwise cost hundreds of MiB and seconds of the receiver's loop before any check runs.
_UNPACK_LIMITS = {"max_array_len": 1 << 17, "max_map_len": 1 << 17,
                  "max_str_len": MAX_HEADER_BYTES, "max_bin_len": MAX_HEADER_BYTES, "max_ext_len": 0}

# Message kinds. Frontend = clients and shards' discovery; backend = shards; events = XPUB.
HELLO, WELCOME = "hello", "welcome"
INIT, INIT_OK = "init", "init_ok"
PUSH, ACK = "push", "ack"
SNAPSHOT, SNAPSHOT_REPLY = "snapshot", "snapshot_reply"
CATALOG, CATALOG_REPLY = "catalog", "catalog_reply"
STATUS, STATUS_REPLY = "status", "status_reply"
HEARTBEAT, BYE, ERROR = "heartbeat", "bye", "error"
REGISTER, REGISTERED = "register", "registered"
BATCH, APPLIED = "batch", "applied"
UPDATE, TABLE = "update", "table"
# replication: catch-up of a standby, fencing, state digests
ADOPT, STATE_REQ, STATE, SYNCED = "adopt", "state_req", "state", "synced"
DROP, DIGEST, DIGEST_REPLY = "drop", "digest", "digest_reply"
CHECKPOINT, CHECKPOINT_REPLY = "checkpoint", "checkpoint_reply"
ADMIN, ADMIN_REPLY, STOP = "admin", "admin_reply", "stop"   # rebalance, drain; a drained shard
ROWS, ROWS_REPLY = "rows", "rows_reply"                      # reads of embedding table rows
FREE = "free"                     # push slots in shared memory the broker no longer needs
FOLLOW, CREDIT = "follow", "credit"   # conflated delivery: partitions followed, reads done
PAIR = "pair"                         # a broker pair's state, on the pair link (section 23)

ACKS_ALL = -1                     # the wire value of acks="all"

_INT = (int,)
_STR = (str,)
_LIST = (list,)
_MAP = (dict,)
_BIN = (bytes,)

#: kind -> {field: (allowed types, required)}. Fields not named are ignored.
SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    HELLO: {"role": (_STR, True)},
    WELCOME: {"events": (_INT, True), "backend": (_INT, True), "partitions": (_INT, True)},
    INIT: {"msg": (_INT, True), "opt": (_MAP, True), "tensors": (_LIST, True)},
    INIT_OK: {"msg": (_INT, True), "created": (_LIST, True), "existing": (_LIST, True)},
    PUSH: {"msg": (_INT, True), "acks": (_INT, True)},
    ACK: {"msg": (_INT, True)},
    FREE: {"msgs": (_LIST, True)},
    SNAPSHOT: {"req": (_INT, True), "keys": (_LIST, True)},
    SNAPSHOT_REPLY: {"req": (_INT, True), "parts": (_LIST, True)},
    CATALOG: {"req": (_INT, True)},
    CATALOG_REPLY: {"req": (_INT, True), "tensors": (_LIST, True)},
    STATUS: {"req": (_INT, True)},
    STATUS_REPLY: {"req": (_INT, True), "status": (_MAP, True)},
    HEARTBEAT: {},
    BYE: {},
    ERROR: {"code": (_STR, True), "message": (_STR, True)},
    REGISTER: {"shard": (_STR, True)},
    REGISTERED: {"shard": (_STR, True)},
    BATCH: {"parts": (_LIST, True)},
    APPLIED: {"parts": (_LIST, True)},
    UPDATE: {"p": (_INT, True), "seq": (_INT, True), "epoch": (_INT, True)},
    ADOPT: {"p": (_INT, True)},
    STATE_REQ: {"p": (_INT, True), "to": (_STR, True)},
    STATE: {"p": (_INT, True), "to": (_STR, True), "seq": (_INT, True), "epoch": (_INT, True),
            "blocks": (_LIST, True)},
    SYNCED: {"p": (_INT, True), "seq": (_INT, True)},
    DROP: {"ps": (_LIST, True)},
    DIGEST: {"req": (_INT, True)},
    DIGEST_REPLY: {"req": (_INT, True), "shard": (_STR, True), "parts": (_LIST, True)},
    CHECKPOINT: {"req": (_INT, True)},
    ADMIN: {"req": (_INT, True), "op": (_STR, True)},
    ADMIN_REPLY: {"req": (_INT, True), "result": (_MAP, True)},
    ROWS: {"req": (_INT, True), "table": (_STR, True), "q": (_LIST, True)},
    ROWS_REPLY: {"req": (_INT, True)},
    STOP: {},
    CHECKPOINT_REPLY: {"req": (_INT, True), "shard": (_STR, True)},
    TABLE: {"version": (_INT, True), "owners": (_LIST, True)},
    FOLLOW: {"ps": (_LIST, True)},
    CREDIT: {"ps": (_LIST, True), "seqs": (_LIST, True)},
    PAIR: {"role": (_STR, True), "epoch": (_INT, True), "run": (_INT, True)},
}

FRONTEND_KINDS = frozenset({HELLO, INIT, PUSH, SNAPSHOT, ROWS, CATALOG, STATUS, DIGEST,
                            CHECKPOINT, ADMIN, HEARTBEAT, BYE, FOLLOW, CREDIT})
BACKEND_KINDS = frozenset({REGISTER, HEARTBEAT, APPLIED, SNAPSHOT_REPLY, ROWS_REPLY, STATE,
                           SYNCED, DIGEST_REPLY, CHECKPOINT_REPLY, ERROR, BYE})
SHARD_KINDS = frozenset({REGISTERED, HEARTBEAT, BATCH, SNAPSHOT, ROWS, ADOPT, STATE_REQ, STATE,
                         DROP, DIGEST, CHECKPOINT, STOP, ERROR})
CLIENT_KINDS = frozenset({WELCOME, INIT_OK, ACK, FREE, SNAPSHOT_REPLY, ROWS_REPLY, CATALOG_REPLY,
                          STATUS_REPLY, DIGEST_REPLY, CHECKPOINT_REPLY, ADMIN_REPLY, ERROR,
                          UPDATE, TABLE, HEARTBEAT})


def frame_buffer(frame):
    """The bytes of a received ``zmq.Frame`` (zero-copy) or of a plain buffer."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def frame_len(frame) -> int:
    """A frame's length in bytes without copying it."""
    t = type(frame)
    if t is memoryview:             # a link's or a pipe's frame
        return frame.nbytes
    if t is zmq.Frame or t is bytes:
        return len(frame)
    return frame.buffer.nbytes if hasattr(frame, "buffer") else memoryview(frame).nbytes


def checksum(buf) -> int:
    """xxh3-64 of a frame's bytes (about 20x faster than CRC-32 here)."""
    return xxhash.xxh3_64_intdigest(buf)


@dataclass(slots=True)
class TensorDesc:
    key: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    nbytes: int
    checksum: int
    version: int | None = None
    base: int | None = None    # weights only: the frame is a delta on the block published at seq
    count: int = 1             # gradients only: how many gradients this one sums (local steps)
    ids: bytes | None = None   # table rows only: the row ids (little-endian int64)
    ref: list | None = None    # the bytes are in shared memory: [segment, offset(, stamp)]

    def to_wire(self) -> dict:
        d = {"k": self.key, "d": self.dtype, "s": list(self.shape), "c": self.codec,
             "n": self.nbytes, "x": self.checksum}
        if self.version is not None:
            d["ver"] = self.version
        if self.base is not None:
            d["base"] = self.base
        if self.count != 1:
            d["cnt"] = self.count
        if self.ids is not None:
            d["ids"] = self.ids
        if self.ref is not None:
            d["r"] = self.ref
        return d

    def row_ids(self) -> np.ndarray:
        """The row ids of a table rows frame (a read-only int64 view)."""
        return row_ids(self.ids)


def row_ids(ids: bytes) -> np.ndarray:
    """Row ids as sent (little-endian int64 bytes) -> a read-only int64 view."""
    return np.frombuffer(ids, dtype="<i8")


def encode_tensor(key: str, arr: np.ndarray, chain: str = "raw", version: int | None = None,
                  rng=None, hashed: bool = True):
    """Encode one tensor: returns ``(desc dict, frame buffer)``. ``rng`` feeds the stochastic
    codecs (randomk, int8 rounding). ``hashed=False``: ``x`` is 0 (a block published into a
    board; whoever copies it into a frame sets it, see :func:`inline_refs`)."""
    applied, buf = _encoder(arr)(arr, chain, rng=rng)
    return _desc(key, arr, applied, buf, version, hashed), buf


def encode_tensor_lossy(key: str, arr: np.ndarray, chain: str, rng=None,
                        version: int | None = None):
    """Encode one tensor and also return what the receiver will decode:
    ``(desc dict, frame buffer, decoded array)`` (for error feedback and weight deltas)."""
    applied, buf, decoded = _encoder(arr)(arr, chain, rng=rng, want_decoded=True)
    return _desc(key, arr, applied, buf, version), buf, decoded


def _encoder(arr):
    """The host codec, or for a GPU array the device one (only compressed bytes cross)."""
    return device.encode if device.is_device(arr) else tcodec.encode


def split_weights_codec(chain: str) -> tuple[bool, str]:
    """``"delta|bf16"`` -> ``(True, "bf16")``: weight republish as the change since the last
    published block, coded with the rest of the chain. Validates the rest."""
    delta = chain == "delta" or chain.startswith("delta|")
    rest = chain[len("delta|"):] if chain.startswith("delta|") else ("raw" if delta else chain)
    if not delta and tcodec.parse_stages(rest).sparsifier is not None:
        raise WireError(Code.BAD_CODEC, f"weights codec {chain!r}: a sparsifier would publish "
                                        f"zeros for the weights it drops; use delta|{chain}")
    tcodec.parse_chain(rest)
    return delta, rest


def _desc(key: str, arr: np.ndarray, applied: str, buf, version: int | None,
          hashed: bool = True) -> dict:
    mv = memoryview(buf)
    desc = {"k": key, "d": tcodec.dtype_name(arr.dtype), "s": list(arr.shape), "c": applied,
            "n": mv.nbytes, "x": checksum(mv) if hashed else 0}
    if version is not None:
        desc["ver"] = version
    return desc


def _bad(code: Code, msg: str):
    raise WireError(code, msg)


def parse_desc(d, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> TensorDesc:
    """Validate one tensor descriptor (no frame needed)."""
    if not isinstance(d, dict):
        _bad(Code.BAD_FIELD, "tensor descriptor must be a map")
    get = d.get
    key, dtype, shape, codec, n, x = get("k"), get("d"), get("s"), get("c"), get("n"), get("x")
    if type(key) is not str or not key or len(key) > 512:
        _bad(Code.BAD_FIELD, "tensor key must be a non-empty string")
    if type(dtype) is not str or dtype not in tcodec.ALLOWED_DTYPES:
        _bad(Code.BAD_DTYPE, f"{key}: dtype {dtype!r} is not allowed")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        _bad(Code.BAD_SHAPE, f"{key}: shape must be a list of at most {MAX_NDIM} non-negative ints")
    size = 1
    nonzero = 1
    for s in shape:      # type() is int: msgpack ints, never bools
        if type(s) is not int or not 0 <= s < 2**40:
            _bad(Code.BAD_SHAPE, f"{key}: shape must be a list of at most {MAX_NDIM} "
                                 "non-negative ints")
        size *= s
        nonzero *= s or 1
    if nonzero >= 2**62:
        _bad(Code.BAD_SHAPE, f"{key}: shape {shape} is out of range")
    itemsize = tcodec.DTYPES[dtype].itemsize
    if size * itemsize > max_tensor_bytes:
        _bad(Code.TOO_LARGE, f"{key}: {size * itemsize} B decoded is above the cap of "
                             f"{max_tensor_bytes} B")
    if type(codec) is not str:
        _bad(Code.BAD_CODEC, f"{key}: codec must be a string")
    if type(n) is not int or n < 0:
        _bad(Code.BAD_FIELD, f"{key}: n must be a non-negative int")
    if type(x) is not int or not 0 <= x < 2**64:
        _bad(Code.BAD_FIELD, f"{key}: x (checksum) must be a uint64")
    # raw: the array's bytes (the chain every uncompressed push and weight has); any other
    # chain is parsed (raises BAD_CODEC)
    fixed = size * itemsize if codec == "raw" else tcodec.encoded_len_fixed(codec, dtype, shape)
    if fixed is not None and fixed != n:
        _bad(Code.BAD_SHAPE, f"{key}: shape {shape} of {dtype} with codec {codec} needs "
                             f"{fixed} bytes, header says {n}")
    ver, base, cnt = get("ver"), get("base"), get("cnt", 1)
    if ver is not None and (type(ver) is not int or ver < 0):
        _bad(Code.BAD_FIELD, f"{key}: ver must be a non-negative int")
    if base is not None and (type(base) is not int or base < 0):
        _bad(Code.BAD_FIELD, f"{key}: base must be a non-negative int")
    if type(cnt) is not int or not 1 <= cnt <= MAX_COUNT:
        _bad(Code.BAD_FIELD, f"{key}: cnt must be an int in 1..{MAX_COUNT}")
    ids = d.get("ids")
    if ids is not None:
        if not isinstance(ids, bytes) or len(ids) % 8:
            _bad(Code.BAD_FIELD, f"{key}: ids must be int64 bytes")
        if len(shape) != 2 or shape[0] != len(ids) // 8:
            _bad(Code.BAD_SHAPE, f"{key}: {len(ids) // 8} row ids need rows of shape "
                                 f"[{len(ids) // 8}, dim], not {shape}")
    ref = d.get("r")
    if ref is not None and not (type(ref) is list and 2 <= len(ref) <= 3
                                and type(ref[0]) is str and len(ref[0]) <= 128
                                and all(type(v) is int and 0 <= v < 2**63 for v in ref[1:])):
        _bad(Code.BAD_FIELD, f"{key}: r must be [segment, offset] or [segment, offset, stamp]")
    return TensorDesc(key, dtype, tuple(shape), codec, n, x, ver, base, cnt, ids, ref)


def unpack_header(frame, allowed_kinds: frozenset[str]) -> dict:
    """Unpack and validate a header frame: size, msgpack, map, version, kind, fields."""
    buf = frame.bytes if hasattr(frame, "bytes") else frame
    if len(buf) > MAX_HEADER_BYTES:
        _bad(Code.BAD_FRAME, f"header of {len(buf)} B above {MAX_HEADER_BYTES} B")
    try:
        h = msgpack.unpackb(buf, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several types for garbage
        _bad(Code.BAD_FRAME, f"header is not msgpack: {type(e).__name__}")
    if not isinstance(h, dict):
        _bad(Code.BAD_FRAME, "header must be a msgpack map")
    v = h.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v != PROTOCOL:
        _bad(Code.BAD_VERSION, f"protocol version {h.get('v')!r} not supported (want {PROTOCOL})")
    kind = h.get("kind")
    if not isinstance(kind, str) or kind not in allowed_kinds:
        _bad(Code.UNKNOWN_KIND, f"message kind {kind!r} is not accepted here")
    for name, (types, required) in SCHEMA[kind].items():
        if name not in h:
            if required:
                _bad(Code.BAD_FIELD, f"{kind}: field {name!r} missing")
            continue
        v = h[name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            _bad(Code.BAD_FIELD, f"{kind}: field {name!r} has type {type(v).__name__}")
    t = h.get("t", [])
    if not isinstance(t, list) or len(t) > MAX_TENSORS:
        _bad(Code.BAD_FIELD, f"{kind}: 't' must be a list of at most {MAX_TENSORS} descriptors")
    return h


def parse_tensors(h: dict, frames, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> list[TensorDesc]:
    """Validate the descriptors in ``h['t']`` against ``frames`` (the tensor frames)."""
    return parse_descs(h["kind"], h.get("t", []), frames, max_tensor_bytes)


def parse_descs(kind: str, t: list, frames,
                max_tensor_bytes: int = MAX_TENSOR_BYTES) -> list[TensorDesc]:
    """Validate a message's descriptors ``t`` against ``frames`` (its tensor frames)."""
    if len(frames) != len(t):
        _bad(Code.BAD_FRAME, f"{kind}: header describes {len(t)} tensors, "
                             f"{len(frames)} frames came")
    descs = [parse_desc(d, max_tensor_bytes) for d in t]
    for desc, fr in zip(descs, frames):
        size = frame_len(fr)
        if size != desc.nbytes and (size or desc.ref is None):
            _bad(Code.BAD_SHAPE, f"{desc.key}: frame has {size} bytes, header says {desc.nbytes}")
    return descs


def decode_tensor(desc: TensorDesc, frame, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                  verify: bool = True) -> np.ndarray:
    """Checksum then decode one frame; the result may be a read-only view of the frame."""
    return tcodec.decode(_checked(desc, frame, verify), desc.codec, desc.dtype, desc.shape,
                         max_tensor_bytes)


def _checked(desc: TensorDesc, frame, verify: bool):
    """The frame's buffer, after its checksum was verified (unless ``verify`` is off)."""
    buf = frame_buffer(frame)
    if verify and checksum(buf) != desc.checksum:
        _bad(Code.BAD_CHECKSUM, f"{desc.key}: checksum mismatch")
    return buf


def decode_tensor_staged(desc: TensorDesc, frame, max_tensor_bytes: int = MAX_TENSOR_BYTES):
    """Checksum, then every stage but the value coder (see
    :func:`gradbus.codecs.tensor.decode_staged`): ``(indices or None, arrays, coder, dtype, k)``
    for a backend's ``decode_values``."""
    idx, arrays, coder, dt, k, _ = tcodec.decode_staged(_checked(desc, frame, True), desc.codec,
                                                        desc.dtype, desc.shape, max_tensor_bytes)
    return idx, arrays, coder, dt, k


class TensorStream:
    """A tensor frame read piece by piece (see :func:`stream_tensor`): every piece's bytes are
    hashed as it is decoded, and :meth:`verified` says, once all were read in order, whether
    the frame matched its checksum. Values read before that are not to be trusted yet."""

    __slots__ = ("pieces", "hasher", "want")

    def __init__(self, desc: TensorDesc, pieces: tcodec.Pieces):
        self.pieces = pieces
        self.hasher = xxhash.xxh3_64()
        self.want = desc.checksum

    def read(self, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
        """Values ``[lo, hi)``: call with consecutive ranges from 0 to the end."""
        enc = self.pieces.encoded(lo, hi)
        self.hasher.update(enc)
        return self.pieces.values(enc, scratch)

    def add_into(self, out: np.ndarray, first: bool, w: np.ndarray | None) -> bool:
        """The whole frame hashed, then its values set (``first``) or added into ``out``, times
        ``w`` when given (see :meth:`tcodec.Pieces.add_into`); False, with nothing read, where
        that takes the pieces one by one (:meth:`read`) instead."""
        if not self.pieces.add_into(out, first, w):
            return False
        self.hasher.update(self.pieces.data)
        return True

    def verified(self) -> bool:
        return self.hasher.intdigest() == self.want

    def peek(self, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
        """Values ``[lo, hi)``, in any order and from any thread, *not* hashed: for readers
        that split a frame between threads and check it whole with :meth:`matches`."""
        return self.pieces.values(self.pieces.encoded(lo, hi), scratch)

    def matches(self) -> bool:
        """Whether the whole frame matches its checksum (one pass of its own, the interpreter
        lock released for it)."""
        return checksum(self.pieces.data) == self.want


def stream_tensor(desc: TensorDesc, frame, max_tensor_bytes: int = MAX_TENSOR_BYTES):
    """A :class:`TensorStream` over a dense frame whose values decode one by one (raw, fp16,
    bf16), its length already checked; None for other chains (use :func:`decode_tensor_staged`).
    Reading it costs one pass over the frame where checksum-then-decode costs two or three."""
    pieces = tcodec.pieces(frame_buffer(frame), desc.codec, desc.dtype, desc.shape,
                           max_tensor_bytes)
    return None if pieces is None else TensorStream(desc, pieces)


# ----------------------------------------------------------------------------- shared memory
def _ref_ok(r, n) -> bool:
    return (type(r) is list and 2 <= len(r) <= 3 and type(r[0]) is str
            and all(type(v) is int and v >= 0 for v in r[1:]) and type(n) is int
            and 0 <= n <= MAX_TENSOR_BYTES)


def resolve_refs(t: list, frames: list, mapper, unreadable=None) -> bool:
    """Put the bytes that descriptors ``t`` (a header's raw ``t``) reference in shared memory
    (``r``) into
    ``frames`` (the tensor frames, changed in place): a view into a push ring, a copy out of a
    weights board. False when a board block was rewritten before it was read whole; a ref that
    names no readable segment raises :class:`WireError`, or with ``unreadable`` (called with
    the error and the byte count) puts what that returns there instead (a ring's; for a
    board's or a reply area's the answer is False). Malformed descriptors
    are left for :func:`parse_tensors` to refuse."""
    if not t or type(t) is not list:
        return True
    for i, d in enumerate(t):
        r = d.get("r") if type(d) is dict else None
        if r is None or i >= len(frames) or frame_len(frames[i]):
            continue
        n = d.get("n")
        if not _ref_ok(r, n):
            continue
        try:
            buf = mapper.view(r, n) if len(r) == 2 else mapper.copy(r, n)
        except WireError as e:
            if unreadable is None:
                raise
            if len(r) == 3:      # a board's or reply area's block not read is not read whole
                return False
            buf = unreadable(e, n)
        if buf is None:
            return False
        frames[i] = buf
    return True


def inline_refs(frames: list, at: int, mapper, copy: bool) -> list | None:
    """``frames`` (header at ``at``, tensor frames after it) with the bytes its descriptors
    reference in shared memory put into the frames and the refs taken out of the header: for a
    receiver that does not read shared memory. ``copy``: copies, not views, of ring bytes.
    None when a board block was rewritten before it was read whole."""
    head = frames[at]
    h = msgpack.unpackb(head.bytes if hasattr(head, "bytes") else head, raw=False)
    t = h.get("t") or ()
    out = None
    for i, d in enumerate(t):
        r = d.pop("r", None)
        if r is None:
            continue
        if out is None:
            out = list(frames)
        n = d["n"]
        if len(r) == 3:
            buf = mapper.copy(r, n)
            if buf is None:
                return None
            d["x"] = checksum(buf)     # a board's publisher need not hash what it wrote
        else:
            buf = mapper.view(r, n)
            if copy:
                buf = bytes(buf)
        out[at + 1 + i] = buf
    if out is None:
        return frames
    out[at] = msgpack.packb(h, use_bin_type=True)
    return out


def with_fields(frame, **fields) -> bytes:
    """A header frame packed again with ``fields`` set (a request asked again otherwise)."""
    h = msgpack.unpackb(frame.bytes if hasattr(frame, "bytes") else frame, raw=False)
    h.update(fields)
    return msgpack.packb(h, use_bin_type=True)


def has_refs(t) -> bool:
    """Whether descriptors ``t`` (a header's raw ``t``) reference shared memory."""
    return type(t) is list and any(type(d) is dict and "r" in d for d in t)


def with_refs(frames: list, refs: list) -> list:
    """A message (header first) whose tensor frames now lie in shared memory at ``refs``
    (one ``[segment, offset]`` per frame): the header with each descriptor's ``r`` set, then
    empty frames (a relay's BATCH)."""
    h = msgpack.unpackb(frames[0], raw=False)
    for d, ref in zip(h["t"], refs):
        d["r"] = ref
    return [msgpack.packb(h, use_bin_type=True), *([b""] * len(refs))]


def inline_descs(t_list: list, frames: list, mapper) -> tuple[list, list]:
    """Descriptors and frames with ring bytes in the frames, for the update log."""
    if not any("r" in d for d in t_list):
        return t_list, frames
    descs, out = [], []
    for d, fr in zip(t_list, frames):
        if "r" in d:
            fr = mapper.view(d["r"], d["n"])
            d = {k: v for k, v in d.items() if k != "r"}
        descs.append(d)
        out.append(fr)
    return descs, out


def pack(kind: str, descs: list | None = None, /, **fields) -> bytes:
    """Pack a header. ``descs`` is the list of tensor descriptor maps (or TensorDesc)."""
    h = {"v": PROTOCOL, "kind": kind}
    h.update(fields)
    if descs:
        h["t"] = [d.to_wire() if isinstance(d, TensorDesc) else d for d in descs]
    return msgpack.packb(h, use_bin_type=True)


def error(code: Code | str, message: str, **fields) -> bytes:
    return pack(ERROR, code=str(code.value if isinstance(code, Code) else code),
                message=message[:1000], **fields)


def topic_partition(p: int) -> bytes:
    """XPUB topic of a partition's weight updates: ``b"p" + 2-byte big-endian id``."""
    return b"p" + p.to_bytes(2, "big")


def topic_partition_shm(p: int) -> bytes:
    """XPUB topic of a partition's weight updates for subscribers that read shared memory:
    ``b"r" + 2-byte big-endian id`` (its tensors may be references into a shard's board)."""
    return b"r" + p.to_bytes(2, "big")


TOPIC_TABLE = b"t"
TOPIC_HEARTBEAT = b"h"
