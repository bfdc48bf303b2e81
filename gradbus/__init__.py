"""gradbus: an asynchronous parameter server over a ZeroMQ broker.

>>> import gradbus, numpy as np                                    # doctest: +SKIP
>>> c = gradbus.connect("tcp://127.0.0.1:5555")
>>> c.init({"w": np.zeros(4, np.float32)}, optimizer=gradbus.SGD(lr=0.5))
>>> c.push({"w": np.ones(4, np.float32)}).result()
>>> c.pull(min_version=1)["w"]
array([-0.5, -0.5, -0.5, -0.5], dtype=float32)
"""
__version__ = "0.1.0"

from gradbus.codecs.errors import (  # noqa: E402
    BackPressureError,
    BrokerUnavailableError,
    ClosedError,
    GradbusError,
    MovedError,
    SecurityError,
    ShardUnavailableError,
    StaleError,
    UnknownKeyError,
)
from gradbus.codecs.security import Curve  # noqa: E402
from gradbus.codecs.specs import FTRL, SGD, Adagrad, Adam, Constant, Normal, Uniform, Zeros  # noqa: E402

# The SDK's client is imported when first named, so that a broker or shard process (whose
# modules live under this package) does not load the client's modules at start.
_LAZY = {"Client": "gradbus.workers.client", "connect": "gradbus.workers.client",
         "TierClient": "gradbus.workers.tier_client"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradbus' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})

__all__ = ["connect", "Client", "SGD", "Adam", "Adagrad", "FTRL", "Zeros", "Constant", "Normal",
           "Uniform", "GradbusError", "ShardUnavailableError", "UnknownKeyError",
           "BackPressureError", "BrokerUnavailableError", "ClosedError", "SecurityError",
           "StaleError", "MovedError", "TierClient",
           "Curve", "__version__"]
