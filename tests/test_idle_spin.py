"""Spinning where the host has cores to spare (gradbus/codecs/cores.py): who decides (an
operator's number, else the host), the host's rule (enough cores, enough of them idle, looked
at again each second), the settings that carry it (``--spin-us auto``, the SDK's ``spin_us``),
and a cluster told to spin that goes quiet once its traffic stops."""
from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

import gradbus
from gradbus import config
from gradbus.cli import main
from gradbus.codecs import cores

from .rigs import wait_for


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_forced_spin_is_what_was_set_whatever_the_host():
    for us, want in ((0, 0.0), (200, 200e-6)):
        s = cores.Spin(us, 500, cores=64, load=lambda: 0.0)
        assert s.seconds() == pytest.approx(want) and s.chosen == "forced"
    crowded = cores.Spin(300, 500, cores=2, load=lambda: 9.0)
    assert crowded.seconds() == pytest.approx(300e-6)


def test_the_host_decides_by_its_cores_and_its_load():
    assert not cores.spare(2, 0.0) and not cores.spare(3, 0.0)     # too few cores
    assert cores.spare(4, 1.0) and not cores.spare(4, 2.5)         # 2 must stay idle
    assert cores.spare(16, 11.0) and not cores.spare(16, 12.5)     # a quarter idle
    assert cores.Spin(None, 500, cores=16, load=lambda: 3.0).seconds() == pytest.approx(500e-6)
    assert cores.Spin(None, 500, cores=16, load=lambda: 15.0).seconds() == 0.0
    assert cores.Spin(None, 500, cores=2, load=lambda: 0.0).seconds() == 0.0


def test_the_load_is_looked_at_again_each_second_not_at_every_turn():
    load, looks, clock = [3.0], [], Clock()

    def host_load():
        looks.append(clock.t)
        return load[0]
    s = cores.Spin(None, 200, cores=16, load=host_load, clock=clock)
    assert s.seconds() > 0
    load[0] = 15.0                                   # the host filled up
    clock.t = 0.5
    assert s.seconds() > 0 and looks == [0.0]        # not looked at yet
    clock.t = 1.0
    assert s.seconds() == 0.0 and looks == [0.0, 1.0]
    load[0] = 1.0
    clock.t = 2.5
    assert s.seconds() > 0


def test_bad_spins_are_refused():
    for bad in (-1, 1.5, "5"):
        with pytest.raises(ValueError):
            cores.Spin(bad, 200)


def test_the_setting_takes_auto_or_microseconds():
    conv = config.SPIN_US.convert
    assert conv("auto", None, None) == "auto" == conv("AUTO", None, None)
    assert conv(None, None, None) == "auto"
    assert config.spin_seconds("auto") is None and config.spin_seconds(250) == 250e-6
    assert conv("0", None, None) == 0 and conv(250, None, None) == 250
    for bad in ("-1", "100001", "fast", 1.5, True):
        with pytest.raises(Exception, match="auto"):
            conv(bad, None, None)
    out = CliRunner().invoke(main, ["broker", "--spin-us", "soon"])
    assert out.exit_code == 2 and "'soon' is not 'auto'" in out.output


def test_the_describe_line_says_who_chose_and_what():
    assert cores.Spin(0, 200).describe() == "spin off (set)"
    assert cores.Spin(150, 200).describe() == "spin 150 us (set)"
    line = cores.Spin(None, 200, cores=16, load=lambda: 2.0).describe()
    assert "16 usable" in line and "on now" in line
    assert "off now" in cores.Spin(None, 200, cores=2, load=lambda: 0.0).describe()


def test_the_sdk_judges_from_the_host_unless_told(make_cluster):
    cluster = make_cluster(1)
    with gradbus.connect(cluster.url, timeout=30) as c:
        assert c.spin.chosen == "host"
        assert c.spin.seconds() == (cores.CALLER_SPIN_US * 1e-6
                                    if cores.spare(c.spin.cores, cores.host_load()) else 0.0)
    with gradbus.connect(cluster.url, timeout=30, spin_us=0) as c:
        assert c.spin.chosen == "forced" and c.spin.seconds() == 0.0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_cluster_told_to_spin_goes_quiet_when_its_traffic_stops(make_cluster):
    """Spins of 5 ms (25 times the host's choice) at the broker and the shard: while pushes
    come, both poll; once they stop, each loop's next turn finds nothing and blocks, so the
    processes' CPU falls to next to nothing (a spin is only ever taken after a turn that had
    messages: the heartbeats, a few a second, cost a few spins)."""
    cluster = make_cluster(1, broker_args=["--spin-us", "5000"],
                           shard_args=["--spin-us", "5000"])
    with gradbus.connect(cluster.url, timeout=30, spin_us=0) as c:
        c.init({"w": np.zeros(4096, np.float32)}, optimizer=gradbus.SGD(lr=1.0))
        for _ in range(200):
            c.push({"w": np.ones(4096, np.float32)})
        c.flush(timeout=30)
    pids = cluster.pids()
    assert len(pids) == 2
    last = {"t": None, "cpu": None}

    def quiet() -> bool:
        # CPU of the broker and the shard over the last look's interval: under 10% of a core
        now, cpu = os.times().elapsed, sum(_cpu_s(p) for p in pids)
        if last["t"] is not None and now - last["t"] < 1.0:
            return False                 # a window of at least a second
        before = last["t"], last["cpu"]
        last["t"], last["cpu"] = now, cpu
        return before[0] is not None and (cpu - before[1]) / (now - before[0]) < 0.10
    wait_for(quiet, 30.0, "the broker and the shard to go quiet after the traffic")


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n")                 # --cpus 2.5
    assert cores.cgroup_quota(str(f)) == 3
    assert cores.usable_cores(str(f)) == min(3, len(os.sched_getaffinity(0)))
    f.write_text("max 100000\n")
    assert cores.cgroup_quota(str(f)) is None
    assert cores.usable_cores(str(f)) == len(os.sched_getaffinity(0))
    f.write_text("garbage")
    assert cores.cgroup_quota(str(f)) is None
    assert cores.cgroup_quota(str(tmp_path / "none")) is None
    f.write_text("50000 100000")                    # half a core: still one
    assert cores.usable_cores(str(f)) == 1
