# cachesys.sh up SYSTEM LOWER [format] | down SYSTEM
# Assembles bcache or dm-cache (both writeback) on the data device LOWER,
# laid out as three dm-linear slices: metadata (8 MiB, dm-cache only),
# cache (32 MiB), backing (81 MiB); on top of the cached device two more
# slices, SYSTEM-disk (16 MiB, the stamped blocks) and SYSTEM-fs (64 MiB,
# ext4). "format" makes the cache first (make-bcache; dm-cache formats a
# zeroed metadata device itself). No udev in the guest: dmsetup mknodes
# makes the /dev/mapper nodes; the kernel's devtmpfs makes /dev/bcacheN.
set -u
M=$((8*2048)) C=$((32*2048)) B=$((81*2048)) D=$((16*2048)) F=$((64*2048))
dmc() { dmsetup create "$@" >/dev/null && dmsetup mknodes "$1"; }
bcache_dev() { for d in /sys/block/bcache*; do [ -e $d/bcache/cache_mode ] && basename $d && return 0; done; return 1; }
up() {
	sys=$1 low=$2 fmt=${3:-}
	dmc $sys-meta --table "0 $M linear $low 0" && dmc $sys-cdev --table "0 $C linear $low $M" &&
		dmc $sys-back --table "0 $B linear $low $((M+C))" || return 1
	case $sys in
	bcache)
		if [ "$fmt" = format ]; then
			make-bcache -C /dev/mapper/$sys-cdev -B /dev/mapper/$sys-back -b 16k --writeback >/tmp/mkb.out 2>&1 || { cat /tmp/mkb.out; return 1; }
		fi
		echo /dev/mapper/$sys-cdev >/sys/fs/bcache/register || { echo "bcache: registering the cache device failed"; return 1; }
		echo /dev/mapper/$sys-back >/sys/fs/bcache/register || { echo "bcache: registering the backing device failed"; return 1; }
		for i in $(seq 1 100); do bcache_dev >/dev/null && break; sleep 0.1; done
		b=$(bcache_dev) || { echo "bcache: no bcache device"; return 1; }
		[ -e /sys/block/$b/bcache/cache ] || { echo "bcache: $b has no cache attached"; cat /sys/block/$b/bcache/state; return 1; }
		echo writeback >/sys/block/$b/bcache/cache_mode && echo 0 >/sys/block/$b/bcache/sequential_cutoff || return 1
		# No bypass of a slow (emulated) cache device.
		for u in /sys/fs/bcache/*-*; do echo 0 >$u/congested_read_threshold_us && echo 0 >$u/congested_write_threshold_us || return 1; done
		top=/dev/$b
		;;
	dmcache)
		dmc $sys-cached --table "0 $B cache /dev/mapper/$sys-meta /dev/mapper/$sys-cdev /dev/mapper/$sys-back 128 1 writeback smq 0" || return 1
		top=/dev/mapper/$sys-cached
		;;
	esac
	dmc $sys-disk --table "0 $D linear $top 0" && dmc $sys-fs --table "0 $F linear $top $D"
}
down() {
	sys=$1
	for d in $sys-fs $sys-disk; do dmsetup remove $d 2>/dev/null; done
	case $sys in
	bcache)
		b=$(bcache_dev) && echo 1 >/sys/block/$b/bcache/stop
		for u in /sys/fs/bcache/*-*; do [ -e $u/stop ] && echo 1 >$u/stop; done
		for i in $(seq 1 200); do
			[ -z "$(ls -d /sys/block/bcache* /sys/fs/bcache/*-* 2>/dev/null)" ] && break
			sleep 0.1
		done
		[ -z "$(ls -d /sys/block/bcache* /sys/fs/bcache/*-* 2>/dev/null)" ] || { echo "bcache did not stop"; return 1; }
		;;
	dmcache) dmsetup remove $sys-cached || return 1 ;;
	esac
	for d in $sys-back $sys-cdev $sys-meta; do dmsetup remove $d || return 1; done
}
"$@"
