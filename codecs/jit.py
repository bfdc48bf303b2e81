"""numba loops for the half-precision codecs, used when numba imports (the ``fast`` extra).

Each loop gives bit for bit what the numpy path in :mod:`.tensor` gives (tests check both): one
pass over memory where the numpy path takes several, so a worker's bf16 encode of 4 MiB takes
about 0.17 ms here instead of 1.2 ms, and fp16 about 0.8 ms instead of 3.1 ms; a shard adds a
bf16 gradient of 1M values into its sum in about 0.2 ms, where decoding then adding takes 0.4.

They are compiled on first use (not at import: a process that never encodes half precision never
imports numba), with ``cache=True`` so a later process loads them from disk.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

import numpy as np

#: ``GRADBUS_JIT=0`` keeps the numpy path even where numba imports.
ENV = "GRADBUS_JIT"


def _bf16_loop(u, out):
    """float32 bits -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0."""
    for i in range(u.size):
        x = u[i]
        if (x & 0x7FFFFFFF) > 0x7F800000:
            out[i] = 0x7FC0
        else:
            out[i] = (x + 0x7FFF + ((x >> 16) & 1)) >> 16


def _fp16_loop(f, u, out):
    """float32 (``f``, and ``u`` its bits) -> IEEE half bits, round to nearest even (numpy's
    cast); NaN -> 0x7E00 with its sign. Branch-free, so that it vectorizes: both candidates are
    computed and one is kept."""
    for i in range(u.size):
        x = u[i]
        a = x & np.uint32(0x7FFFFFFF)
        sign = (x >> np.uint32(16)) & np.uint32(0x8000)
        # a normal half: rebias the exponent, keep 10 bits, round to nearest even at bit 13 (a
        # carry into the exponent is right, up to inf)
        normal = (a - np.uint32(0x38000000) + np.uint32(0xFFF)
                  + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        # a subnormal half (|x| < 2**-14): |x| * 2**24 is exact, rint rounds it to even
        sub = np.uint32(np.rint(np.abs(f[i]) * np.float32(16777216.0)))
        special = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
        h = sub if a < np.uint32(0x38800000) else (special if a >= np.uint32(0x47800000)
                                                   else normal)
        out[i] = np.uint16(sign | h)


# Accumulating decoders: ``out`` = or += the values a frame codes (times ``w``), in one pass.
# ``mode``: 0 ``out = v``, 1 ``out += v``, 2 ``out = v * w``, 3 ``out += v * w``, where ``v`` is
# the decoded value in ``out``'s dtype: the numpy path's expressions in its order, so both give
# the same bits (replicas with and without numba stay identical).
SCRATCH = 4096    # float32 values the bf16 loop widens at a time (16 KiB: stays in L1)


def add_mode(first: bool, scaled: bool) -> int:
    return (0 if first else 1) + (2 if scaled else 0)


def _add_bf16_loop(bits, out, w, mode, scratch):
    wide = scratch.view(np.uint32)
    n, step = bits.size, scratch.size
    for lo in range(0, n, step):
        m = min(step, n - lo)
        b, o = bits[lo:lo + m], out[lo:lo + m]
        for i in range(m):
            wide[i] = np.uint32(b[i]) << np.uint32(16)
        if mode == 0:
            for i in range(m):
                o[i] = scratch[i]
        elif mode == 1:
            for i in range(m):
                o[i] += scratch[i]
        elif mode == 2:
            for i in range(m):
                o[i] = scratch[i] * w
        else:
            for i in range(m):
                o[i] += scratch[i] * w


def _add_fp16_loop(bits, table, out, w, mode):
    n = bits.size
    if mode == 0:
        for i in range(n):
            out[i] = table[bits[i]]
    elif mode == 1:
        for i in range(n):
            out[i] += table[bits[i]]
    elif mode == 2:
        for i in range(n):
            out[i] = table[bits[i]] * w
    else:
        for i in range(n):
            out[i] += table[bits[i]] * w


def build(make) -> dict | None:
    """``make(numba, numba.types)``: a dict of compiled loops; or None where numba does not
    import, ``GRADBUS_JIT=0``, or compiling fails (no writable cache directory, say: logged, and
    the caller keeps its numpy path). The one gate for every numba loop in gradbus."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        import numba
        from numba import types
    except ImportError:
        return None
    try:
        return make(numba, types)
    except Exception as e:
        logging.getLogger("gradbus").warning("numba loops unavailable (%s); using numpy", e)
        return None


def once(fn):
    """``functools.cache`` for a function of no arguments that is also computed only once when
    several threads make the first call together (numba compiles while the others wait);
    ``__wrapped__`` is ``fn``, uncached."""
    done: list = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def get():
        if not done:
            with lock:
                if not done:
                    done.append(fn())
        return done[0]
    return get


@once
def loops() -> dict | None:
    """The codecs' loops (see :func:`build` for when there are none): encoders
    ``bf16(bits, out)`` and ``fp16(values, bits, out)`` (float32 values, their uint32 bits, the
    uint16 codes; 1-D, C order), and accumulating decoders ``add_bf16(codes, out, w, mode,
    scratch)`` and ``add_fp16(codes, table, out, w, mode)`` (``out`` float32 or float64, ``w``
    of its dtype, ``scratch`` float32 of :data:`SCRATCH` values, ``table`` every half's value
    in ``out``'s dtype)."""
    return build(_compile)


def _compile(numba, types) -> dict:
    def arr(t, readonly=False):
        return types.Array(t, 1, "C", readonly=readonly)

    codes, floats = arr(types.uint16, True), (types.float32, types.float64)
    opts = {"nogil": True, "cache": True, "error_model": "numpy"}
    return {
        "bf16": numba.njit([types.void(arr(types.uint32, True), arr(types.uint16))],
                           **opts)(_bf16_loop),
        "fp16": numba.njit([types.void(arr(types.float32, True), arr(types.uint32, True),
                                       arr(types.uint16))], **opts)(_fp16_loop),
        "add_bf16": numba.njit([types.void(codes, arr(t), t, types.int64, arr(types.float32))
                                for t in floats], **opts)(_add_bf16_loop),
        "add_fp16": numba.njit([types.void(codes, arr(t, True), arr(t), t, types.int64)
                                for t in floats], **opts)(_add_fp16_loop)}
