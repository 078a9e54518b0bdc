#!/usr/bin/env bash
# A real S3-compatible server for the shared-tier tests and benchmark:
# s3s-fs (crates.io), built once with `cargo install --locked` and cached under
# ~/.cache/lmcache-rc/ (a missing cache only costs time: a few minutes of
# compiling on 2 cores). Tests never mock the object store; they start this.
#
# Usage:
#   bash ci/s3-server.sh build
#       build (or reuse) the binary; prints its path on the last line.
#   bash ci/s3-server.sh start DATA_DIR [BUCKET...]
#       start a server on a free loopback port serving DATA_DIR (each BUCKET is
#       created as a directory; default: lmcache-rc-test), in the background.
#       Prints the endpoint (http://127.0.0.1:PORT) on the last line and writes
#       DATA_DIR/.server.pid, DATA_DIR/.server.endpoint and DATA_DIR/.server.log.
#   bash ci/s3-server.sh stop DATA_DIR
#       stop the server started on DATA_DIR (by its pid file).
#   bash ci/s3-server.sh env DATA_DIR
#       print the AWS_* variables a client needs for the server on DATA_DIR.
#
# start reads: LMCACHE_RC_S3_PORT (a fixed port instead of a free one, e.g. to
# restart a server where clients expect it), LMCACHE_RC_S3_OWNER_PID (stop the
# server once that process is gone: test helpers pass their own pid, so no
# server outlives its tests) and LMCACHE_RC_S3_CLEANUP=1 (then also delete
# DATA_DIR). LMCACHE_RC_S3_LOG sets the server's RUST_LOG (default s3s_fs=info).
#
# Credentials are fixed test values (the server only listens on 127.0.0.1):
#   AWS_ACCESS_KEY_ID=lmcache-rc-test AWS_SECRET_ACCESS_KEY=lmcache-rc-test-secret
#   AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true AWS_ENDPOINT_URL=<endpoint>
# LMCACHE_RC_S3S_ROOT overrides the cache location.
set -euo pipefail

S3S_VERSION=0.14.1 # the newest s3s-fs whose rust-version (1.92) our toolchain meets
ACCESS_KEY=lmcache-rc-test
SECRET_KEY=lmcache-rc-test-secret
CACHE="${LMCACHE_RC_S3S_ROOT:-$HOME/.cache/lmcache-rc/s3s-fs-$S3S_VERSION}"
BIN="$CACHE/bin/s3s-fs"

die() { echo "error: $*" >&2; exit 1; }

build() {
  if [ -x "$BIN" ]; then
    echo "$BIN"
    return
  fi
  command -v cargo >/dev/null || die "cargo not found; install Rust first"
  command -v flock >/dev/null || die "flock not found (util-linux)"
  mkdir -p "$CACHE"
  # One build at a time (tests start servers in parallel).
  exec 9>"$CACHE/.build.lock"
  flock 9
  if [ ! -x "$BIN" ]; then
    echo "== building s3s-fs $S3S_VERSION from crates.io into $CACHE (once; cached afterwards)" >&2
    local start=$SECONDS
    # A target dir inside the cache lets an interrupted build resume.
    CARGO_TARGET_DIR="$CACHE/target" cargo install --locked --quiet \
      --version "=$S3S_VERSION" --features binary --root "$CACHE" s3s-fs >&2
    rm -rf "$CACHE/target"
    echo "== s3s-fs built in $((SECONDS - start)) s" >&2
  fi
  flock -u 9
  [ -x "$BIN" ] || die "s3s-fs did not build"
  echo "$BIN"
}

start() {
  local data=${1:?usage: start DATA_DIR [BUCKET...]}
  shift
  local buckets=("$@")
  [ ${#buckets[@]} -gt 0 ] || buckets=(lmcache-rc-test)
  local bin
  bin=$(build | tail -n 1)
  mkdir -p "$data"
  data=$(cd "$data" && pwd)
  for b in "${buckets[@]}"; do mkdir -p "$data/$b"; done
  if [ -f "$data/.server.pid" ] && kill -0 "$(cat "$data/.server.pid")" 2>/dev/null; then
    die "a server already runs on $data (pid $(cat "$data/.server.pid"))"
  fi
  rm -f "$data/.server.endpoint"
  # Port 0: the kernel picks a free port; the server logs the address it bound.
  RUST_LOG="${LMCACHE_RC_S3_LOG:-s3s_fs=info}" NO_COLOR=1 setsid "$bin" --host 127.0.0.1 --port "${LMCACHE_RC_S3_PORT:-0}" \
    --access-key "$ACCESS_KEY" --secret-key "$SECRET_KEY" "$data" \
    >"$data/.server.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$data/.server.pid"
  local endpoint="" i
  for i in $(seq 1 200); do
    endpoint=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$data/.server.log" 2>/dev/null | head -n 1 || true)
    [ -n "$endpoint" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$data/.server.log" >&2; die "s3s-fs exited at start"; }
    sleep 0.05
  done
  [ -n "$endpoint" ] || { kill "$pid" 2>/dev/null || true; cat "$data/.server.log" >&2; die "s3s-fs did not report its address"; }
  echo "$endpoint" >"$data/.server.endpoint"
  local owner=${LMCACHE_RC_S3_OWNER_PID:-}
  if [ -n "$owner" ]; then
    # A watchdog, detached from our caller's pipes: ends with the server.
    local cleanup=${LMCACHE_RC_S3_CLEANUP:-0}
    setsid bash -c '
      owner=$1 pid=$2 data=$3 cleanup=$4
      while kill -0 "$owner" 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
      kill "$pid" 2>/dev/null; sleep 0.5; kill -9 "$pid" 2>/dev/null
      [ "$cleanup" = 1 ] && rm -rf "$data"
      exit 0' _ "$owner" "$pid" "$data" "$cleanup" >/dev/null 2>&1 </dev/null &
  fi
  echo "$endpoint"
}

stop() {
  local data=${1:?usage: stop DATA_DIR}
  [ -f "$data/.server.pid" ] || return 0
  local pid
  pid=$(cat "$data/.server.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$data/.server.pid"
}

env_vars() {
  local data=${1:?usage: env DATA_DIR}
  [ -f "$data/.server.endpoint" ] || die "no server started on $data"
  echo "export AWS_ENDPOINT_URL=$(cat "$data/.server.endpoint")"
  echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
  echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
  echo "export AWS_REGION=us-east-1"
  echo "export AWS_ALLOW_HTTP=true"
}

case "${1:-}" in
  build) build ;;
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  env) shift; env_vars "$@" ;;
  *) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
