#!/usr/bin/env bash
# Remote backing figures for docs/BENCHMARKS.md ("Remote backing device"):
# 4 KiB random I/O at queue depth 8 (fio's nbd engine, 10 s each) straight
# to an nbdkit file export on loopback TCP, and through a tiercache cache
# set whose backing device is that export (writeback, nbd://127.0.0.1):
# cache hits (a 32 MiB working set read once before), misses (reads spread
# over a 1 GiB export in front of a 64 MiB cache; promotions go on) and
# writes. Prints one line per case with IOPS and mean latency. Then the
# HDD-model remote (tcbench remote, bench/remote.go): random writes,
# drains of random dirty blocks against arrival order and sorted QD1, the
# same drain through nbdfuse, cold sequential reads; rounds and medians.
# Usage: scripts/bench-remote.sh [tiercache binary] (default bin/tiercache);
# REMOTEFLAGS passes flags to tcbench remote (-rounds, -cases, ...; -h).
set -euo pipefail
BIN=${1:-bin/tiercache}
RUNTIME=${RUNTIME:-10}
dir=$(mktemp -d /tmp/tcbr.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# A 1 GiB export holding data (not sparse), so that reads are real reads.
head -c $((1 << 30)) /dev/urandom > "$dir/remote.img"
nbdkit -f --exit-with-parent -i 127.0.0.1 -p "$port" --filter=exportname file "$dir/remote.img" exportdesc=fixed:bench-remote &
pids+=($!)
until nbdinfo --size "nbd://127.0.0.1:$port/" >/dev/null 2>&1; do sleep 0.1; done
remote="nbd://127.0.0.1:$port/"

fio1() { # NAME URI RW SIZE [extra fio args...]
	local name=$1 uri=$2 rw=$3 size=$4
	shift 4
	fio --name="$name" --ioengine=nbd --uri="$uri" --rw="$rw" --bs=4k --iodepth=8 --size="$size" \
		--time_based --runtime="$RUNTIME" --randrepeat=0 --output-format=json --output="$dir/$name.json" "$@"
	python3 - "$dir/$name.json" "$name" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
for k in ("read", "write"):
    if j[k]["io_bytes"] > 0:
        print(f"{sys.argv[2]:<28} {j[k]['iops']:>10.0f} IOPS  mean {j[k]['lat_ns']['mean']/1e3:>8.1f} µs")
PY
}

echo "case                               IOPS        latency"
fio1 direct-randread "$remote" randread 1g
fio1 direct-randwrite "$remote" randwrite 1g

truncate -s 64M "$dir/cache.img"
"$BIN" format --cache "$dir/cache.img" --backing vm="$remote" --mode writeback --bucket-size 1M >/dev/null 2>&1
"$BIN" --data-dir "$dir/d" serve --cache "$dir/cache.img" --listen "unix:$dir/tc.sock" >"$dir/serve.log" 2>&1 &
pids+=($!)
until nbdinfo --size "nbd+unix:///vm?socket=$dir/tc.sock" >/dev/null 2>&1; do sleep 0.1; done
tc="nbd+unix:///vm?socket=$dir/tc.sock"
fio1 cache-miss-randread "$tc" randread 1g
# Warm a 32 MiB working set, then read it: hits.
fio --name=warm --ioengine=nbd --uri="$tc" --rw=read --bs=64k --iodepth=4 --size=32m --output=/dev/null
fio1 cache-hit-randread "$tc" randread 32m
fio1 cache-writeback-randwrite "$tc" randwrite 32m
"$BIN" --data-dir "$dir/d" stats | grep -E "read_hit_ops|read_miss_ops|remote_link" || true

echo
echo "HDD model as the remote (go run ./cmd/tcbench remote)"
go run ./cmd/tcbench remote -tiercache "$BIN" ${REMOTEFLAGS:-}
