"""docker/k8s-tier: a broker tier of two members on Kubernetes, rendered as an operator applies
it (``kubectl kustomize``; skipped where kubectl is not installed) and checked with
tests/test_deploy.py's parser: every command line parses; each member is a broker pair whose
Services, ports, peers, CURVE keys and shards hold together as docker/k8s's one pair does;
every broker names the same members in the same order, each pair its own index, and keeps the
map on a claim of its own; member 1 is member 0 under other names (the files cannot drift
apart); and the check catches an operator's likely mistakes."""
from __future__ import annotations

import copy
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from gradbus.codecs import net
from tests import test_deploy as deploy

TIER = pathlib.Path(__file__).resolve().parent.parent / "docker" / "k8s-tier"
KUBECTL = shutil.which("kubectl")
#: each member's workloads (a pair's two brokers, the shards), as the files name them
MEMBERS = [("broker", "broker-b", "shard"), ("broker-1", "broker-1-b", "m1-shard")]
SHARED = ("Namespace", "ConfigMap", "Secret")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (its kustomize) not installed")


def render() -> dict[tuple[str, str], dict]:
    r = subprocess.run([KUBECTL, "kustomize", str(TIER)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout)}


def member_objects(objs: dict, i: int) -> dict:
    """Member ``i``'s objects with what every member shares (the workers go with member 0:
    they enter the tier there)."""
    names = set(MEMBERS[i])
    return {(k, n): o for (k, n), o in objs.items()
            if k in SHARED or n in names or (k == "Job" and i == 0)
            or (k == "PersistentVolumeClaim" and n.rsplit("-tier-map", 1)[0] in names)}


def _opt(args: list, flag: str) -> list[str]:
    return [args[j + 1] for j, a in enumerate(args) if a == flag]


def check_tier(objs: dict, tmp: pathlib.Path) -> list[str]:
    """Problems of the tier's manifests: each member's as one pair's, then the tier's own."""
    out: list[str] = []
    lists, indexes, maps = set(), {}, {}
    for i, (a, b, shard) in enumerate(MEMBERS):
        mine = member_objects(objs, i)
        (tmp / f"m{i}").mkdir(parents=True, exist_ok=True)
        procs, envs, problems = deploy.k8s_procs(mine, tmp / f"m{i}")
        out += problems + deploy.check_env(envs) + deploy.check_curve(procs)
        lines, mains, brokers = deploy.main_lines(procs, " args", pair=True)
        out += lines
        reach = {}
        for br in brokers:
            bad, reached = deploy._check_broker_service(mine, br)
            out += bad
            if reached is not None:
                reach[br.service] = reached
        out += deploy.check_broker_urls(procs, reach)
        sts = mine.get(("StatefulSet", shard))
        if sts is None or not brokers:
            out.append(f"member {i}: no shards ({shard}) or no brokers")
            continue
        out += deploy.check_shard_count(sts["spec"]["replicas"], brokers[0])
        own = [f"tcp://{h}:{p}" for h, p in (reach.get(n, ("?", 0)) for n in (a, b))]
        for br in brokers:
            p = br.params
            lists.add(tuple(p["tier_members"]))
            indexes.setdefault(p["tier_index"], set()).add(br.service)
            if p["tier_index"] is not None and p["tier_index"] < len(p["tier_members"]):
                named = set(net.broker_urls(p["tier_members"][p["tier_index"]]))
                if named != set(own):
                    out.append(f"{br.service}: --tier-index {p['tier_index']} names {named}, "
                               f"its pair is reached at {own}")
            maps[br.service] = _map_claim(mine, br.service, p["tier_map_file"])
    if len(lists) != 1:
        out.append(f"the brokers name different tiers: {sorted(lists)}")
    if sorted(indexes) != list(range(len(MEMBERS))) or any(len(s) != 2
                                                          for s in indexes.values()):
        out.append(f"tier indexes {indexes}: want each member's pair at its own index")
    for svc, claim in maps.items():
        if claim is None:
            out.append(f"{svc}: --tier-map is not on a PersistentVolumeClaim")
    claims = [c for c in maps.values() if c is not None]
    if len(set(claims)) != len(claims):
        out.append(f"brokers share a map claim: {maps}")
    return out


def _map_claim(objs: dict, service: str, path: str | None) -> str | None:
    """The claim the broker's ``--tier-map`` file lives on (None: none, or not a claim)."""
    if not path:
        return None
    spec = deploy._pod(objs[("Deployment", service)])["spec"]
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    for m in spec["containers"][0].get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            claim = vols.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
            return claim if ("PersistentVolumeClaim", claim) in objs else None
    return None


@pytest.fixture(scope="module")
def tier():
    return render()


def test_the_tier_renders_two_members_that_hold_together(tier, tmp_path):
    assert check_tier(tier, tmp_path) == []
    brokers = [o for (k, n), o in tier.items() if k == "Deployment"]
    assert len(brokers) == 4
    for d in brokers:    # one broker of the tier per node, where the nodes allow
        terms = deploy._pod(d)["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        (expr,) = terms[0]["podAffinityTerm"]["labelSelector"]["matchExpressions"]
        assert set(expr["values"]) == {n for m in MEMBERS for n in m[:2]}


def test_member_1_is_member_0_under_other_names(tier):
    """Apart from names, its index and where it keeps the map, member 1 is member 0."""
    renames = dict(zip(MEMBERS[0], MEMBERS[1]))

    def plain(obj: dict, names: dict) -> dict:
        obj = copy.deepcopy(obj)
        if obj["kind"] in ("Deployment", "StatefulSet"):
            spec = deploy._pod(obj)["spec"]
            spec.pop("affinity", None)
            spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] != "tier-map"]
            for c in spec["containers"]:
                c["volumeMounts"] = [m for m in c.get("volumeMounts", [])
                                     if m["name"] != "tier-map"]
                args = c.get("args", [])
                for flag in ("--tier", "--tier-index", "--tier-map"):
                    while flag in args:
                        j = args.index(flag)
                        del args[j:j + 2]
        return _renamed(obj, names)

    compared = 0
    for (kind, name), obj in tier.items():
        if name in renames and kind in ("Service", "Deployment", "StatefulSet"):
            assert plain(obj, renames) == plain(tier[(kind, renames[name])], {}), (kind, name)
            compared += 1
    assert compared == 6


def _renamed(value, names: dict, key: str = ""):
    """``value`` with member 0's names as member 1's: whole values of names and labels, and
    the hosts of URLs (not the ``broker`` subcommand in args)."""
    if isinstance(value, dict):
        return {k: _renamed(v, names, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, names, key) for v in value]
    if not isinstance(value, str):
        return value
    if key in ("name", "app.kubernetes.io/component", "serviceName", "claimName", "values"):
        return names.get(value, value)
    return re.sub(r"(?<=tcp://)([\w-]+)(?=:)", lambda m: names.get(m[1], m[1]), value)


def _args(objs: dict, name: str) -> list:
    return deploy._pod(objs[("Deployment", name)])["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("breakage", ["order", "index", "own index", "shard member",
                                      "map on tmp", "shared claim", "one tier list short"])
def test_the_tier_check_catches_mismatches(tier, tmp_path, breakage):
    objs = copy.deepcopy(tier)
    if breakage == "order":            # member 1's brokers list the members the other way
        for n in MEMBERS[1][:2]:
            args = _args(objs, n)
            i, j = (k + 1 for k, a in enumerate(args) if a == "--tier")
            args[i], args[j] = args[j], args[i]
    elif breakage == "index":          # both pairs claim member 0
        for n in MEMBERS[1][:2]:
            args = _args(objs, n)
            args[args.index("--tier-index") + 1] = "0"
    elif breakage == "own index":      # one broker of a pair at the other member's index
        args = _args(objs, "broker-1-b")
        args[args.index("--tier-index") + 1] = "0"
    elif breakage == "shard member":   # member 1's shards register with member 0
        env = deploy._pod(objs[("StatefulSet", "m1-shard")])["spec"]["containers"][0]["env"]
        next(e for e in env if e["name"] == "GRADBUS_CLIENT_BROKER")["value"] = \
            "tcp://broker:5555,tcp://broker-b:5555"
    elif breakage == "map on tmp":     # the map kept where a restart loses it
        args = _args(objs, "broker-1")
        args[args.index("--tier-map") + 1] = "/tmp/tier-map.json"
    elif breakage == "shared claim":
        vols = deploy._pod(objs[("Deployment", "broker-b")])["spec"]["volumes"]
        next(v for v in vols if v["name"] == "tier-map")["persistentVolumeClaim"][
            "claimName"] = "broker-tier-map"
    else:
        args = _args(objs, "broker")
        j = args.index("--tier")
        del args[j:j + 2]
    assert check_tier(objs, tmp_path) != []
    assert check_tier(tier, tmp_path / "again") == []    # the fixture itself is untouched
