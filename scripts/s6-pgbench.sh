#!/usr/bin/env bash
# S6's pgbench run by hand, target after target, for alternated comparisons
# that `tcbench cache --only S6` cannot make (it runs each cache mode once,
# plus db_bench): e.g. the plain HDD model against tiercache's none mode, or
# one mode with two tiercache binaries. Each run is S6's set-up (bench/
# cache_apps.go, s6Mode): a copy of the golden image (ext4 2 GiB with a
# pgbench scale-10 cluster) on an 8 GiB HDD-model disk, served over NBD,
# nbdfuse, losetup --direct-io=on, ext4; the database read once, then
# `pgbench -c 10 -j 2 -T 30` with track_wal_io_timing so that pg_stat_wal
# gives the WAL fdatasyncs and their mean time.
#
# Usage (root; postgresql, libnbd-bin, fuse3, jq installed):
#   scripts/s6-pgbench.sh WORKDIR LABEL=BIN:TARGET [LABEL=BIN:TARGET ...]
# TARGET: plain (tiercache serving the HDD model, no cache set) or a cache
# mode (none, writethrough, writearound, writeback) with a 1 GiB SATA SSD
# model cache. WORKDIR keeps the golden image between calls (built on first
# use); each run's files are removed after it. PGTIME (30) sets pgbench -T;
# KEEPSTATS=DIR keeps `tiercache stats --json` from before and after each
# run. One line per run on stdout:
#   LABEL TARGET tps=.. wal_syncs=.. wal_sync_ms=.. flushes=.. commits=.. load=..
set -euo pipefail

PGTIME=${PGTIME:-30}
work=$1
shift
pgbin=$(dirname "$(command -v pg_ctl || ls /usr/lib/postgresql/*/bin/pg_ctl | tail -1)")
mkdir -p "$work"
chmod 755 "$work"

cleanup_cmds=()
cleanup() {
	for ((i = ${#cleanup_cmds[@]} - 1; i >= 0; i--)); do
		eval "${cleanup_cmds[i]}" >/dev/null 2>&1 || true
	done
	cleanup_cmds=()
}
trap cleanup EXIT

pg() { runuser -u postgres -- "$pgbin/pg_ctl" -D "$1/pg" -w "${@:2}"; }
# retry CMD...: up to 5 s, for unmounts that find the device still busy
# for a moment (the loop device holds the FUSE file until it is detached).
retry() { for _ in $(seq 50); do "$@" && return 0; sleep 0.1; done; return 1; }
pgstart() { # mnt sockdir
	pg "$1" -l "$2/postgres.log" -o "-k $2 -c listen_addresses='' -c track_wal_io_timing=on" start >/dev/null
}

golden=$work/golden.img
if [[ ! -f $golden ]]; then
	g=$work/golden
	mkdir -p "$g/mnt" "$g/sock"
	truncate -s 2G "$golden.tmp"
	loop=$(losetup --find --show --sizelimit 2147483648 "$golden.tmp")
	cleanup_cmds+=("losetup -d $loop")
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$loop"
	mount -t ext4 -o noatime "$loop" "$g/mnt"
	cleanup_cmds+=("umount -l $g/mnt")
	mkdir -p "$g/mnt/pg"
	chown postgres: "$g/mnt/pg" "$g/sock"
	chmod 755 "$g" "$g/mnt"
	runuser -u postgres -- "$pgbin/initdb" -D "$g/mnt/pg" -A trust -U postgres --no-sync >/dev/null
	pgstart "$g/mnt" "$g/sock"
	pgbench -h "$g/sock" -U postgres -i -q -s 10 postgres >/dev/null 2>&1
	pg "$g/mnt" -m fast stop >/dev/null
	cleanup
	mv "$golden.tmp" "$golden"
fi

n=0
for spec in "$@"; do
	n=$((n + 1))
	label=${spec%%=*}
	rest=${spec#*=}
	bin=${rest%:*}
	target=${rest##*:}
	d=$work/run$n-$label
	rm -rf "$d"
	mkdir -p "$d/fuse" "$d/mnt" "$d/sock"
	chmod 755 "$d"
	cp --sparse=always "$golden" "$d/hdd.img"
	truncate -s 8G "$d/hdd.img"
	if [[ $target == plain ]]; then
		serve=("$bin" serve --export "vol=hdd:$d/hdd.img" --listen "unix:$d/nbd.sock" --data-dir "$d" --direct off)
	else
		truncate -s 1G "$d/cache.img"
		"$bin" format --cache "ssd:$d/cache.img" --backing "vol=hdd:$d/hdd.img" --mode "$target" --direct off --data-dir "$d" >/dev/null
		serve=("$bin" serve --cache "ssd:$d/cache.img" --listen "unix:$d/nbd.sock" --data-dir "$d" --direct off)
	fi
	"${serve[@]}" >"$d/serve.log" 2>&1 &
	srv=$!
	cleanup_cmds+=("rm -rf $d" "kill $srv; wait $srv")
	for _ in $(seq 200); do [[ -S $d/nbd.sock ]] && break; sleep 0.05; done
	nbdfuse -P "$d/nbdfuse.pid" "$d/fuse/disk" "nbd+unix:///vol?socket=$d/nbd.sock" >"$d/nbdfuse.log" 2>&1 &
	cleanup_cmds+=("retry fusermount3 -u $d/fuse || fusermount3 -uz $d/fuse")
	for _ in $(seq 400); do [[ -f $d/nbdfuse.pid ]] && break; sleep 0.05; done
	loop=$(losetup --find --show --sizelimit 2147483648 --direct-io=on "$d/fuse/disk")
	cleanup_cmds+=("losetup -d $loop")
	mount -t ext4 -o noatime "$loop" "$d/mnt"
	cleanup_cmds+=("retry umount $d/mnt || umount -l $d/mnt")
	chown postgres: "$d/sock"
	chmod 755 "$d/mnt"
	pgstart "$d/mnt" "$d/sock"
	cleanup_cmds+=("pg $d/mnt -m immediate stop")
	# The database in the page cache (S6's catTree: everything but pg_wal).
	find "$d/mnt/pg" -path "$d/mnt/pg/pg_wal" -prune -o -type f -exec cat {} + >/dev/null
	"$bin" --data-dir "$d" flush vol >/dev/null 2>&1 || true
	psql -h "$d/sock" -U postgres -qAt -c "select pg_stat_reset_shared('wal')" postgres >/dev/null
	st0=$("$bin" --data-dir "$d" stats --json)
	load=$(cut -d' ' -f1 /proc/loadavg)
	out=$(pgbench -h "$d/sock" -U postgres -c 10 -j 2 -T "$PGTIME" postgres 2>&1)
	st1=$("$bin" --data-dir "$d" stats --json)
	if [[ -n ${KEEPSTATS:-} ]]; then # the raw counters before and after
		mkdir -p "$KEEPSTATS"
		printf '%s\n' "$st0" >"$KEEPSTATS/run$n-$label.before.json"
		printf '%s\n' "$st1" >"$KEEPSTATS/run$n-$label.after.json"
	fi
	wal=$(psql -h "$d/sock" -U postgres -qAt -c "select wal_sync, round((wal_sync_time / greatest(wal_sync, 1))::numeric, 2) from pg_stat_wal" postgres)
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' <<<"$out")
	d0=$(jq -r '[([.exports[]? | select(.name == "vol") | .volume.FlushOps][0] // 0), (.set.Commits? // 0)] | @tsv' <<<"$st0")
	d1=$(jq -r '[([.exports[]? | select(.name == "vol") | .volume.FlushOps][0] // 0), (.set.Commits? // 0)] | @tsv' <<<"$st1")
	read -r f0 c0 <<<"$d0"
	read -r f1 c1 <<<"$d1"
	echo "$label $target tps=$tps wal_syncs=${wal%|*} wal_sync_ms=${wal#*|} flushes=$((f1 - f0)) commits=$((c1 - c0)) load=$load"
	cleanup
done
