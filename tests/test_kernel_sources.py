"""The CuPy kernels' sources, compiled as C++ for the CPU and checked against the numpy path.

Where no GPU is present the ElementwiseKernels in shards/backend.py never run, so a typo or a
wrong expression in them would wait for the first GPU. Their bodies are plain C: here each one is
wrapped in a loop over ``i`` the way an ElementwiseKernel maps it (non-raw arrays as the element
``i``, outputs by reference, ``raw`` arrays as pointers, scalars cast to their type), compiled
with the system's C++ compiler (no FMA contraction), and run on float32 and float64 against the
numpy backend and the host decoders. It says nothing of CUDA itself (launches, atomics, NVRTC's
contractions): ``-m gpu`` tests cover that where a GPU is.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from gradbus.codecs import tensor
from gradbus.shards import backend

from .rigs import NUMPY, SPECS, STATE, backend_steps, data

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

TYPES = {np.float32: "float", np.float64: "double"}
# name -> (source, the non-raw inputs that are arrays; every other non-raw input is a scalar)
KERNELS = {**{name: (src, {"g"}) for name, src in backend.STEPS.items()},
           **{f"sum_{name}": (src, set()) for name, src in backend.SUM_STEPS.items()},
           "sum": (backend._SUM, set()), "int8": (backend._INT8, {"c"}),
           "sign": (backend._SIGN, set()), "scatter_add": (backend._SCATTER_ADD,
                                                          {"value", "index"}),
           "fp16": (backend._FP16, {"h"}), "bf16": (backend._BF16, {"b"})}
PRELUDE = """
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
typedef int8_t int8; typedef uint8_t uint8; typedef int32_t int32; typedef int64_t int64;
typedef uint16_t uint16; typedef _Float16 float16; typedef float float32; typedef double float64;
using std::sqrt;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
template <class A> static A atomicAdd(A* p, A v) { A old = *p; *p += v; return old; }
"""


def _params(text: str) -> list[tuple[bool, str, str]]:
    """``"raw T g0, int32 k"`` -> [(raw, type, name), ...]"""
    out = []
    for p in filter(None, (x.strip() for x in text.split(","))):
        words = p.split()
        out.append((words[0] == "raw", words[-2], words[-1]))
    return out


def _function(name: str, src: tuple, arrays: set, ctype: str) -> str:
    """One kernel as ``extern "C" void name(size_, arrays_, scalars_)``; arrays
    and scalars in the kernel's argument order (inputs, then outputs)."""
    ins, outs = _params(src[0]), _params(src[1])
    lines, per_i, ai, si = [], [], 0, 0
    for raw, typ, var in ins + outs:
        is_out = (raw, typ, var) in outs
        if raw or var in arrays or is_out:
            lines.append(f"{typ}* {var}_p = ({typ}*)arrays_[{ai}];")
            ai += 1
            if raw:
                lines.append(f"{typ}* {var} = {var}_p;")
            elif is_out:
                per_i.append(f"{typ}& {var} = {var}_p[i];")
            else:
                per_i.append(f"const {typ} {var} = {var}_p[i];")
        else:
            lines.append(f"const {typ} {var} = ({typ})scalars_[{si}];")
            si += 1
    return (f'extern "C" void {name}(long long size_, void** arrays_, const double* scalars_) '
            f"{{\ntypedef {ctype} T; typedef int64 I;\n" + "\n".join(lines) + "\n"
            "for (ptrdiff_t i = 0; i < (ptrdiff_t)size_; ++i) {\n" + "\n".join(per_i)
            + f"\n{{\n{src[2]}\n}}\n}}\n}}\n")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    code = PRELUDE + "".join(_function(f"{name}_{ctype}", src, arrays, ctype)
                             for name, (src, arrays) in KERNELS.items()
                             for ctype in TYPES.values())
    (d / "k.cpp").write_text(code)
    subprocess.run([CXX, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(d / "k.so"),
                    str(d / "k.cpp")], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(d / "k.so"))

    def run(name, dtype, arrays, scalars=(), n=None):
        fn = getattr(lib, f"{name}_{TYPES[dtype]}")
        ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
        sc = (ctypes.c_double * max(len(scalars), 1))(*[float(x) for x in scalars])
        fn(ctypes.c_longlong(arrays[-1].size if n is None else n), ptrs, sc)
    return run


TOL = {np.float32: {"rtol": 1e-6, "atol": 1e-7}, np.float64: {"rtol": 1e-14, "atol": 1e-15}}


class CppSteps:
    """The step kernels through the C++ build, with the backend's step signatures (``g`` a list
    takes the summing kernel, as CupyBackend does)."""

    xp = np

    def __init__(self, run):
        self.run = run

    def _step(self, name, g, scalars, outs):
        dt = outs[0].dtype.type
        if isinstance(g, list):
            pad = g + g[:1] * (backend.SUM_GROUP - len(g))
            self.run(f"sum_{name}", dt, [*pad, *outs], (len(g), *scalars))
        else:
            self.run(name, dt, [g, *outs], scalars)

    def sgd_step(self, w, g, lr):
        self._step("sgd", g, (lr,), (w,))

    def momentum_step(self, w, g, v, k, lr, mu):
        self._step("momentum", g, backend.momentum_coefs(k, lr, mu), (w, v))

    def adam_step(self, w, g, m, v, k, t, lr, b1, b2, eps):
        self._step("adam", g, backend.adam_coefs(k, t, lr, b1, b2, eps), (w, m, v))

    def adagrad_step(self, w, g, h, k, lr, eps):
        self._step("adagrad", g, (*backend.adagrad_coefs(k), eps, lr), (w, h))


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_step_kernels_are_the_numpy_steps(kernels, name, dtype, k):
    w0, grads = data(10_007, dtype)
    w = w0.copy()
    st = backend_steps(CppSteps(kernels), name, w, grads, k)
    ref_w = w0.copy()
    ref_st = backend_steps(NUMPY, name, ref_w, grads, k)
    np.testing.assert_allclose(w, ref_w, **TOL[dtype])
    for key in STATE[name]:
        np.testing.assert_allclose(st[key], ref_st[key], **TOL[dtype])


@pytest.mark.parametrize("count", [1, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_summing_step_kernels_are_sum_then_step(kernels, name, dtype, count):
    w0, grads = data(10_007, dtype, steps=count)
    w = w0.copy()
    st = backend_steps(CppSteps(kernels), name, w, [list(grads)], count)
    ref_w = w0.copy()
    ref_st = backend_steps(NUMPY, name, ref_w, [NUMPY.sum_into(np.empty_like(w0), grads)], count)
    np.testing.assert_allclose(w, ref_w, **TOL[dtype])
    for key in STATE[name]:
        np.testing.assert_allclose(st[key], ref_st[key], **TOL[dtype])


@pytest.mark.parametrize("acc", [0, 1])
@pytest.mark.parametrize("count", [1, 5, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sum_kernel_adds_in_list_order(kernels, dtype, count, acc):
    base, grads = data(10_007, dtype, steps=count)
    out = base.copy()
    pad = grads + grads[:1] * (backend.SUM_GROUP - count)
    kernels("sum", dtype, [*pad, out], (count, acc))
    want = NUMPY.sum_into(np.empty_like(base), ([base] if acc else []) + grads)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("coder", ["int8", "sign", "fp16", "bf16"])
def test_value_decoders_are_the_host_decoders(kernels, coder, dtype):
    n = 3 * tensor.SIGN_BLOCK + 17
    a = np.random.default_rng(4).standard_normal(n).astype(dtype)
    a[5] = np.nan
    applied, buf = tensor.encode(a, coder, rng=np.random.default_rng(0))
    _, arrays, _, dt, k, _ = tensor.decode_staged(memoryview(buf).tobytes(), applied,
                                                  np.dtype(dtype).name, (n,), 1 << 30)
    want = tensor.decode_values(arrays, coder, dt, k)
    out = np.empty(k, dtype)
    if coder == "int8":
        kernels("int8", dtype, [np.ascontiguousarray(arrays[1]), np.ascontiguousarray(arrays[0]),
                                out], (tensor.INT8_BLOCK,))
    elif coder == "sign":
        kernels("sign", dtype, [np.ascontiguousarray(arrays[1]), np.ascontiguousarray(arrays[0]),
                                out], (tensor.SIGN_BLOCK,))
    else:                      # the codes, one uint16 each
        kernels(coder, dtype, [np.ascontiguousarray(arrays[0]), out])
    nan = np.isnan(want)      # a NaN block: NaN either way (the sign of a NaN may differ)
    assert nan.any() and np.array_equal(np.isnan(out), nan)
    u = f"u{out.itemsize}"
    np.testing.assert_array_equal(out[~nan].view(u), want[~nan].view(u))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scatter_add_kernel_accumulates_and_skips_out_of_range(kernels, dtype):
    rng = np.random.default_rng(6)
    dense = rng.standard_normal(100).astype(dtype)
    index = np.array([3, 3, 99, -1, 100, 0], np.int64)
    value = rng.standard_normal(6).astype(dtype)
    got = dense.copy()
    kernels("scatter_add", dtype, [value, index, got], (got.size,), n=index.size)
    want = dense.copy()
    ok = (index >= 0) & (index < 100)
    np.add.at(want, index[ok], value[ok])
    np.testing.assert_allclose(got, want, **TOL[dtype])
