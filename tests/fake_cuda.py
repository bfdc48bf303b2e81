"""A stand-in for the parts of CuPy and ``torch.cuda`` that gradbus uses, so its CUDA code paths
run on a machine without a GPU: ``install(monkeypatch)`` puts it in ``sys.modules["cupy"]``.

What it is: device arrays are numpy arrays behind :class:`ndarray`, a class of module ``cupy``
(so :func:`gradbus.codecs.device.array_module` takes it for CuPy's) that, like CuPy's, refuses
to turn into a numpy array implicitly (``np.asarray(x)`` raises TypeError: the code must call
``.get()`` or ``cupy.asnumpy``) and refuses numpy arrays as operands of its ufuncs. numpy
functions and ufuncs called on it dispatch to numpy and give device arrays back, as CuPy's do.
Every array made with fresh memory is counted (:attr:`State.allocations`), so a test can say
that a hot path allocates nothing. Streams and events are synchronous (a copy is done when it
returns; an event is complete when recorded); ``hostRegister`` records the ranges pinned.

What it is not: a GPU. :class:`ElementwiseKernel` does not compile its CUDA source; it runs a
numpy equivalent of each of gradbus's kernels (looked up by the kernel's name, written here
from the kernel's source expression by expression, so results are numpy's bits, with no FMA
contraction). The kernels' CUDA text, real asynchrony between streams, pinned-memory copies
and device memory limits are only exercised by the ``-m gpu`` tests on a GPU host.

``torch.cuda``: :func:`install` replaces ``torch.cuda.current_stream`` (a stream whose
``synchronize`` is counted) and lets ``torch.empty(..., pin_memory=True)`` allocate ordinary
host memory (counted as pinned); with ``torch_devices=True`` it makes ``gradbus.torch`` treat
every tensor as device memory, so the adapter's CUDA branches run on CPU tensors.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

MESSAGE = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
           "construct a NumPy array explicitly.")


@dataclass
class State:
    """What the stand-in saw since :func:`install`."""
    allocations: int = 0                  # device arrays made with fresh memory
    sizes: list = field(default_factory=list)          # ... their sizes in bytes
    registered: list = field(default_factory=list)     # [(ptr, size)] pinned and not released
    registrations: int = 0                # hostRegister calls
    syncs: int = 0                        # torch.cuda streams synchronized
    pinned: int = 0                       # torch host buffers allocated pinned
    pinned_allocs: int = 0                # cupy.cuda.alloc_pinned_memory calls
    event_waits: int = 0                  # Event.synchronize calls (the host waiting)
    kernels: dict = field(default_factory=dict)        # kernel name -> launches


STATE = State()


def _unwrap(x, strict: bool = False):
    if type(x) is ndarray:
        return x._a
    if strict and isinstance(x, np.ndarray) and x.ndim:
        raise TypeError(f"Unsupported type {type(x)}")         # CuPy's ufuncs refuse these
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, strict) for v in x)
    return x


def _wrap(x):
    if isinstance(x, np.ndarray):
        if x.flags.owndata:
            STATE.allocations += 1
            STATE.sizes.append(x.nbytes)
        return ndarray(x)
    if isinstance(x, np.generic):                 # CuPy reductions give 0-d arrays
        return _wrap(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


class ndarray(NDArrayOperatorsMixin):
    """A device array: a numpy array that only ``get()`` hands to the host."""

    __module__ = "cupy"
    __slots__ = ("_a", "__weakref__")

    def __init__(self, a: np.ndarray):
        self._a = a

    def __array__(self, *a, **kw):
        raise TypeError(MESSAGE)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        if "out" in kw:
            kw["out"] = _unwrap(kw["out"], True)
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs, True), **kw))

    def __array_function__(self, func, types_, args, kwargs):
        return _wrap(func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))

    # -- attributes and methods gradbus uses --------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self._a.ctypes.data)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return self._a.copy()
        np.copyto(out, self._a)
        return out

    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("set takes a numpy array")
        np.copyto(self._a, arr.reshape(self._a.shape))

    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key, value) -> None:
        self._a[_unwrap(key)] = _unwrap(value, True)

    def __len__(self) -> int:
        return len(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __repr__(self) -> str:
        return f"fake_cuda.ndarray({self._a!r})"

    def astype(self, dtype, copy=True):
        return _wrap(self._a.astype(dtype, copy=copy))

    def view(self, dtype):
        return _wrap(self._a.view(dtype))

    def reshape(self, *shape):
        return _wrap(self._a.reshape(*shape))

    def ravel(self):
        return _wrap(self._a.ravel())

    def copy(self):
        return _wrap(self._a.copy())

    def fill(self, value) -> None:
        self._a.fill(value)

    def __dlpack__(self, *a, **kw):
        return self._a.__dlpack__(*a, **kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    for _name in ("sum", "max", "min", "all", "any"):
        locals()[_name] = (lambda n: lambda self, *a, **kw: _wrap(getattr(self._a, n)(*a, **kw)))(
            _name)
    del _name


class _Ufunc:
    def __init__(self, uf):
        self._uf = uf

    def __call__(self, *args, **kw):
        if "out" in kw:
            kw["out"] = _unwrap(kw["out"], True)
        return _wrap(self._uf(*_unwrap(args, True), **kw))

    def reduce(self, a, **kw):
        return _wrap(self._uf.reduce(_unwrap(a, True), **kw))


def _function(fn):
    def call(*args, **kw):
        return _wrap(fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kw.items()}))
    return call


# -- the module -----------------------------------------------------------------------------------
def asarray(a, dtype=None):
    if type(a) is ndarray:
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return _wrap(np.array(a, dtype=dtype, copy=True))          # a host -> device copy


def ascontiguousarray(a, dtype=None):
    return _wrap(np.ascontiguousarray(_unwrap(a), dtype))


def asnumpy(a, stream=None, out=None):
    if type(a) is ndarray:
        return a.get(stream, out=out)
    return np.asarray(a)


def from_dlpack(t):
    return _wrap(np.from_dlpack(t))


class ElementwiseKernel:
    """Runs gradbus's kernel of this name as numpy (see the module's docstring)."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel"):
        self.name = name
        self.n_in = len([p for p in in_params.split(",") if p.strip()])
        self.fn = _KERNELS[name.removeprefix("gradbus_")]

    def __call__(self, *args):
        STATE.kernels[self.name] = STATE.kernels.get(self.name, 0) + 1
        arrays = [_unwrap(a, True) for a in args]
        self.fn(*arrays)
        outs = args[self.n_in:]
        return outs[0] if len(outs) == 1 else outs


def _t(x, dt):
    return dt.type(x)


def _k_sgd(g, lr, w):
    w[...] = w - g * _t(lr, w.dtype)


def _k_momentum(g, a, b, c, d, w, v):
    a, b, c, d = (_t(x, w.dtype) for x in (a, b, c, d))
    vi = v.copy()
    w[...] = (w - vi * a) - g * b
    v[...] = vi * c + g * d


def _k_adam(g, b1k, c1, b2k, c2, eps, lr, w, m, v):
    b1k, c1, b2k, c2, eps, lr = (_t(x, w.dtype) for x in (b1k, c1, b2k, c2, eps, lr))
    mi = m * b1k + g * c1
    vi = v * b2k + (g * g) * c2
    m[...] = mi
    v[...] = vi
    w[...] = w - (mi / (np.sqrt(vi) + eps)) * lr


def _k_adagrad(g, ia, ik, eps, lr, w, h):
    ia, ik, eps, lr = (_t(x, w.dtype) for x in (ia, ik, eps, lr))
    gg = g * g
    hi = h.copy()
    h[...] = hi + gg * ik
    w[...] = w - (g / (np.sqrt(gg * ia + hi) + eps)) * lr


def _group_sum(gs, k):
    s = gs[0].copy()
    for j in range(1, k):
        s += gs[j]
    return s


def _k_sum(*args):
    gs, (k, acc, total) = args[:8], args[8:]
    s = total + gs[0] if acc else gs[0].copy()
    for j in range(1, k):
        s += gs[j]
    total[...] = s


def _summing(step):
    def run(*args):
        return step(_group_sum(args[:8], args[8]), *args[9:])
    return run


def _k_int8(c, s, block, out):
    i = np.arange(out.size)
    out[...] = (c.astype(np.float32) * s[i // block]).astype(out.dtype)


def _k_sign(bits, s, block, out):
    i = np.arange(out.size)
    v = s[i // block]
    neg = (bits[i >> 3] >> (7 - (i & 7))) & 1
    out[...] = np.where(neg.astype(bool), -v, v).astype(out.dtype)


def _k_fp16(h, out):
    out[...] = h.astype(out.dtype)


def _k_bf16(b, out):
    out[...] = (b.astype(np.uint32) << 16).view(np.float32).astype(out.dtype)


def _k_scatter_add(value, index, n, dense):
    ok = (index >= 0) & (index < n)
    np.add.at(dense, index[ok], value[ok])


_KERNELS = {"sgd": _k_sgd, "momentum": _k_momentum, "adam": _k_adam, "adagrad": _k_adagrad,
            "sum": _k_sum, "int8": _k_int8, "sign": _k_sign, "scatter_add": _k_scatter_add,
            "fp16": _k_fp16, "bf16": _k_bf16}
_KERNELS.update({f"sum_{n}": _summing(_KERNELS[n]) for n in ("sgd", "momentum", "adam",
                                                                "adagrad")})


class CUDARuntimeError(RuntimeError):
    pass


class Stream:
    """Synchronous: work queued on it is done when the call returns."""

    null = None

    def __init__(self, non_blocking: bool = False):
        self.non_blocking = non_blocking

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        pass


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    @property
    def done(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        STATE.event_waits += 1


def _host_register(ptr: int, size: int, flags: int) -> None:
    for p, s in STATE.registered:
        if p < ptr + size and ptr < p + s:
            raise CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
    STATE.registered.append((ptr, size))
    STATE.registrations += 1


def _host_unregister(ptr: int) -> None:
    for i, (p, _) in enumerate(STATE.registered):
        if p == ptr:
            del STATE.registered[i]
            return
    raise CUDARuntimeError("cudaErrorHostMemoryNotRegistered")


def _alloc_pinned(n: int) -> bytearray:
    STATE.pinned_allocs += 1
    return bytearray(n)


def _module() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.__doc__ = "gradbus's test stand-in for CuPy (tests/fake_cuda.py)"
    mod.ndarray, mod.ElementwiseKernel = ndarray, ElementwiseKernel
    mod.asarray, mod.ascontiguousarray, mod.asnumpy = asarray, ascontiguousarray, asnumpy
    mod.from_dlpack = from_dlpack
    mod.STATE = STATE
    for name in dir(np):
        if name.startswith("_") or hasattr(mod, name):
            continue
        attr = getattr(np, name)
        if isinstance(attr, np.ufunc):
            setattr(mod, name, _Ufunc(attr))
        elif isinstance(attr, (type, float, int)):
            setattr(mod, name, attr)                  # dtypes, inf, nan
        elif callable(attr):
            setattr(mod, name, _function(attr))
    random = types.ModuleType("cupy.random")
    random.RandomState = lambda seed=None: _RandomState(seed)
    random.default_rng = lambda seed=None: _Generator(seed)
    mod.random = random
    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 1,
        hostRegister=_host_register, hostUnregister=_host_unregister,
        hostRegisterPortable=1, hostRegisterDefault=0,
        getDeviceProperties=lambda dev: {"name": b"fake-cuda (numpy)", "totalGlobalMem": 1 << 34})
    mod.cuda = types.SimpleNamespace(
        runtime=runtime, Stream=Stream, Event=Event,
        Device=lambda i=0: types.SimpleNamespace(id=i, use=lambda: None,
                                                 synchronize=lambda: None),
        get_current_stream=lambda: Stream(), alloc_pinned_memory=_alloc_pinned)
    return mod


class _RandomState:
    def __init__(self, seed):
        self._r = np.random.RandomState(seed)

    def random_sample(self, size=None):
        return _wrap(np.asarray(self._r.random_sample(size)))


class _Generator:
    def __init__(self, seed):
        self._g = np.random.default_rng(seed)

    def permutation(self, n):
        return _wrap(self._g.permutation(n))


class _TorchStream:
    def synchronize(self) -> None:
        STATE.syncs += 1


def install(monkeypatch, torch_devices: bool = False) -> types.ModuleType:
    """The stand-in as ``cupy`` for the rest of the test (and, when torch imports, its
    ``torch.cuda`` surface); returns the module. Its :data:`STATE` starts afresh."""
    global STATE
    STATE = State()
    mod = _module()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    torch = sys.modules.get("torch")
    if torch is not None:
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _TorchStream())
        empty = torch.empty

        def empty_pinned(*a, pin_memory=False, **kw):
            STATE.pinned += bool(pin_memory)
            return empty(*a, **kw)
        monkeypatch.setattr(torch, "empty", empty_pinned)
        if torch_devices:
            import gradbus.torch as adapter
            monkeypatch.setattr(adapter, "_is_host", lambda t: False)
    return mod
