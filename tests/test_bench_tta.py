"""bench/time_to_accuracy.py: how a run's curve becomes the reported figures, the worker's
pieces, and (slow) the smoke run end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import time_to_accuracy as tta  # noqa: E402

CURVE = [[0.0, 0.10, 2.3], [0.5, 0.90, 0.5], [1.0, 0.96, 0.2], [1.5, 0.94, 0.25],
         [2.0, 0.97, 0.15]]


def test_time_to_target_and_final_point():
    assert tta.time_to(CURVE, 0.95) == 1.0
    assert tta.time_to(CURVE, 0.99) is None
    assert tta.at_budget(CURVE, 1.7) == [1.5, 0.94, 0.25]
    assert tta.at_budget(CURVE, 5.0) == CURVE[-1]


def test_smoothing_averages_the_trailing_window():
    s = tta.smoothed(CURVE, 1.0)        # points in (t - 1.0, t]
    assert [pt[0] for pt in s] == [pt[0] for pt in CURVE]
    assert s[0][1] == pytest.approx(0.10)
    assert s[2][1] == pytest.approx((0.90 + 0.96) / 2)
    assert s[3][1] == pytest.approx((0.96 + 0.94) / 2)
    assert s[4][1] == pytest.approx((0.94 + 0.97) / 2)
    assert s[4][2] == pytest.approx((0.25 + 0.15) / 2)
    # smoothed, the single reading above 0.952 at 1.0 s no longer counts as a crossing
    assert tta.time_to(CURVE, 0.952) == 1.0
    assert tta.time_to(s, 0.952) == 2.0
    assert tta.smoothed(CURVE, 0.1) == CURVE


def test_bytes_until_sums_each_workers_last_note():
    traces = [[[0.0, 1, 10], [1.0, 5, 50], [2.0, 9, 90]],
              [[0.0, 1, 10], [0.9, 3, 30], [1.9, 6, 60]]]
    assert tta.bytes_until(traces, 1.0) == 50 + 30
    assert tta.bytes_until(traces, 0.5) == 10 + 10
    assert tta.bytes_until(traces, None) is None


def test_mean_staleness_between_two_summaries():
    before = {"count": 10, "mean": 2.0}
    after = {"count": 30, "mean": 3.0}          # 20 pushes with a sum of 70
    assert tta._mean_between(before, after) == 3.5
    assert tta._mean_between(after, after) is None
    assert tta._mean_between(None, after) is None
    assert tta._mean_between({"count": 0, "mean": None}, {"count": 4, "mean": 1.5}) == 1.5


def test_push_momentum_rule():
    assert tta.push_momentum(0.9, 4) == pytest.approx(0.6)
    assert tta.push_momentum(0.9, 1) == pytest.approx(0.9)
    assert tta.push_momentum(0.9, 16) == 0.0
    assert tta.push_momentum(0.9, 4, given=0.9) == 0.9


def _run(config, seed, tta_s, acc, nbytes, steps, straggler=1.0):
    return {"config": config, "seed": seed, "straggler": straggler, "seconds_to_target": tta_s,
            "final_accuracy": acc, "final_log_loss": 0.1, "grad_bytes": nbytes,
            "grad_bytes_to_target": None if tta_s is None else nbytes // 2, "steps": steps,
            "refused": 0, "mean_staleness": None}


def test_aggregate_medians_and_ratios():
    runs = [_run("ddp", s, t, 0.96, 1000, [10, 10]) for s, t in enumerate([4.0, 6.0, 5.0])]
    runs += [_run("async", s, t, a, 2000, [12, 20 + s])
             for s, (t, a) in enumerate([(2.0, 0.95), (3.0, 0.97), (None, 0.96)])]
    runs += [_run("async_topk", s, 4.0, 0.96, 40, [12, 20]) for s in range(3)]
    lines = {ln["config"]: ln for ln in tta.aggregate(runs, 0.95, 20.0)}
    assert set(lines) == {"ddp", "async", "async_topk"}
    ddp, asy, topk = lines["ddp"], lines["async"], lines["async_topk"]
    assert ddp["seconds_to_target"] == 5.0 and ddp["vs_ddp_seconds"] == 1.0
    assert asy["seconds_to_target"] is None           # a seed never got there: no median
    assert asy["per_seed_seconds_to_target"] == [2.0, 3.0, None]
    assert asy["vs_ddp_seconds"] is None
    assert asy["vs_ddp_accuracy_pp"] == 0.0
    assert asy["steps"] == [12, 21]
    assert topk["vs_ddp_seconds"] == 0.8
    assert topk["vs_async_grad_bytes_to_target"] is None   # async has no median to compare
    assert all(ln["bench"] == "time_to_accuracy" and ln["straggler"] == 1.0
               for ln in lines.values())
    json.dumps(list(lines.values()))


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        tta.parse_args(["--configs", "ddp,nosuch"])
    with pytest.raises(SystemExit):
        tta.parse_args(["--workers", "3", "--batch", "32"])
    a = tta.parse_args(["--quick"])
    assert (a.workers, a.seeds, a.stragglers, a.budget) == (2, [0], [2.0], 3.0)
    a = tta.parse_args(["--quick", "--budget", "1.5", "--seeds", "4"])
    assert (a.workers, a.seeds, a.budget) == (2, [4], 1.5)


def test_worker_pieces():
    torch = pytest.importorskip("torch")
    import tta_worker as w
    X = np.arange(10, dtype=np.float32).reshape(10, 1)
    y = np.arange(10, dtype=np.int64)
    it = w.batches(X, y, 4, np.random.default_rng(0))
    seen = [next(it)[1].numpy() for _ in range(4)]     # two epochs, the partial batch dropped
    assert all(len(b) == 4 for b in seen)
    assert len(set(np.concatenate(seen[:2]))) == 8
    with pytest.raises(ValueError):
        next(w.batches(X, y, 11, np.random.default_rng(0)))
    a, b = w.make_model(3), w.make_model(3)
    assert all(np.array_equal(p.detach().numpy(), q.detach().numpy())
               for p, q in zip(a.parameters(), b.parameters()))
    rec = w.Recorder(t0=0.0, every=1e9, weights=True)
    rec.tick(a, 1, 100)            # the first tick always records, later ones wait the interval
    rec.tick(a, 2, 200)
    rec.tick(a, 3, 300, force=True)
    assert [tr[1:] for tr in rec.trace] == [[1, 100], [3, 300]]
    Xt = np.random.default_rng(1).random((20, 64), dtype=np.float32)
    with torch.no_grad():
        expect = (a(torch.from_numpy(Xt)).argmax(1).numpy() == 0).mean()
    curve = rec.curve(w.make_model(4), Xt, np.zeros(20, np.int64))
    assert len(curve) == 2 and curve[0][1] == pytest.approx(expect, abs=1e-5)


def test_plot_draws_a_png(tmp_path):
    """In a child process: matplotlib keeps its font files open."""
    pytest.importorskip("matplotlib")
    import tta_plot
    assert tta_plot.median_curve([CURVE, CURVE[:2]], [0.0, 1.2], 1) == [0.10, (0.96 + 0.90) / 2]
    runs = [{**_run(c, s, 1.0, 0.96, 10, [1]), "curve": CURVE}
            for c in ("ddp", "async") for s in (0, 1)]
    args = {"eval_every": 0.5, "budget": 2.0, "smooth": 1.0, "target": 0.95, "workers": 2,
            "step_ms": 30.0, "jitter": 0.0, "seeds": [0, 1]}
    curves, out = tmp_path / "curves.json", tmp_path / "tta.png"
    curves.write_text(json.dumps({"args": args, "runs": runs}))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tta_plot.py"), str(curves),
                    str(out)], check=True, timeout=120, cwd=ROOT)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_run_prints_one_line_per_configuration(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    curves = tmp_path / "curves.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "time_to_accuracy.py"),
                           "--quick", "--budget", "1.5", "--configs", "ddp,async,single",
                           "--curves", str(curves)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert [ln["config"] for ln in lines] == ["ddp", "async", "single"]
    for ln in lines:
        assert ln["bench"] == "time_to_accuracy" and ln["straggler"] == 2.0
        assert 0.0 <= ln["final_accuracy"] <= 1.0 and ln["grad_bytes"] > 0
        assert all(s > 0 for s in ln["steps"])
    assert len(lines[0]["steps"]) == 2 and len(lines[2]["steps"]) == 1
    assert lines[0]["steps"][0] == lines[0]["steps"][1]          # DDP ranks in lockstep
    data = json.loads(curves.read_text())
    assert len(data["runs"]) == 3 and all(len(r["curve"]) >= 2 for r in data["runs"])
    assert data["args"]["workers"] == 2 and data["args"]["budget"] == 1.5
