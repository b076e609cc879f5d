#!/usr/bin/env bash
# The whole suite as on a fresh machine: a clean clone of this checkout's HEAD, run by CI's own
# command (.ci/run), with every cache moved aside: new, empty folders for the project's cache
# (OUTBOX_CACHE_DIR: Kafka's jars, Spark's connector, the Node and JDBC clients), pip's, npm's,
# Maven's and Go's, and a new .venv and .local in the clone. Debian's packages stay installed
# (they are the machine's, not a cache).
#
#   bash deploy/local/test_cold.sh [RUNS]   # RUNS (default 1) runs in a row on the same clone and
#                                           # caches: the second shows the warm time
#   OUTBOX_COLD_DIR=/somewhere              # where the clone and caches go (default: a new temp
#                                           # folder, removed after a run that passed)
#
# The clone starts its own services on the default ports, so this stops this checkout's first
# (and refuses to run while anything else listens there); it stops the clone's when it ends.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
runs=${1:-1}
if ! [[ "$runs" =~ ^[1-9][0-9]*$ ]]; then
  echo "test-cold: RUNS must be a positive whole number, got '$runs'" >&2
  exit 2
fi
keep=${OUTBOX_COLD_DIR:+yes}
work=${OUTBOX_COLD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/outbox-cold.XXXXXX")}
mkdir -p "$work"

# Nothing of this environment may point the clone at warm caches or at other services.
unset OUTBOX_KAFKA_LIB_CACHE OUTBOX_SPARK_JARS_CACHE OUTBOX_NODE_CLIENT_CACHE OUTBOX_JDBC_CLIENT_CACHE \
  OUTBOX_LOCAL_DIR \
  OUTBOX_TEST_DSN KAFKA_BOOTSTRAP PGBOUNCER_DSN OUTBOX_SPARK_MASTER OUTBOX_SPARK_HOME VIRTUAL_ENV

python3 "$repo/deploy/local/services.py" down >/dev/null || true
python3 "$repo/deploy/local/services.py" cluster down >/dev/null || true
for port in 55432 56432 59092 59093 57077 58080 25401 25402 25411 25412 25413; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "test-cold: port $port is in use (services of another checkout?): stop them first" >&2
    echo "  (python3 <that checkout>/deploy/local/services.py down)" >&2
    exit 2
  fi
done

rm -rf "$work/outbox-reaper"
git clone -q "$repo" "$work/outbox-reaper"
if [ -d "$repo/../shared" ]; then # CI lays the design of record beside the clone
  ln -sfn "$(cd "$repo/../shared" && pwd)" "$work/shared"
fi
export OUTBOX_CACHE_DIR="$work/cache/outbox-reaper"
export PIP_CACHE_DIR="$work/cache/pip"
export npm_config_cache="$work/cache/npm"
export MAVEN_OPTS="${MAVEN_OPTS:-} -Dmaven.repo.local=$work/cache/m2"
export GOMODCACHE="$work/cache/go-mod" GOCACHE="$work/cache/go-build"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw" # a module cache that rm -rf can remove
echo "test-cold: clone and caches in $work"

cleanup() {
  python3 "$work/outbox-reaper/deploy/local/services.py" down >/dev/null 2>&1 || true
  python3 "$work/outbox-reaper/deploy/local/services.py" cluster down >/dev/null 2>&1 || true
}
trap cleanup EXIT

status=0
cd "$work/outbox-reaper"
for run in $(seq 1 "$runs"); do
  started=$(date +%s)
  if bash .ci/run; then result=passed; else result="failed (exit $?)" status=1; fi
  echo "test-cold: run $run of $runs $result in $(($(date +%s) - started)) s"
  [ "$status" = 0 ] || break
done
cleanup
if [ "$status" = 0 ] && [ -z "$keep" ]; then
  cd / && rm -rf "$work"
fi
exit "$status"
