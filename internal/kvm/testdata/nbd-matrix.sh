# The kernel NBD client against tiercache, in the guest (TestKernelNBD).
# /dev/vda is the cache device, /dev/vdb the backing device; tiercache
# serves on a unix socket and nbd-client connects over it. Every check
# prints one line "CHECK <name> ok <seconds>" or "CHECK <name> FAIL" (then the tail of
# its output); the Go test requires every expected name, ok.
set -u
export TIERCACHE_ADMIN=/run/admin.sock
TC=/host/tiercache
MNT=/mnt

say() { echo "+ $*"; }
# check NAME CMD...: runs CMD, prints its verdict and output, and then
# undoes what a failed CMD may have left (a mount, connections).
check() {
	name=$1; shift
	t0=$(cut -d' ' -f1 /proc/uptime)
	if "$@" >/tmp/check.out 2>&1; then
		echo "CHECK $name ok $(echo "$(cut -d' ' -f1 /proc/uptime) $t0" | awk '{printf "%.1fs", $1 - $2}')"
		grep -v '^ *$' /tmp/check.out | tail -6 | sed 's/^/  /'
	else
		echo "CHECK $name FAIL"
		tail -25 /tmp/check.out
	fi
	# Disconnect first: a request pending on a dead connection would hold
	# the umount forever (see restart_mounted).
	for d in nbd0 nbd1 nbd2; do [ "$(cat /sys/block/$d/size)" = 0 ] || nbd-client -d /dev/$d >/dev/null 2>&1; done
	umount $MNT 2>/dev/null
}

serve() {
	rm -f /run/tc.sock
	$TC serve --cache /dev/vda --listen unix:/run/tc.sock >>/tmp/tc.log 2>&1 &
	echo $! >/run/tc.pid
	for i in $(seq 1 60); do [ -S /run/tc.sock ] && [ -S /run/admin.sock ] && return 0; sleep 0.5; done
	echo "tiercache did not start"; cat /tmp/tc.log; return 1
}
stop() { kill -TERM $(cat /run/tc.pid); wait $(cat /run/tc.pid); }
kill9() { kill -9 $(cat /run/tc.pid); wait $(cat /run/tc.pid) 2>/dev/null; rm -f /run/tc.sock /run/admin.sock; }
connect() { # DEV BLOCKSIZE CONNECTIONS [extra nbd-client flags]
	dev=$1 bs=$2 c=$3; shift 3
	nbd-client -unix /run/tc.sock /dev/$dev -N disk -b $bs -C $c "$@" >/dev/null || return 1
	[ "$(cat /sys/block/$dev/queue/logical_block_size)" = $bs ] || { echo "logical block size $(cat /sys/block/$dev/queue/logical_block_size), want $bs"; return 1; }
}
disconnect() { nbd-client -d /dev/$1 >/dev/null; }
counter() { # NAME: the export's counter from tiercache stats --json (TrimOps or trim_ops)
	want=$(echo "$1" | tr -d _ | tr A-Z a-z)
	$TC stats --json | tr -d ' ,"_' | tr A-Z a-z | grep "^$want:" | head -1 | cut -d: -f2
}
fio_verify() { # FILE SIZE [extra fio flags]
	f=$1 size=$2; shift 2
	fio --name=verify --filename=$f --size=$size --rw=randwrite --bs=4k --ioengine=libaio --iodepth=8 \
		--direct=1 --verify=crc32c --verify_fatal=1 --do_verify=1 --randrepeat=0 --output-format=terse "$@" >/tmp/fio.out 2>&1 \
		|| { cat /tmp/fio.out; return 1; }
}
dsync_write() { # FILE DEV OFFSET: O_DIRECT writes with RWF_DSYNC (FUA)
	xfs_io -d -c "pwrite -q -D -b 1m -i $1 $3 $(stat -c %s $1)" $2
}
fsck_clean() { # FS DEV
	case $1 in
	ext4) e2fsck -f -n $2 ;;
	xfs) xfs_repair -n $2 ;;
	esac
}

$TC format --cache /dev/vda --backing disk=/dev/vdb --bucket-size 256K >/dev/null 2>&1 || { echo "format failed"; exit 1; }
serve || exit 1

# The matrix: 1 and 4 connections x block sizes 512 and 4096, each with raw
# fio verify, then a file system (ext4 and xfs alternating so each meets
# each connection count and block size): mkfs, mount, fio verify with
# fsync, fstrim, umount, fsck, remount, verify again.
fs_round() {
	c=$1 bs=$2 fs=$3
	connect nbd0 $bs $c || return 1
	fio_verify /dev/nbd0 2M --offset=400M || return 1
	case $fs in
	ext4) mkfs.ext4 -q -F -b 4096 /dev/nbd0 || return 1 ;;
	xfs) mkfs.xfs -q -f /dev/nbd0 || return 1 ;;
	esac
	mount -t $fs /dev/nbd0 $MNT || return 1
	fio_verify $MNT/f 2M --fsync=16 || return 1
	dd if=/dev/urandom of=$MNT/junk bs=1M count=4 2>/dev/null && rm $MNT/junk && sync
	trims=$(counter trim_ops)
	fstrim -v $MNT || return 1
	[ "$(counter trim_ops)" -gt "$trims" ] || { echo "fstrim sent no TRIM to tiercache"; return 1; }
	umount $MNT || return 1
	fsck_clean $fs /dev/nbd0 || return 1
	mount -t $fs /dev/nbd0 $MNT || return 1
	fio_verify $MNT/f 2M --verify_only || return 1
	umount $MNT || return 1
	disconnect nbd0
}
check c1-bs512-ext4 fs_round 1 512 ext4
check c1-bs4096-xfs fs_round 1 4096 xfs
check c4-bs512-xfs fs_round 4 512 xfs
check c4-bs4096-ext4 fs_round 4 4096 ext4

# A sequential stream through the kernel client with 4 connections is still
# a stream when it arrives over several of them, interleaved with other
# writes. ext4 on /dev/nbd0; the cache holds dirty data from 512 4 KiB random
# overwrites with an fsync every 32 (background writeback held, so it stays
# dirty); then two fio writers, one pinned to each CPU, write one 64 MiB
# file in alternate 1 MiB pieces (O_DIRECT, QD4 each, into unwritten
# extents, so ext4's journal writes interleave). blk-mq has one hardware
# queue per connection but no more than there are CPUs (2 here), and a
# request goes to its submitting CPU's queue: the two writers' requests
# arrive over two connections, slightly reordered against each other.
# The kernel's block tracepoint counts each CPU's data requests (>= 64 KiB)
# to nbd0, so the check sees that both queues carried the file. The cache's
# room for streams is at most writeback_percent (10 %: 6.4 MiB of this
# 64 MiB cache) less its dirty data, and a stream's first
# sequential_cutoff (4 MiB) may go to the cache: at least 40 MiB of the
# file must bypass it. (A buffered dd of the file is submitted by one
# flusher on one CPU, one connection: TestKernelSequentialBypass covers
# that path over loop.)
T=/sys/kernel/tracing
issued_per_cpu() { # CPU: data write requests issued to nbd0 on CPU since the trace was cleared
	grep -v '^#' $T/per_cpu/cpu$1/trace | grep -c 'block_rq_issue: 43,0 W'
}
seq_stream() {
	connect nbd0 4096 4 || return 1
	for q in 0 1; do [ "$(cat /sys/block/nbd0/mq/$q/cpu_list)" = $q ] || { echo "queue $q serves CPUs $(cat /sys/block/nbd0/mq/$q/cpu_list), want $q"; return 1; }; done
	[ -d $T/events ] || mount -t tracefs tracefs $T || return 1
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/nbd0 && mount -t ext4 -o noatime /dev/nbd0 $MNT || return 1
	$TC set disk writeback_rate_max=1 >/dev/null || return 1
	fio --name=history --filename=$MNT/history --ioengine=psync --direct=1 --rw=randwrite --bs=4k --size=2m \
		--fsync=32 --randseed=14 --output-format=terse >/tmp/fio.out 2>&1 || { cat /tmp/fio.out; return 1; }
	dirty=$(counter dirty_blocks) b=$(counter bypass_sequential_bytes)
	echo "dev == $((43 << 20)) && nr_sector >= 128" >$T/events/block/block_rq_issue/filter || return 1
	echo 1 >$T/events/block/block_rq_issue/enable && echo >$T/trace && echo 1 >$T/tracing_on || return 1
	fio --filename=$MNT/stream --ioengine=libaio --direct=1 --bs=1M --iodepth=4 --rw=write:1M --output-format=terse \
		--io_size=32M --name=even --cpus_allowed=0 --size=64M --name=odd --cpus_allowed=1 --offset=1M --size=63M >/tmp/fio.out 2>&1; r=$?
	echo 0 >$T/tracing_on; echo 0 >$T/events/block/block_rq_issue/enable
	[ $r = 0 ] || { cat /tmp/fio.out; return 1; }
	q0=$(issued_per_cpu 0) q1=$(issued_per_cpu 1)
	mib=$((($(counter bypass_sequential_bytes) - b) >> 20))
	echo "64 MiB file from two writers: $mib MiB bypassed as sequential, $dirty dirty blocks before; data requests over queue 0: $q0, queue 1: $q1"
	umount $MNT || return 1
	[ "$dirty" -ge 448 ] || { echo "want at least 448 dirty blocks (most of the 512 overwritten) before the file"; return 1; }
	[ $q0 -ge 100 ] && [ $q1 -ge 100 ] || { echo "want at least 100 of the file's requests over each queue (connection)"; return 1; }
	[ $mib -ge 40 ] || { echo "want at least 40 MiB bypassed"; return 1; }
	disconnect nbd0
}
seq_bypass() { seq_stream; r=$?; $TC set disk writeback_rate_max=0 >/dev/null; return $r; }
check c4-seq-bypass seq_bypass

dd if=/dev/zero of=/tmp/zero1m bs=1M count=1 2>/dev/null
is_zero() { # DEV OFFSET_MIB
	dd if=$1 bs=1M skip=$2 count=1 iflag=direct 2>/dev/null | cmp - /tmp/zero1m
}
fill() { dd if=/dev/urandom of=$1 bs=1M seek=$2 count=1 oflag=direct 2>/dev/null; }

# blkdiscard sends TRIM; blkdiscard -z (BLKZEROOUT) and fallocate -z
# (FALLOC_FL_ZERO_RANGE) must leave zeroes, whether the kernel sends
# WRITE_ZEROES or writes zeroes itself.
discard() {
	connect nbd0 4096 4 || return 1
	trims=$(counter trim_ops)
	blkdiscard -o 300M -l 8M /dev/nbd0 || return 1
	[ "$(counter trim_ops)" -gt "$trims" ] || { echo "no TRIM reached tiercache"; return 1; }
}
zeroout() {
	connect nbd0 4096 4 || return 1
	fill /dev/nbd0 310 && blkdiscard -z -o 310M -l 1M /dev/nbd0 && is_zero /dev/nbd0 310
}
fallocz() {
	connect nbd0 4096 4 || return 1
	fill /dev/nbd0 311 && fallocate -z -o 311M -l 1M /dev/nbd0 && is_zero /dev/nbd0 311
	echo "write_zeroes_max_bytes $(cat /sys/block/nbd0/queue/write_zeroes_max_bytes), zero_ops $(counter zero_ops)"
}
check blkdiscard discard
check blkdiscard-z zeroout
check fallocate-z fallocz

# FLUSH and FUA reach tiercache: fsync on the device, and O_DSYNC writes
# (the kernel sends FUA when the device advertises it, else write+FLUSH).
flushes() {
	connect nbd0 4096 4 || return 1
	n=$(counter flush_ops)
	fio_verify /dev/nbd0 1M --offset=320M --fsync=4 || return 1
	[ "$(counter flush_ops)" -gt "$n" ] || { echo "fsync sent no FLUSH"; return 1; }
}
dsync() {
	connect nbd0 4096 4 || return 1
	n=$(counter flush_ops) w=$(counter write_ops)
	fio_verify /dev/nbd0 1M --offset=330M --sync=dsync || return 1
	echo "fua queue flag $(cat /sys/block/nbd0/queue/fua); writes +$(($(counter write_ops) - w)), flushes +$(($(counter flush_ops) - n))"
	[ "$(counter write_ops)" -ge $((w + 256)) ] || return 1
}
check fsync-flush flushes
check o_dsync-fua dsync

# Writes acknowledged with O_DSYNC and with fsync survive a SIGKILL of
# tiercache and its recovery (read back on a new connection).
durable() {
	connect nbd0 4096 4 || return 1
	dd if=/dev/urandom of=/tmp/d1 bs=1M count=2 2>/dev/null
	dsync_write /tmp/d1 /dev/nbd0 340m || return 1
	dd if=/dev/urandom of=/tmp/d2 bs=1M count=2 2>/dev/null
	dd if=/tmp/d2 of=/dev/nbd0 bs=1M seek=342 oflag=direct 2>/dev/null && xfs_io -c fsync /dev/nbd0 || return 1
	kill9
	disconnect nbd0
	serve || return 1
	connect nbd0 4096 4 || return 1
	dd if=/dev/nbd0 bs=1M skip=340 count=2 iflag=direct 2>/dev/null | cmp - /tmp/d1 || return 1
	dd if=/dev/nbd0 bs=1M skip=342 count=2 iflag=direct 2>/dev/null | cmp - /tmp/d2
}
check kill9-flushed-kept durable

# nbd-client -d while fio writes: fio ends with an error instead of
# hanging, tiercache keeps serving, a new connection verifies, and the
# online check is clean.
inflight() {
	connect nbd0 4096 4 || return 1
	fio --name=busy --filename=/dev/nbd0 --size=64M --offset=100M --rw=randwrite --bs=4k --ioengine=libaio \
		--iodepth=16 --direct=1 --time_based --runtime=60 --output-format=terse >/tmp/busy.out 2>&1 &
	fpid=$!
	sleep 4
	disconnect nbd0
	for i in $(seq 1 40); do kill -0 $fpid 2>/dev/null || break; sleep 0.5; done
	if kill -0 $fpid 2>/dev/null; then echo "fio still running 20 s after the disconnect"; kill -9 $fpid; return 1; fi
	wait $fpid; echo "fio exit status after disconnect: $?"
	kill -0 $(cat /run/tc.pid) || { echo "tiercache died"; return 1; }
	connect nbd0 4096 4 && fio_verify /dev/nbd0 2M --offset=360M && $TC check
}
check disconnect-inflight inflight

# tiercache restarted (SIGKILL, then start) under a mounted ext4: what the
# kernel client does, and nothing flushed is lost: the file written and
# fsynced before the kill reads back, the file system fscks clean after its
# journal replay. A writer is busy at the kill, so requests are in flight:
# the kernel fails new I/O on the dead connection at once, but a request
# that was in flight stays pending (no -t timeout) until nbd-client -d
# clears the queue, so the device is disconnected before the umount, which
# would otherwise wait for it forever.
restart_mounted() {
	connect nbd1 4096 1 || return 1
	mkfs.ext4 -q -F /dev/nbd1 && mount -t ext4 /dev/nbd1 $MNT || return 1
	dd if=/dev/urandom of=$MNT/kept bs=1M count=3 conv=fsync 2>/dev/null || return 1
	sum=$(md5sum <$MNT/kept)
	dd if=/dev/zero of=$MNT/busy bs=64k count=2000 oflag=direct 2>/dev/null &
	bpid=$!
	sleep 1
	kill9
	serve || return 1
	echo 3 >/proc/sys/vm/drop_caches
	if md5sum <$MNT/kept >/dev/null 2>&1; then echo "read after restart on the old connection: ok"; else echo "read after restart on the old connection: I/O error"; fi
	disconnect nbd1
	if wait $bpid; then echo "writer busy at the kill: finished"; else echo "writer busy at the kill: I/O error"; fi
	umount $MNT || umount -l $MNT
	connect nbd1 4096 1 || return 1
	mount -t ext4 /dev/nbd1 $MNT || return 1
	[ "$(md5sum <$MNT/kept)" = "$sum" ] || { echo "fsynced file changed across the restart"; return 1; }
	umount $MNT && e2fsck -f -n /dev/nbd1 && disconnect nbd1
}
check restart-under-mounted-fs restart_mounted

# A server slower than the client's timeout (-t 5; tiercache stopped for
# 10 s): what the kernel does with the late request, and that the data
# flushed before is intact after a new connection.
slow() {
	connect nbd2 4096 1 -t 5 || return 1
	dd if=/dev/urandom of=/tmp/s1 bs=1M count=1 2>/dev/null
	dsync_write /tmp/s1 /dev/nbd2 370m || return 1
	kill -STOP $(cat /run/tc.pid)
	if dd if=/dev/urandom of=/dev/nbd2 bs=4k count=4 seek=95000 oflag=direct 2>/dev/null; then r=ok; else r="I/O error"; fi
	kill -CONT $(cat /run/tc.pid)
	echo "write while the server was stopped past the timeout: $r"
	dmesg | grep 'nbd2' | tail -4
	disconnect nbd2
	kill -0 $(cat /run/tc.pid) || { echo "tiercache died"; return 1; }
	connect nbd2 4096 1 || return 1
	dd if=/dev/nbd2 bs=1M skip=370 count=1 iflag=direct 2>/dev/null | cmp - /tmp/s1 && disconnect nbd2
}
check slower-than-timeout slow

check online-check $TC check
check clean-stop stop
check offline-check $TC check --cache /dev/vda
echo "tiercache log:"; grep -v 'level=INFO' /tmp/tc.log | tail -20
