#!/usr/bin/env bash
# Smoke test of the docker example, end to end: builds the image, brings up the compose stack
# (broker, 3 shards, 2 demo workers, CURVE on every connection; Prometheus, Alertmanager and
# Grafana, the monitoring profile, too when their images are present locally, else skipped with
# a note), waits for both workers to finish,
# checks `gradbus status` (every shard alive, pushes applied) and each worker's last line (the
# demo model's test accuracy at least MIN_ACCURACY), then tears everything down (containers,
# network, volumes, the key pairs it made) whether it passed or not. Exit status 0: it worked.
#
#   docker/smoke.sh                                        # from anywhere in the repository
#   PYTHON_IMAGE=IMAGE docker/smoke.sh                     # a local base image (no registry)
#   PAIR=1 docker/smoke.sh                                 # a broker pair (see below)
#   TIER=1 docker/smoke.sh                                 # a broker tier (see below)
#
# PAIR=1 lays docker/docker-compose.pair.yml over the stack (a standby broker, broker-b), and
# once the workers' pushes are being applied SIGKILLs the active broker's process (from the
# host: it needs the right to signal it, root or the docker host's user); the workers must
# still finish with the accuracy asked, the other broker must be active with a take-over
# counted, and every shard alive. Workers of a pair use TCP frames, so the shared-memory
# checks are left out there.
#
# TIER=1 lays docker/docker-compose.tier.yml over the stack (a second tier member, broker-1,
# with shards shard-3 and shard-4 in an IPC namespace of their own). The demo's tensors are
# all held by member 1; once its shards are applying the workers' pushes, `gradbus tier
# drain 1` (run in the broker's container) moves them to member 0 while the workers train:
# the workers must still finish with the accuracy asked, member 1 must hold nothing and
# member 0 every tensor, under a newer map.
#
# Settings (environment): PYTHON_IMAGE (the Dockerfile's build argument; default: the
# Dockerfile's own), COMPOSE (default: `docker compose` where it works, else `docker-compose`),
# MIN_ACCURACY (default 0.9), SMOKE_TIMEOUT (seconds for the workers, default 900), NO_BUILD=1
# (use the gradbus:local image as it is). It runs the stack from a copy of docker/ under a
# temporary folder, with key pairs of its own, as the compose project gradbus-smoke: it never
# touches docker/keys or a running `gradbus` project, but it publishes the same host ports
# (127.0.0.1:5555-5557, 9090, 9093, 3000), so those must be free.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
image=gradbus:local
project=gradbus-smoke
min_accuracy=${MIN_ACCURACY:-0.9}
timeout_s=${SMOKE_TIMEOUT:-900}
if [[ -n ${COMPOSE:-} ]]; then
  read -r -a compose <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  compose=(docker-compose)
fi

say() { printf 'smoke: %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }

work=$(mktemp -d)
export COMPOSE_PROFILES=monitoring   # its services start only when named below; down removes them
pair=${PAIR:-0}
tier=${TIER:-0}
[[ $pair == 1 && $tier == 1 ]] && { say "PAIR=1 and TIER=1 are two runs"; exit 2; }
files=(-f "$work/docker/docker-compose.yml")
[[ $pair == 1 ]] && files+=(-f "$work/docker/docker-compose.pair.yml")
[[ $tier == 1 ]] && files+=(-f "$work/docker/docker-compose.tier.yml")
dc() { "${compose[@]}" -p "$project" "${files[@]}" "$@"; }
cleanup() {
  local rc=$?
  trap - EXIT
  if ((rc != 0)) && [[ -f $work/docker/docker-compose.yml ]]; then
    say "logs of the stack (last 20 lines of each service):"
    dc logs --no-color --tail 20 2>&1 | sed 's/^/  /' || true
  fi
  say "tearing down (containers, network, volumes)"
  [[ -f $work/docker/docker-compose.yml ]] \
    && dc down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 || true
  rm -rf "$work"
  if ((rc == 0)); then say "PASS"; else say "exit $rc"; fi
  exit "$rc"
}
trap cleanup EXIT

# 1. the image
if [[ ${NO_BUILD:-0} != 1 ]]; then
  say "building $image${PYTHON_IMAGE:+ from $PYTHON_IMAGE} (docker build -f docker/Dockerfile)"
  t0=$SECONDS
  docker build -f "$root/docker/Dockerfile" ${PYTHON_IMAGE:+--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"} \
    -t "$image" "$root" >"$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log"; fail "docker build failed"; }
  say "built in $((SECONDS - t0)) s"
fi
docker image inspect "$image" >/dev/null 2>&1 || fail "no image $image"

# 2. the stack's files, with fresh key pairs (secret keys owned by the containers' uid 10001)
mkdir -p "$work/docker/keys"
cp -r "$here/docker-compose.yml" "$here/docker-compose.pair.yml" "$here/docker-compose.tier.yml" \
  "$here/gradbus.toml" \
  "$here/prometheus.yml" "$here/alerts.yml" "$here/alertmanager.yml" "$here/grafana" \
  "$work/docker/"
docker run --rm --user 0 --entrypoint sh -v "$work/docker/keys:/keys" "$image" -c \
  'gradbus keys generate /keys --name broker --role operator >/dev/null
   gradbus keys generate /keys --name shard --role shard >/dev/null
   gradbus keys generate /keys --name worker --role client >/dev/null
   chown 10001:10001 /keys/*.key_secret' || fail "could not make the key pairs"

services=(broker shard-0 shard-1 shard-2 worker-0 worker-1)
[[ $pair == 1 ]] && services=(broker broker-b shard-0 shard-1 shard-2 worker-0 worker-1)
[[ $tier == 1 ]] && services=(broker broker-1 shard-0 shard-1 shard-2 shard-3 shard-4 worker-0
                              worker-1)
for svc in prometheus alertmanager grafana; do
  img=$(grep -oE "image: *(prom/prometheus|prom/alertmanager|grafana/grafana):[^ ]+" "$here/docker-compose.yml" \
        | sed 's/image: *//' | grep -m1 "/$svc:" || true)
  if [[ -n $img ]] && docker image inspect "$img" >/dev/null 2>&1; then
    services+=("$svc")
  else
    say "note: image ${img:-of $svc} is not present locally; $svc skipped"
  fi
done

# 3. up: compose waits for the broker's and the shards' healthchecks before it starts workers
say "starting ${services[*]} with ${compose[*]}"
t0=$SECONDS
dc up -d --no-build "${services[@]}" >"$work/up.log" 2>&1 \
  || { tail -n 20 "$work/up.log"; fail "compose up failed"; }
say "up in $((SECONDS - t0)) s; waiting for the workers (up to $timeout_s s)"

cid() { dc ps -q "$1"; }
deadline=$((SECONDS + timeout_s))
asked=broker
if [[ $pair == 1 ]]; then
  # 3b. the active broker SIGKILLed once the workers' pushes are being applied
  asked=broker-b
  while :; do
    active=$(dc exec -T broker-b sh -c 'GRADBUS_CLIENT_BROKER=tcp://broker:5555,tcp://broker-b:5565 \
      gradbus status --json --timeout 5 2>/dev/null | python -c "
import json, sys
st = json.load(sys.stdin)
act = [b[\"url\"] for b in st.get(\"brokers\", []) if b[\"role\"] == \"active\"]
applied = int(st[\"counters\"].get(\"pushes_applied\", 0))
print((\"broker-b\" if act[0].endswith(\":5565\") else \"broker\") if len(act) == 1 and applied > 100 else \"\")
"' 2>/dev/null || true)
    [[ -n $active ]] && break
    ((SECONDS < deadline)) || fail "no active broker applying pushes within $timeout_s s"
    sleep 0.5
  done
  pid=$(docker inspect -f '{{.State.Pid}}' "$(cid "$active")")
  say "SIGKILL of the active broker, $active (pid $pid on the host)"
  kill -9 "$pid" || fail "could not SIGKILL $active's process"
  [[ $active == broker-b ]] && asked=broker
fi
if [[ $tier == 1 ]]; then
  # 3c. member 1 drained while the workers' pushes are being applied there
  while :; do
    applied=$(dc exec -T broker-1 sh -c 'gradbus status --json --timeout 5 2>/dev/null | python -c "
import json, sys
print(int(json.load(sys.stdin)[\"counters\"].get(\"pushes_applied\", 0)))
"' 2>/dev/null || echo 0)
    ((${applied:-0} > 100)) && break
    ((SECONDS < deadline)) || fail "member 1 applied no pushes within $timeout_s s"
    sleep 0.5
  done
  say "gradbus tier drain 1 (member 1 applied $applied pushes)"
  dc exec -T broker gradbus tier drain 1 --timeout 120 2>&1 | sed 's/^/  /' \
    || fail "gradbus tier drain 1 failed"
fi
for w in worker-0 worker-1; do
  while :; do
    id=$(cid "$w")
    state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$id" 2>/dev/null || echo "missing 0")
    [[ $state == "exited 0" ]] && break
    ((SECONDS < deadline)) || fail "$w did not finish within $timeout_s s (state: $state)"
    sleep 2
  done
done
say "workers done $((SECONDS - t0)) s after up"

# 4. gradbus status, asked in the broker's container with its keys
if [[ $pair == 1 ]]; then
  want=$([[ $active == broker ]] && echo 5565 || echo 5555)    # the one not killed
  dc exec -T -e WANT="$want" "$asked" sh -c 'GRADBUS_CLIENT_BROKER=tcp://broker:5555,tcp://broker-b:5565 \
    gradbus status --json --timeout 10 | python -c "
import os
import json, sys
st = json.load(sys.stdin)
alive = sorted(s[\"id\"] for s in st[\"shards\"] if s[\"alive\"])
roles = {b[\"url\"]: b[\"role\"] for b in st[\"brokers\"]}
applied = int(st[\"counters\"].get(\"pushes_applied\", 0))
print(\"  shards alive:\", \" \".join(alive), \" pushes applied:\", applied, \" brokers:\", roles,
      \" take-overs:\", st[\"pair\"][\"takeovers\"])
act = [u for u, r in roles.items() if r == \"active\"]
sys.exit(0 if len(alive) == 3 and applied > 0 and len(act) == 1
         and act[0].endswith(\":\" + os.environ[\"WANT\"]) else 1)
"' || fail "gradbus status: want 3 shards alive and the broker not killed active"
else
dc exec -T broker gradbus status --timeout 10 | sed 's/^/  /' || fail "gradbus status failed"
dc exec -T broker sh -c 'gradbus status --json --timeout 10 | python -c "
import json, sys
st = json.load(sys.stdin)
alive = sorted(s[\"id\"] for s in st[\"shards\"] if s[\"alive\"])
applied = int(st[\"counters\"].get(\"pushes_applied\", 0))
freed = int(st[\"counters\"].get(\"shm_freed\", 0))
shm = all(s[\"shm\"] for s in st[\"shards\"] if s[\"alive\"])
print(\"  shards alive:\", \" \".join(alive), \" pushes applied:\", applied,
      \" through shared memory:\", freed, \" shards on shared memory:\", shm)
sys.exit(0 if len(alive) == 3 and applied > 0 and freed > 0 and shm else 1)
"' || fail "gradbus status: want 3 shards alive, on shared memory, and pushes applied through it"
fi

if [[ $tier == 1 ]]; then
  dc exec -T broker sh -c 'gradbus tier map --json --timeout 10 | python -c "
import json, sys
tm = json.load(sys.stdin)
print(\"  tier map v%d, home partitions per member: %s\" % (tm[\"v\"], [tm[\"owners\"].count(i)
      for i in range(len(tm[\"members\"]))]))
sys.exit(0 if tm[\"v\"] >= 2 and 1 not in tm[\"owners\"] else 1)
"' || fail "gradbus tier map: want a newer map giving member 1 nothing"
  for m in broker broker-1; do
    dc exec -T "$m" sh -c 'gradbus status --json --timeout 10 | python -c "
import json, sys
st = json.load(sys.stdin)
c = st[\"counters\"]
print(\"  $m: errors\", st[\"errors\"], \" received\", c.get(\"pushes_received\"),
      \" applied\", c.get(\"pushes_applied\"), \" moved\", c.get(\"tier_moved\"))
"' || true
    dc exec -T -e WANT="$([[ $m == broker ]] && echo 4 || echo 0)" "$m" sh -c \
      'gradbus status --json --timeout 10 | python -c "
import json, os, sys
names = [t[\"name\"] for t in json.load(sys.stdin)[\"tensors\"]]
print(\"  holds:\", names)
sys.exit(0 if len(names) == int(os.environ[\"WANT\"]) else 1)
"' || fail "$m: want it to hold $([[ $m == broker ]] && echo 'the 4 demo tensors' || echo nothing)"
  done
fi

# 5. each worker's last line: a JSON summary with the demo model's test accuracy
for w in worker-0 worker-1; do
  last=$(docker logs "$(cid "$w")" 2>/dev/null | tail -n 1)
  say "$w: $last"
  docker run --rm --entrypoint python "$image" -c '
import json, sys
last, least = json.loads(sys.argv[1]), float(sys.argv[2])
sys.exit(0 if last.get("done") and last.get("test_accuracy", 0) >= least else 1)
' "$last" "$min_accuracy" || fail "$w: want a last line with test_accuracy >= $min_accuracy"
  acc=$(sed -n 's/.*"test_accuracy": \([0-9.]*\).*/\1/p' <<<"$last")
  say "$w: test accuracy $acc >= $min_accuracy"
done

if [[ $tier == 1 ]]; then
  # every push of both workers applied once, across the drain: each tensor's version (pushes
  # applied to it) equals the pushes the workers made
  total=0
  for w in worker-0 worker-1; do
    n=$(docker logs "$(cid "$w")" 2>/dev/null | tail -n 1 | sed -n 's/.*"pushes": \([0-9]*\).*/\1/p')
    total=$((total + ${n:-0}))
  done
  dc exec -T -e TOTAL="$total" broker sh -c 'gradbus status --json --timeout 10 | python -c "
import json, os, sys
vers = {t[\"name\"]: t[\"version\"] for t in json.load(sys.stdin)[\"tensors\"]}
print(\"  versions:\", vers, \" pushes made:\", os.environ[\"TOTAL\"])
sys.exit(0 if vers and set(vers.values()) == {int(os.environ[\"TOTAL\"])} else 1)
"' || fail "want every tensor's version equal to the pushes the workers made"
fi

# 6. the monitoring services, when they ran
for svc in "${services[@]}"; do
  case $svc in
    prometheus) url=http://127.0.0.1:9090/-/ready ;;
    alertmanager) url=http://127.0.0.1:9093/-/ready ;;
    grafana) url=http://127.0.0.1:3000/api/health ;;
    *) continue ;;
  esac
  docker run --rm --network "container:$(cid "$svc")" --entrypoint python "$image" -c '
import sys, time, urllib.request
deadline = time.monotonic() + 60
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(1)
' "$url" >/dev/null 2>&1 && say "$svc answers at $url" || fail "$svc does not answer at $url"
done
