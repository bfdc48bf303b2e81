"""Array backends for the shard's update math: numpy on the host, or CuPy on a CUDA device.

:func:`load` picks one from ``GRADBUS_BACKEND``: ``numpy``, ``cupy``, or ``auto`` (the default:
cupy when it imports and sees a device, else numpy). Every backend has the same interface:

* ``xp`` (the array module), ``asarray(a, dtype=None)``, ``to_host(a)`` (a numpy array);
* ``decode_values(arrays, coder, dtype, k)``: a frame's coded values (see
  :func:`gradbus.codecs.wire.decode_tensor_staged`) as this backend's array: CuPy copies the
  int8/sign/fp16/bf16 codes to the device and expands them there;
* ``sum_into(out, grads)``: ``out = grads[0] + grads[1] + ...``, added in list order;
* ``sgd_step``, ``momentum_step``, ``adam_step``, ``adagrad_step``: one in-place optimizer step
  from ``g``, the *sum* of ``k`` gradients, applied as ``k`` steps of their mean in closed form
  (the semantics are stated in ``shards/optim.py``; the coefficients are computed here, once,
  for every backend); where ``sums_in_step`` (CuPy), ``g`` may be a list of up to
  ``SUM_GROUP`` gradients, summed in list order inside the step's own kernel; where
  ``steps_out`` (numpy), a step also takes ``out``: the stepped values are written there and
  ``w`` is left as it is (a primary steps a block straight into its weights board);
* ``scatter_add(dense, indices, values)``: ``dense[indices] += values``, duplicates accumulating.

Arrays are flat (1-D), of one dtype. The numpy backend walks them in chunks of ``chunk_bytes``
per array through one chunk-sized temporary, so every pass after a chunk's first stays in cache.
With ``jit`` (what ``load()`` asks for: numba when it imports) its float32/float64 steps run as
numba loops instead: one pass over memory, the same expressions in the same order, the same
bits (a replica may take either path for the same batch: an unaligned frame takes numpy's).
So the numpy path takes no shortcut that rounds differently (momentum's k = 1). The CuPy
backend runs each step as one fused ElementwiseKernel, a batch's sum included.
"""
from __future__ import annotations

import math
import os

import numpy as np

from gradbus.codecs import jit as codec_jit
from gradbus.codecs import tensor as tcodec

from .transfers import DeviceTransfers, HostPins

CHUNK_BYTES = 256 << 10      # per array: a step's 3-5 chunks stay cached between its passes,
                             # and numpy's ~1 us per call is amortized over 64K float32
SUM_GROUP = 8                # gradients one CuPy sum kernel reads per launch
NAMES = ("auto", "numpy", "cupy")


class BackendError(RuntimeError):
    """The requested backend cannot run here."""


def load(name: str | None = None):
    """The backend named by ``name``, else by ``GRADBUS_BACKEND`` (default ``auto``)."""
    name = name or os.environ.get("GRADBUS_BACKEND") or "auto"
    if name == "numpy":
        return NumpyBackend()
    if name == "cupy":
        return CupyBackend()
    if name == "auto":
        try:
            return CupyBackend()
        except BackendError:
            return NumpyBackend()
    raise ValueError(f"GRADBUS_BACKEND={name!r}: expected one of {', '.join(NAMES)}")


# -- closed-form coefficients of k steps of the mean of g (the sum of k gradients) --------------
def momentum_coefs(k: int, lr: float, mu: float) -> tuple[float, float, float, float]:
    """``(a, b, c, d)``: ``w -= a*v + b*g`` (the k velocities summed), then ``v = c*v + d*g``."""
    mk = mu ** k
    s = mu * (1.0 - mk) / (1.0 - mu)                 # sum_{i=1..k} mu^i
    return lr * s, lr * (k - s) / (k * (1.0 - mu)), mk, (1.0 - mk) / (k * (1.0 - mu))


def adam_coefs(k: int, t: int, lr: float, b1: float, b2: float,
               eps: float) -> tuple[float, float, float, float, float, float]:
    """``(b1k, c1, b2k, c2, eps_t, lr_t)``: ``m = b1k*m + c1*g``, ``v = b2k*v + c2*g*g``, then
    ``w -= lr_t * m / (sqrt(v) + eps_t)`` (= ``k*lr*mhat / (sqrt(vhat) + eps)`` at step ``t``)."""
    b1k, b2k = b1 ** k, b2 ** k
    root = math.sqrt(1.0 - b2 ** t)                  # sqrt(vhat) = sqrt(v) / root
    return (b1k, (1.0 - b1k) / k, b2k, (1.0 - b2k) / (k * k), eps * root,
            k * lr * root / (1.0 - b1 ** t))


def adagrad_coefs(k: int) -> tuple[float, float]:
    """``(ia, ik)``: the step divides by ``sqrt(h + ia*g*g) + eps`` (h at the middle of the k
    accumulations), then ``h += ik*g*g`` (k times the squared mean)."""
    return (k + 1) / (2.0 * k * k), 1.0 / k


def _check_sum(out, grads) -> None:
    if not grads:
        raise ValueError("sum_into needs at least one gradient")
    for g in grads:
        if g.shape != out.shape or g.dtype != out.dtype:
            raise ValueError(f"gradient {g.dtype}{list(g.shape)} does not match the output "
                             f"{out.dtype}{list(out.shape)}")


# -- numpy ---------------------------------------------------------------------------------------
class NumpyBackend:
    """Host arrays: chunked numpy, or numba's fused loops for float32/float64 when ``jit``."""

    name = "numpy"
    device = "cpu"            # where the arrays live (shown in status and the metrics)
    sums_in_step = False      # steps take one gradient: a batch is summed first (sum_into)
    steps_out = True          # steps take ``out`` (see the module's docstring)
    xp = np

    @staticmethod
    def begin_batch() -> None:
        """A batch part starts (a device backend reuses its transfer slots from here)."""

    @staticmethod
    def end_batch() -> None:
        """A batch part was applied (a device backend's copies from its frames are done)."""

    def __init__(self, jit: bool | None = None, chunk_bytes: int = CHUNK_BYTES):
        """``jit``: use numba (None: when it imports). Compiles numba's loops here, once per
        process (cached on disk), so no step ever waits on a compiler."""
        self.fused = _numba_loops() if jit is not False else None
        if jit and self.fused is None:
            raise BackendError(f"numba does not import (or {codec_jit.ENV}=0); pip install "
                               f"numba or pass jit=None")
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def asarray(a, dtype=None) -> np.ndarray:
        return np.asarray(a, dtype)

    @staticmethod
    def to_host(a) -> np.ndarray:
        return np.asarray(a)

    @staticmethod
    def decode_values(arrays, coder: str, dtype, k: int) -> np.ndarray:
        """The ``k`` values a frame's value section codes (the arrays from
        :func:`gradbus.codecs.wire.decode_tensor_staged`), as this backend's array."""
        return tcodec.decode_values(arrays, coder, dtype, k)

    def _fusable(self, w: np.ndarray, *arrays: np.ndarray) -> bool:
        return self.fused is not None and w.dtype in _JIT_DTYPES and all(
            a.dtype == w.dtype and a.ndim == 1 and a.flags.c_contiguous and a.flags.aligned
            for a in (w, *arrays))

    def chunk_len(self, dtype) -> int:
        return max(self.chunk_bytes // dtype.itemsize, 1)

    def _chunks(self, n: int, dtype, scratch):
        """``(slice, temporary)`` pairs covering ``range(n)``; every temporary is the start of
        ``scratch`` (of a chunk-sized buffer when None), so it stays in cache."""
        size = self.chunk_len(dtype)
        if scratch is None:
            scratch = np.empty(min(n, size), dtype)
        for lo in range(0, n, size):
            yield slice(lo, lo + size), scratch[:min(size, n - lo)]

    def sum_into(self, out: np.ndarray, grads) -> np.ndarray:
        _check_sum(out, grads)
        if len(grads) == 1:
            np.copyto(out, grads[0])
            return out
        size = self.chunk_len(out.dtype)
        for lo in range(0, out.size, size):
            sl = slice(lo, lo + size)
            o = out[sl]
            np.add(grads[0][sl], grads[1][sl], out=o)
            for g in grads[2:]:
                o += g[sl]
        return out

    def sgd_step(self, w, g, lr: float, scratch=None, out=None) -> None:
        """``w -= lr * g``; with ``out``, ``out = w - lr * g`` (``w`` left as it is)."""
        out = w if out is None else out
        if self._fusable(w, g, out):
            self.fused["sgd"](w, g, out, w.dtype.type(lr))
            return
        lr = np.array(lr, w.dtype)             # 0-d constants: the cheapest ufunc operand
        for sl, t in self._chunks(w.size, w.dtype, scratch):
            np.multiply(g[sl], lr, out=t)
            np.subtract(w[sl], t, out=out[sl])

    def sgd_step_reading(self, w, reads: list, lr: float, out, scratch):
        """``out = w - lr * (sum of the gradients that ``reads`` give)``, each gradient read a
        chunk at a time (``read(lo, hi, buf)``: its values ``[lo, hi)``, as a view or decoded
        into ``buf``, called with consecutive ranges; paired with its scale, or None) and that
        chunk stepped while it is in cache: one pass over the gradients where a sum, a
        finiteness check and a step apart take three. ``scratch``: two chunks' worth of
        ``w``'s dtype. Returns whether every value of the sum was finite, or None, with
        nothing read, where there is no numba loop for it (the caller sums, checks and steps
        apart). The same bits as summing in list order, then :meth:`sgd_step`."""
        loop = self.fused.get("sgd_checked") if self.fused is not None else None
        if loop is None or not self._fusable(w, out):
            return None
        m = min(self.chunk_len(w.dtype), w.size)
        got, total = scratch[:m], scratch[m:2 * m]
        lr = w.dtype.type(lr)
        if len(reads) == 1 and reads[0][1] is None:    # no sum, no scale: numba's loop alone
            return not self._reading_loop(loop, w, reads, lr, out, got, total)
        with np.errstate(over="ignore", invalid="ignore"):   # a sum past the range: flagged
            bad = self._reading_loop(loop, w, reads, lr, out, got, total)
        return not bad

    def _reading_loop(self, loop, w, reads, lr, out, got, total) -> int:
        """:meth:`sgd_step_reading`'s pieces; nonzero when a value of the sum was not finite."""
        n, bad = w.size, 0
        size = self.chunk_len(w.dtype)
        for lo in range(0, n, size):
            hi = min(lo + size, n)
            t = total[:hi - lo]
            g = None
            for j, (read, scale) in enumerate(reads):
                v = read(lo, hi, got)
                if scale is not None:
                    v = np.multiply(v, scale, out=got[:hi - lo])
                if j == 0:
                    g = v
                    if len(reads) > 1 and np.may_share_memory(v, got):
                        np.copyto(t, v)       # out of the way of the next read's decoding
                        g = t
                elif j == 1 and g is not t:
                    g = np.add(g, v, out=t)
                else:
                    np.add(t, v, out=t)
            if not (g.flags.aligned and g.flags.c_contiguous):     # a frame at an odd offset
                np.copyto(t, g)
                g = t
            bad |= loop(w[lo:hi], g, out[lo:hi], lr)
        return bad

    def momentum_step(self, w, g, v, k: int, lr: float, mu: float, scratch=None,
                      out=None) -> None:
        out = w if out is None else out
        coefs = momentum_coefs(k, lr, mu)
        if self._fusable(w, g, out, v):
            self.fused["momentum"](w, g, out, v, *map(w.dtype.type, coefs))
            return
        a, b, c, d = (np.array(x, w.dtype) for x in coefs)
        for sl, t in self._chunks(w.size, w.dtype, scratch):
            ww, gg, vv = out[sl], g[sl], v[sl]
            np.multiply(vv, a, out=t)
            np.subtract(w[sl], t, out=ww)
            np.multiply(gg, b, out=t)
            ww -= t
            vv *= c
            np.multiply(gg, d, out=t)
            vv += t

    def adam_step(self, w, g, m, v, k: int, t: int, lr: float, b1: float, b2: float,
                  eps: float, scratch=None, out=None) -> None:
        """``t``: the step count after this batch."""
        out = w if out is None else out
        coefs = adam_coefs(k, t, lr, b1, b2, eps)
        if self._fusable(w, g, out, m, v):
            self.fused["adam"](w, g, out, m, v, *map(w.dtype.type, coefs))
            return
        b1k, c1, b2k, c2, eps_t, lr_t = (np.array(x, w.dtype) for x in coefs)
        for sl, s in self._chunks(w.size, w.dtype, scratch):
            gg, mm, vv = g[sl], m[sl], v[sl]
            mm *= b1k
            np.multiply(gg, c1, out=s)
            mm += s
            vv *= b2k
            np.multiply(gg, gg, out=s)
            s *= c2
            vv += s
            np.sqrt(vv, out=s)
            s += eps_t
            np.divide(mm, s, out=s)
            s *= lr_t
            np.subtract(w[sl], s, out=out[sl])

    def adagrad_step(self, w, g, h, k: int, lr: float, eps: float, scratch=None,
                     out=None) -> None:
        out = w if out is None else out
        coefs = (*adagrad_coefs(k), eps, lr)
        if self._fusable(w, g, out, h):
            self.fused["adagrad"](w, g, out, h, *map(w.dtype.type, coefs))
            return
        ia, ik, eps, lr = (np.array(x, w.dtype) for x in coefs)
        for sl, t in self._chunks(w.size, w.dtype, scratch):
            gg, hh = g[sl], h[sl]
            np.multiply(gg, gg, out=t)
            if k == 1:                         # the middle of one accumulation is its end
                hh += t
                np.sqrt(hh, out=t)
            else:
                t *= ia
                t += hh
                np.sqrt(t, out=t)
            t += eps
            np.divide(gg, t, out=t)
            t *= lr
            np.subtract(w[sl], t, out=out[sl])
            if k > 1:
                np.multiply(gg, gg, out=t)
                t *= ik
                hh += t

    @staticmethod
    def scatter_add(dense, indices, values, unique: bool = False) -> None:
        """``dense[indices] += values``. With ``unique`` (no repeated index, as in one sparse
        gradient) a plain fancy-index add; otherwise ``np.add.at``, which sums repeats.
        Indices out of range raise IndexError."""
        if unique:
            dense[indices] += values
        else:
            np.add.at(dense, indices, values)


# The numba loops: the numpy path's expressions, element by element. Plain functions here (so
# numba can cache them by file), compiled by _numba_loops().
# Each writes the stepped values to ``out`` (``w`` itself for a step in place).
def _sgd_loop(w, g, out, lr):
    for i in range(w.size):
        out[i] = w[i] - g[i] * lr


def _sgd_checked_loop(w, g, out, lr):
    """``_sgd_loop`` that also says whether any ``g`` was NaN or infinite (an integer flag,
    so the loop still vectorizes)."""
    bad = 0
    for i in range(w.size):
        gi = g[i]
        bad |= not (abs(gi) < np.inf)
        out[i] = w[i] - gi * lr
    return bad


def _momentum_loop(w, g, out, v, a, b, c, d):
    for i in range(w.size):
        vi, gi = v[i], g[i]
        out[i] = (w[i] - vi * a) - gi * b
        v[i] = vi * c + gi * d


def _adam_loop(w, g, out, m, v, b1k, c1, b2k, c2, eps, lr):
    for i in range(w.size):
        gi = g[i]
        mi = m[i] * b1k + gi * c1
        vi = v[i] * b2k + (gi * gi) * c2
        m[i] = mi
        v[i] = vi
        out[i] = w[i] - (mi / (np.sqrt(vi) + eps)) * lr


def _adagrad_loop(w, g, out, h, ia, ik, eps, lr):
    for i in range(w.size):
        gi, hi = g[i], h[i]
        gg = gi * gi
        h[i] = hi + gg * ik
        out[i] = w[i] - (gi / (np.sqrt(gg * ia + hi) + eps)) * lr


_JIT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_LOOPS = {"sgd": (_sgd_loop, 0, 1), "momentum": (_momentum_loop, 1, 4),
          "adam": (_adam_loop, 2, 6), "adagrad": (_adagrad_loop, 1, 4)}  # (loop, state, scalars)


@codec_jit.once
def _numba_loops() -> dict | None:
    """The loops compiled for float32 and float64, or None where there are none (no numba,
    ``GRADBUS_JIT=0``, a failed compile: :func:`gradbus.codecs.jit.build`). Compiled once
    even when several threads (the shards of an in-process cluster) ask first together.

    ``error_model="numpy"``: division follows IEEE (no ZeroDivisionError branch, which would also
    keep LLVM from vectorizing); no fastmath, so results match the numpy path.
    """
    return codec_jit.build(_compile_loops)


def _compile_loops(numba, types) -> dict:
    def signature(dt, n_state, n_scalars):
        arr = types.Array(dt, 1, "C")
        return types.void(arr, types.Array(dt, 1, "C", readonly=True), arr, *[arr] * n_state,
                          *[dt] * n_scalars)

    def jit(loop, signatures):
        return numba.njit(signatures, fastmath=False, error_model="numpy", nogil=True,
                          cache=True)(loop)

    loops = {name: jit(loop, [signature(dt, n_state, n_scalars)
                              for dt in (types.float32, types.float64)])
             for name, (loop, n_state, n_scalars) in _LOOPS.items()}
    loops["sgd_checked"] = jit(_sgd_checked_loop, [
        types.int64(types.Array(dt, 1, "C"), types.Array(dt, 1, "C", readonly=True),
                    types.Array(dt, 1, "C"), dt) for dt in (types.float32, types.float64)])
    return loops


# -- CuPy ----------------------------------------------------------------------------------------
# ElementwiseKernel sources: T is the arrays' dtype (float or double), so every scalar parameter
# is cast to it and no double literal creeps into float math. The expressions are the numpy
# path's; NVRTC may contract a*b + c into an FMA, so results agree to rounding, not bit for bit.
_SGD = ("T g, T lr", "T w", "w -= g * lr;")
_MOMENTUM = ("T g, T a, T b, T c, T d", "T w, T v", """
    const T vi = v;
    w = (w - vi * a) - g * b;
    v = vi * c + g * d;
""")
_ADAM = ("T g, T b1k, T c1, T b2k, T c2, T eps, T lr", "T w, T m, T v", """
    const T mi = m * b1k + g * c1;
    const T vi = v * b2k + (g * g) * c2;
    m = mi;
    v = vi;
    w -= (mi / (sqrt(vi) + eps)) * lr;
""")
_ADAGRAD = ("T g, T ia, T ik, T eps, T lr", "T w, T h", """
    const T gg = g * g;
    const T hi = h;
    h = hi + gg * ik;
    w -= (g / (sqrt(gg * ia + hi) + eps)) * lr;
""")
# Sums up to SUM_GROUP gradients into total in one pass; acc != 0 adds to total's value. Raw
# inputs are read only when used (unused slots repeat g0).
_SUM = (", ".join(f"raw T g{j}" for j in range(SUM_GROUP)) + ", int32 k, int32 acc", "T total",
        "T s = acc ? total + g0[i] : g0[i];\n"
        + "".join(f"if (k > {j}) s += g{j}[i];\n" for j in range(1, SUM_GROUP))
        + "total = s;")


def _sum_then(step: tuple) -> tuple:
    """A step kernel's source that first sums up to SUM_GROUP gradients (``raw T g0..``, ``k``
    of them, in list order as _SUM adds them) into its ``g``: a batch's sum and its optimizer
    step in one pass over memory."""
    params, outs, body = step
    rest = params.split(", ", 1)[1]          # the step's own scalars, after "T g"
    head = ", ".join(f"raw T g{j}" for j in range(SUM_GROUP))
    total = "T g = g0[i];\n" + "".join(f"if (k > {j}) g += g{j}[i];\n"
                                        for j in range(1, SUM_GROUP))
    return f"{head}, int32 k, {rest}", outs, total + body


STEPS = {"sgd": _SGD, "momentum": _MOMENTUM, "adam": _ADAM, "adagrad": _ADAGRAD}
SUM_STEPS = {name: _sum_then(src) for name, src in STEPS.items()}

# Value decoders (codecs/tensor.py's formats): int8 codes times their block's float32 scale, and
# sign bits (np.packbits order, 1 = negative) as -+ their block's scale, computed in float32 as
# the host does, then cast to T.
_INT8 = ("int8 c, raw float32 s, int64 block", "T out", "out = (T)((float)c * s[i / block]);")
_FP16 = ("float16 h", "T out", "out = (T)h;")           # every half is exact in float/double
_BF16 = ("uint16 b", "T out", "out = (T)__uint_as_float(((unsigned int)b) << 16);")
_SIGN = ("raw uint8 bits, raw float32 s, int64 block", "T out", """
    const float v = s[i / block];
    out = (T)(((bits[i >> 3] >> (7 - (i & 7))) & 1) ? -v : v);
""")
# Indices outside [0, n) are skipped: checking them would cost a host sync.
_SCATTER_ADD = ("T value, I index, int64 n", "raw T dense",
                "if (index >= 0 && index < n) atomicAdd(&dense[index], value);")


def device_name(cupy, device_id: int) -> str:
    """The CUDA device's product name ("NVIDIA H100 80GB HBM3"), or "" where it cannot be
    read."""
    try:
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    except Exception:         # a driver that does not say: the device id alone
        return ""
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


class CupyBackend:
    """CUDA device arrays; each step one fused ElementwiseKernel, launched without a host sync.
    A step given a list of up to SUM_GROUP gradients (``sums_in_step``) sums them in the same
    kernel: one pass over memory for the batch's sum and its step."""

    name = "cupy"
    sums_in_step = True

    def __init__(self):
        try:
            import cupy
        except ImportError as e:
            raise BackendError(f"the cupy backend needs cupy: {e} (pip install 'gradbus[gpu]', "
                               f"or set GRADBUS_BACKEND=numpy)") from e
        try:
            devices = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise BackendError(f"the cupy backend needs a CUDA device: {e}") from e
        if devices == 0:
            raise BackendError("the cupy backend needs a CUDA device; none is visible")
        self.xp = cupy
        dev = cupy.cuda.Device()
        self.device_id = dev.id
        self.device = f"cuda:{dev.id} {device_name(cupy, dev.id)}".strip()

        def kernel(name, src):
            return cupy.ElementwiseKernel(*src, name=f"gradbus_{name}")

        self._sgd, self._momentum = kernel("sgd", _SGD), kernel("momentum", _MOMENTUM)
        self._adam, self._adagrad = kernel("adam", _ADAM), kernel("adagrad", _ADAGRAD)
        self._sum_step = {name: kernel(f"sum_{name}", src) for name, src in SUM_STEPS.items()}
        self._sum, self._scatter_add = kernel("sum", _SUM), kernel("scatter_add", _SCATTER_ADD)
        self._int8, self._sign = kernel("int8", _INT8), kernel("sign", _SIGN)
        self._fp16, self._bf16 = kernel("fp16", _FP16), kernel("bf16", _BF16)
        self.pins = HostPins(cupy)                     # pinned once: rings, board, staging
        self.io = DeviceTransfers(cupy, self.pins)

    def begin_batch(self) -> None:
        """A batch part starts: its gradients go into the last part's device slots."""
        self.io.begin()

    def end_batch(self) -> None:
        """A batch part's steps are queued: its uploads are waited for, since a gradient read
        in place from a client's ring is the client's again once the shard replies."""
        self.io.end()

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype)

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def download(self, a, out: np.ndarray):
        """Queue ``a``'s copy into host array ``out`` (pinned: the board) on the download
        stream; returns the copy's event (see :class:`DeviceTransfers`)."""
        return self.io.download(a, out)

    def decode_values(self, arrays, coder: str, dtype, k: int):
        """The values decoded on the device: only the coded bytes are copied there (int8 a
        quarter of float32's, sign a thirty-second), into this batch's device slots, on the
        upload stream, then one kernel expands them into another slot. Valid until the next
        batch part begins (:meth:`begin_batch`)."""
        if coder == "raw":
            return self.io.upload(arrays[0])
        if coder not in ("fp16", "bf16", "int8", "sign"):
            raise ValueError(f"no device decoder for {coder!r}")
        out = self.io.scratch(k, dtype)
        if coder == "fp16":
            self._fp16(self.io.upload(arrays[0]).view(self.xp.float16), out)
        elif coder == "bf16":
            self._bf16(self.io.upload(arrays[0]).view(self.xp.uint16), out)
        else:
            block = tcodec.INT8_BLOCK if coder == "int8" else tcodec.SIGN_BLOCK
            (self._int8 if coder == "int8" else self._sign)(
                self.io.upload(arrays[1]), self.io.upload(arrays[0]), block, out)
        return out

    def close(self) -> None:
        """Unpin what is still pinned."""
        self.pins.close()

    def sum_into(self, out, grads):
        _check_sum(out, grads)
        for lo in range(0, len(grads), SUM_GROUP):
            group = list(grads[lo:lo + SUM_GROUP])
            self._sum(*group, *group[:1] * (SUM_GROUP - len(group)), len(group), int(lo > 0),
                      out)
        return out

    def _step(self, name: str, one, g, scalars: tuple, outs: tuple) -> None:
        """``one`` (the step kernel) on gradient ``g``, or, for a list of gradients, the
        kernel that sums them first (at most SUM_GROUP: the shard sums longer lists apart).
        ``outs`` is ``(w, *state)``."""
        if isinstance(g, (list, tuple)):
            if not 0 < len(g) <= SUM_GROUP:
                raise ValueError(f"a summing step takes 1 to {SUM_GROUP} gradients, not {len(g)}")
            _check_sum(outs[0], g)
            self._sum_step[name](*g, *g[:1] * (SUM_GROUP - len(g)), len(g), *scalars, *outs)
        else:
            one(g, *scalars, *outs)

    # scratch: unused (the kernels are fused); kept so every backend takes the same arguments
    def sgd_step(self, w, g, lr: float, scratch=None) -> None:
        self._step("sgd", self._sgd, g, (lr,), (w,))

    def momentum_step(self, w, g, v, k: int, lr: float, mu: float, scratch=None) -> None:
        self._step("momentum", self._momentum, g, momentum_coefs(k, lr, mu), (w, v))

    def adam_step(self, w, g, m, v, k: int, t: int, lr: float, b1: float, b2: float,
                  eps: float, scratch=None) -> None:
        self._step("adam", self._adam, g, adam_coefs(k, t, lr, b1, b2, eps), (w, m, v))

    def adagrad_step(self, w, g, h, k: int, lr: float, eps: float, scratch=None) -> None:
        self._step("adagrad", self._adagrad, g, (*adagrad_coefs(k), eps, lr), (w, h))

    def scatter_add(self, dense, indices, values, unique: bool = False) -> None:
        """Indices outside ``[0, dense.size)`` are skipped (atomic adds: repeats sum)."""
        self._scatter_add(values, indices, dense.size, dense)
