"""PyTorch adapter: train an ``nn.Module`` against a gradbus cluster.

>>> import torch, gradbus, gradbus.torch                               # doctest: +SKIP
>>> client = gradbus.connect("tcp://127.0.0.1:5555")
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
>>> ps = gradbus.torch.ParameterServerModule(model, client, optimizer=gradbus.Adam(lr=1e-3),
...                                          codec="topk:0.01|int8|zstd")
>>> for x, y in batches:
...     loss = torch.nn.functional.cross_entropy(ps(x), y)
...     loss.backward()
...     ps.step()          # push the gradients, load the freshest weights
>>> client.flush()

The optimizer runs on the shards: ``ps.step()`` replaces ``optimizer.step()``. See docs/torch.md.
"""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from gradbus.codecs import specs
from gradbus.workers.client import Client

DTYPES = (torch.float32, torch.float64)

__all__ = ["ParameterServerModule"]


class ParameterServerModule(torch.nn.Module):
    """Wrap ``module`` so that its parameters live on a gradbus cluster.

    On construction every parameter of ``module.named_parameters()`` is created on the server
    under the key ``prefix + name`` (``"0.weight"``, ``"fc.bias"``, ...) with ``optimizer`` (see
    :attr:`keys`). Creation is idempotent: names that already exist keep their server values, and
    those values are loaded into the module, so every worker starts from the weights of the first
    one (or from wherever training has got to). ``consistency``, ``stale_policy`` and
    ``scale_lr`` are :meth:`Client.init`'s, for the parameters this call creates (async,
    ``"ssp:S"``, ``"bsp:N"``; see docs/sdk.md): an ssp push refused as too stale raises
    :class:`gradbus.StaleError` from the push's Future (``acks=1``) or from a later step.

    ``ps(x)`` calls the wrapped module. After ``loss.backward()``, :meth:`step` pushes every
    parameter's gradient with ``codec`` (any chain the SDK takes; ``None``: the client's),
    clears the gradients and copies the freshest weights from the client's local cache into the
    parameters, without waiting for the push. :meth:`sync` loads the weights alone.

    Scope and limits:

    * Parameters must be float32 or float64 and dense (no sparse gradients). A parameter whose
      ``grad`` is None after backward (unused in the forward, or frozen) is not pushed; frozen
      ones (``requires_grad=False``) are still created and loaded, so workers share them.
    * Buffers (BatchNorm running statistics, ...) are not parameters and are not shared: each
      worker keeps its own.
    * CPU tensors: gradients go to the SDK as ``.numpy()`` views (no copy in the adapter), and
      weights are copied once, from the cache (or from the shards' boards, on one host)
      straight into the parameters' memory (``pull(out=...)``).
    * CUDA tensors, with CuPy installed: each gradient is handed to the SDK as a CuPy view of
      the same device memory (DLPack, no copy); the SDK selects, casts or quantizes it on the
      GPU (``codecs/device.py``), so only the compressed bytes cross to the host, and keeps the
      error-feedback residual on the GPU. Local accumulation on, or no CuPy: the gradient is
      copied to a pinned host buffer (reused from step to step) and encoded on the host. Weights are copied from the
      host cache to the device.
    * Not thread-safe: one thread drives a ``ParameterServerModule``. Load weights
      (:meth:`sync`, :meth:`step`) after a backward, not between a forward and its backward:
      the parameters' memory is written in place.
    """

    def __init__(self, module: torch.nn.Module, client: Client, *,
                 optimizer: specs.Optimizer | None = None, codec: str | None = None,
                 acks: int | str = 0, prefix: str = "", timeout: float | None = None,
                 consistency: str | None = None, stale_policy: str = "refuse",
                 scale_lr: bool = False):
        super().__init__()
        self.module = module
        self.client = client
        self.codec = codec
        self.acks = acks
        self.timeout = timeout
        params = dict(module.named_parameters())
        if not params:
            raise ValueError("the module has no parameters")
        for name, p in params.items():
            if p.dtype not in DTYPES:
                raise TypeError(f"{name}: parameters must be float32 or float64, not {p.dtype}")
        self._params = params
        self._keys = {name: prefix + name for name in params}
        self._trainable = [self._keys[n] for n, p in params.items() if p.requires_grad]
        self._staging: dict[str, torch.Tensor] = {}   # name -> pinned host buffer (CUDA grads)
        self.version = -1   # gradients applied to the weights loaded (least over the trainable)
        client.init({self._keys[n]: p.detach().cpu().numpy() for n, p in params.items()},
                    optimizer=optimizer, timeout=timeout, consistency=consistency,
                    stale_policy=stale_policy, scale_lr=scale_lr)
        self.sync()

    @property
    def keys(self) -> dict[str, str]:
        """Parameter name -> gradbus key."""
        return dict(self._keys)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self, zero_grad: bool = True) -> Future | None:
        """Push the gradients, then load the freshest weights. Returns the push's Future (None
        when no parameter has a gradient). With ``zero_grad`` the gradients are set to None
        afterwards (the next backward starts from zero)."""
        grads = self._grads()
        fut = None
        if grads:
            fut = self.client.push({self._keys[n]: g for n, g in grads.items()}, codec=self.codec,
                                   acks=self.acks,
                                   version=self.version if self.version >= 0 else None,
                                   timeout=self.timeout)
        if zero_grad:
            for p in self._params.values():
                p.grad = None
        self.sync()
        return fut

    def sync(self, min_version: int | None = None, timeout: float | None = None) -> int:
        """Copy the freshest weights of the client's cache into the parameters; with
        ``min_version``, first wait until every trainable parameter (``requires_grad``) has at
        least that many gradients applied. Returns :attr:`version`."""
        timeout = self.timeout if timeout is None else timeout
        versions = self._versions()
        if min_version is not None:
            self.client.pull(self._trainable, min_version=min_version, timeout=timeout)
            versions.update({k: max(versions[k], min_version) for k in self._trainable})
        into = {self._keys[n]: p.detach().numpy() for n, p in self._params.items()
                if _is_host(p) and p.is_contiguous()}
        self._load(self.client.pull(list(self._keys.values()), timeout=timeout, out=into),
                   versions, set(into))
        return self.version

    # -- internals ------------------------------------------------------------------------
    def _versions(self) -> dict[str, int]:
        """Each key's cache version, read *before* its array: the array holds at least that."""
        return {k: self.client.version(k) for k in self._keys.values()}

    def _grads(self) -> dict[str, np.ndarray]:
        out, on_device = {}, set()
        for name, p in self._params.items():
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise TypeError(f"{name}: sparse gradients are not supported")
            g = g.detach()
            if _is_host(g):
                out[name] = g.numpy()        # a view, no copy
                continue
            dev_view = _cupy_view(g, self.codec or self.client.codec, self.client)
            if dev_view is not None:
                on_device.add(g.device)      # the SDK reads it on its stream: sync first
                out[name] = dev_view
                continue
            buf = self._staging.get(name)
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                buf = self._staging[name] = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            buf.copy_(g, non_blocking=True)
            on_device.add(g.device)
            out[name] = buf.numpy()
        for dev in on_device:              # the copies were queued on each device's stream
            torch.cuda.current_stream(dev).synchronize()
        return out

    def _load(self, weights: dict[str, np.ndarray], versions: dict[str, int],
              loaded=frozenset()) -> None:
        """Copy ``weights`` into the parameters, but for the keys ``loaded`` already (the
        pull copied them straight into the parameters' memory)."""
        with torch.no_grad():
            for name, p in self._params.items():
                if self._keys[name] not in loaded:
                    p.copy_(_as_tensor(weights[self._keys[name]]).reshape(p.shape))
        self.version = min(versions[k] for k in self._trainable or versions)


def _is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is in host memory (else on a device: CUDA)."""
    return t.device.type == "cpu"


def _cupy_view(g: torch.Tensor, chain: str, client):
    """A CuPy array on ``g``'s device memory (no copy) when the SDK can encode ``chain`` on the
    device; None otherwise (no CuPy, a value coder not done on the device, local accumulation
    on)."""
    from gradbus.codecs import device
    from gradbus.codecs import tensor as tcodec
    if tcodec.parse_stages(chain).coder not in device.DEVICE_CODERS or client.accumulating:
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy.from_dlpack(g.contiguous())


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor on ``a``'s memory without a copy (only ever read). The cache's arrays are
    read-only, which ``torch.from_numpy`` warns about; versioned DLPack (numpy >= 2.1) carries
    the read-only flag instead. Where that export is refused, one copy."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    try:
        return torch.from_dlpack(a)
    except (BufferError, TypeError, RuntimeError):   # older numpy: no read-only DLPack export
        return torch.from_numpy(np.array(a))
