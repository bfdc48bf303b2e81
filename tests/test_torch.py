"""gradbus.torch: an nn.Module's parameters on a real cluster, and the example end to end."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradbus  # noqa: E402
import gradbus.torch  # noqa: E402
from gradbus.torch import ParameterServerModule  # noqa: E402

from . import fake_cuda  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "torch_digits.py"
LR = 0.25   # powers of two: every intermediate result is exact in float32, float64 and bf16
G = 0.5


class Tiny(torch.nn.Module):
    """Nested names, a 0-d parameter and a frozen parameter (never a gradient)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        self.head = torch.nn.Linear(3, 2, bias=False)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.frozen = torch.nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x):
        return self.head(self.body(x)) * self.scale


def exact_init(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Small integers in every parameter (exact arithmetic); returns a copy of them."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_((torch.arange(p.numel()) % 7 + i).reshape(p.shape).to(p.dtype))
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def constant_grad_step(ps: ParameterServerModule, g: float):
    """A backward whose gradient is ``g`` for every used parameter, then ``ps.step()``."""
    loss = sum((p * g).sum() for p in ps.module.parameters() if p.requires_grad)
    loss.backward()
    return ps.step()


def params_of(ps: ParameterServerModule) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in ps.module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codec", ["raw", "bf16"])
def test_known_answer_sgd(make_cluster, dtype, codec):
    cluster = make_cluster(2, processes=False)
    model = Tiny().to(dtype)
    w0 = exact_init(model)
    n_push = 6
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, optimizer=gradbus.SGD(lr=LR), codec=codec)
        assert ps.version == 0
        for _ in range(n_push):
            constant_grad_step(ps, G)
            assert all(p.grad is None for p in model.parameters())
        client.flush()
        assert ps.sync(min_version=n_push) == n_push
        # the frozen parameter was never pushed: the server still holds version 0
        assert client.version("frozen") == 0
    got = params_of(ps)
    for name, w in w0.items():
        expect = w if name == "frozen" else w - n_push * LR * G
        assert got[name].dtype == w.dtype and got[name].shape == w.shape
        assert np.array_equal(got[name], expect), name


def test_names_map_to_keys(make_cluster):
    cluster = make_cluster(1, processes=False)
    model = Tiny()
    w0 = exact_init(model)
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, prefix="tiny.")
        names = [n for n, _ in model.named_parameters()]
        assert names == ["scale", "frozen", "body.0.weight", "body.0.bias", "head.weight"]
        assert ps.keys == {n: "tiny." + n for n in names}
        on_server = client.pull(list(ps.keys.values()))
        tensors = {t["name"] for t in client.status()["tensors"]}
    assert tensors >= set(ps.keys.values())
    for n in names:
        assert np.array_equal(on_server["tiny." + n].reshape(w0[n].shape), w0[n]), n
    # the wrapper is the module: same forward, parameters registered under "module."
    x = torch.ones(1, 4)
    assert torch.equal(ps(x), model(x))
    assert {n for n, _ in ps.named_parameters()} == {"module." + n for n in names}


def test_second_worker_gets_first_workers_weights(make_cluster):
    cluster = make_cluster(2, processes=False)
    first, second = Tiny(), Tiny()
    w_first = exact_init(first)
    with torch.no_grad():
        for p in second.parameters():
            p.fill_(-1.0)
    with gradbus.connect(cluster.url) as a, gradbus.connect(cluster.url) as b:
        ps_a = ParameterServerModule(first, a, optimizer=gradbus.SGD(lr=LR))
        ps_b = ParameterServerModule(second, b, optimizer=gradbus.SGD(lr=1.0))   # exists: no-op
        for n, w in params_of(ps_b).items():
            assert np.array_equal(w, w_first[n]), n
        constant_grad_step(ps_a, G)     # the first worker's update reaches the second
        a.flush()
        ps_b.sync(min_version=1)
    for n, w in params_of(ps_b).items():
        expect = w_first[n] if n == "frozen" else w_first[n] - LR * G   # the first's optimizer
        assert np.array_equal(w, expect), n


def test_lossy_codec_with_error_feedback(make_cluster):
    cluster = make_cluster(2, processes=False)
    model = torch.nn.Linear(64, 8)
    w0 = exact_init(model)
    n_push = 8
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, optimizer=gradbus.SGD(lr=LR),
                                   codec="topk:0.25|int8|zstd")
        for _ in range(n_push):
            loss = sum((p * G).sum() for p in model.parameters())
            loss.backward()
            ps.step()
        client.flush()
        ps.sync(min_version=n_push)
        stats = client.compression_stats()
    assert stats["push_bytes"] < stats["push_raw_bytes"] / 2
    assert stats["error_feedback_keys"] == 2
    for n, p in model.named_parameters():
        applied = (w0[n] - p.detach().numpy()) / LR     # the gradient mass that reached the server
        # top-k sends a quarter of each gradient; error feedback sends the rest in later pushes
        assert np.all(applied > 0), n
        assert np.all(applied <= n_push * G * 1.01), n
        assert applied.sum() >= 0.7 * n_push * G * p.numel(), n


def test_consistency_is_set_at_creation(make_cluster):
    """ssp:0 through the adapter: a step computed on weights one push old is refused with
    StaleError (its Future, acks=1), and nothing of it is applied."""
    cluster = make_cluster(1, processes=False)
    first, second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    w0 = exact_init(first)
    with gradbus.connect(cluster.url) as a, gradbus.connect(cluster.url) as b:
        ps_a = ParameterServerModule(first, a, optimizer=gradbus.SGD(lr=LR), acks=1,
                                     consistency="ssp:0")
        ps_b = ParameterServerModule(second, b, acks=1)     # exists: keeps ssp:0
        assert ps_a.version == ps_b.version == 0
        constant_grad_step(ps_a, G).result(30)               # version 0 -> 1
        fut = constant_grad_step(ps_b, G)                    # computed on version 0
        with pytest.raises(gradbus.StaleError):
            fut.result(30)
        assert ps_a.sync(min_version=1) == 1
        refused = b.status()["workers"]
    for n, p in first.named_parameters():
        assert np.array_equal(p.detach().numpy(), w0[n] - LR * G), n
    assert sum(w.get("errors", {}).get("STALE", 0) for w in refused) == 1


def test_step_without_gradients_only_loads(make_cluster):
    cluster = make_cluster(1, processes=False)
    model = torch.nn.Linear(3, 1)
    w0 = exact_init(model)
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client)
        with torch.no_grad():
            model.weight.zero_()       # a local change the next load replaces
        assert ps.step() is None
        assert np.array_equal(model.weight.detach().numpy(), w0["weight"])
        assert client.stats["pushes"] == 0


def test_unsupported_parameters_are_refused(make_cluster):
    cluster = make_cluster(1, processes=False)
    with gradbus.connect(cluster.url) as client:
        with pytest.raises(TypeError, match="float32 or float64"):
            ParameterServerModule(torch.nn.Linear(2, 2).half(), client)
        with pytest.raises(ValueError, match="no parameters"):
            ParameterServerModule(torch.nn.ReLU(), client)
        assert client.status()["tensors"] == []
        emb = torch.nn.Embedding(10, 3, sparse=True)
        ps = ParameterServerModule(emb, client)
        ps(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(TypeError, match="sparse gradients"):
            ps.step()
        assert client.stats["pushes"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_known_answer_sgd_cuda(make_cluster):
    cluster = make_cluster(1, processes=False)
    model = Tiny()
    w0 = exact_init(model)
    model = model.cuda()
    n_push = 4
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, optimizer=gradbus.SGD(lr=LR), codec="bf16")
        for _ in range(n_push):
            constant_grad_step(ps, G)
        client.flush()
        ps.sync(min_version=n_push)
    for n, p in model.named_parameters():
        assert p.is_cuda
        expect = w0[n] if n == "frozen" else w0[n] - n_push * LR * G
        assert np.array_equal(p.detach().cpu().numpy(), expect), n


# -- the CUDA branches, on CPU tensors through the stand-in (tests/fake_cuda.py) -----------------
@pytest.fixture
def cuda_standin(monkeypatch):
    """``gradbus.torch`` sees every tensor as device memory and CuPy as the stand-in: a
    gradient goes to the SDK as a (stand-in) CuPy view, or through a pinned staging buffer."""
    return fake_cuda.install(monkeypatch, torch_devices=True)


@pytest.mark.parametrize("codec", ["raw", "bf16", "topk:1|fp16"])
def test_known_answer_sgd_through_the_device_path(make_cluster, cuda_standin, codec):
    """Each gradient is handed to the SDK as a CuPy view (encoded by codecs/device.py on the
    stand-in), the streams are synchronized before the push, the weights are loaded by a copy
    into the parameters: N pushes of G with SGD(LR) give w0 - N*LR*G exactly."""
    cluster = make_cluster(1, processes=False)
    model = Tiny()
    w0 = exact_init(model)
    n_push = 4
    before = gradbus.codecs.device.device_fallbacks
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, optimizer=gradbus.SGD(lr=LR), codec=codec)
        for _ in range(n_push):
            constant_grad_step(ps, G)
        client.flush()
        assert ps.sync(min_version=n_push) == n_push
    assert fake_cuda.STATE.syncs == n_push and fake_cuda.STATE.pinned == 0
    assert gradbus.codecs.device.device_fallbacks == before     # encoded where it lives
    for name, w in w0.items():
        expect = w if name == "frozen" else w - n_push * LR * G
        assert np.array_equal(params_of(ps)[name], expect), name


def test_known_answer_with_local_accumulation_goes_through_pinned_staging(make_cluster,
                                                                          cuda_standin):
    """Accumulation on: the gradients are copied into pinned host buffers, allocated once per
    parameter and reused, and summed on the host; 6 steps sent as 3 sums of 2."""
    cluster = make_cluster(1, processes=False)
    model = Tiny()
    w0 = exact_init(model)
    with gradbus.connect(cluster.url) as client:
        ps = ParameterServerModule(model, client, optimizer=gradbus.SGD(lr=LR))
        client.accumulate(every=2)
        assert client.accumulating
        for _ in range(6):
            constant_grad_step(ps, G)
        client.flush()
        ps.sync(min_version=6)
        assert client.stats["pushes"] == 3
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert fake_cuda.STATE.pinned == len(trained)
    for name, w in w0.items():
        expect = w if name == "frozen" else w - 6 * LR * G
        assert np.array_equal(params_of(ps)[name], expect), name


def run_example(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(EXAMPLE), "--json", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert any(line.startswith("  worker 1  epoch") for line in lines)   # progress shown
    return json.loads(lines[-1])


def test_example_trains_two_workers():
    # 8 epochs: measured 0.939-0.969 test accuracy over 7 runs (chance: 0.1), 12-22 s on a
    # loaded 2-core machine
    s = run_example("--epochs", "8", "--workers", "2")
    assert s["workers"] == 2 and s["pushes"] == 2 * 8 * 23
    assert s["test_accuracy"] >= 0.85, s
