# kvm-bench's guest script: bcache (writeback), dm-cache (smq, writeback)
# and tiercache (writeback, served in the guest to the kernel NBD client
# with 2 connections) on the same disks, one after the other: /dev/vda the
# SSD, /dev/vdb the HDD (throttled by qemu). dm-cache keeps its metadata in
# the SSD's first 64 MiB and caches in 32 KiB blocks (its smallest). Each system: a sequential fill of the region (so
# that it is cached), 4 KiB random reads (cache hits) and then 4 KiB random
# writes at QD16, then a file-system job: ext4 (1 GiB of the device) and
# fio 4 KiB random writes with an fsync after each, QD1, into a 64 MiB
# file; fio's JSON goes to /host/SYSTEM-JOB-ROUND.json. The guest's clock
# source is printed first (kvm-bench boots it with tsc=reliable).
set -u
TC=/host/tiercache
REGION=@REGION@
# The requests the SSD, the HDD and the system's own device (DEV)
# completed during a fio run, its ramp included: /host/devstat.txt, one
# "NAME DEV VDA VDB" line a job, each device as READS WRITES FLUSHES
# (/sys/block/X/stat fields 1, 5 and 16).
devstat() { awk '{printf " %d %d %d", $1, $5, $16}' /sys/block/vda/stat /sys/block/vdb/stat /sys/block/$(basename $(readlink -f $1))/stat; }
devdelta() { # NAME DEV BEFORE
	echo "$1 $(basename $(readlink -f $2)) $(echo "$3 $(devstat $2)" | awk '{for (i = 1; i <= 9; i++) printf " %d", $(i+9) - $i}')" >>/host/devstat.txt
}
job() { # NAME DEV RW
	d0=$(devstat $2)
	fio --name=$1 --filename=$2 --rw=$3 --bs=4k --ioengine=libaio --iodepth=16 --direct=1 --size=$REGION \
		--time_based --runtime=@RUNTIME@ --ramp_time=@RAMP@ --randrepeat=0 --output-format=json --output=/host/$1.json >/dev/null \
		|| { echo "fio $1 failed"; return 1; }
	devdelta $1 $2 "$d0"
	echo "job $1 done"
}
fsjob() { # NAME DEV
	mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 $2 1G || { echo "mkfs of $2 failed"; return 1; }
	mkdir -p /mnt/b && mount -o noinit_itable $2 /mnt/b || { echo "mount of $2 failed"; return 1; }
	d0=$(devstat $2)
	fio --name=$1 --filename=/mnt/b/f --rw=randwrite --bs=4k --ioengine=psync --fsync=1 --size=64M \
		--time_based --runtime=@RUNTIME@ --ramp_time=@RAMP@ --randrepeat=0 --output-format=json --output=/host/$1.json >/dev/null \
		|| { echo "fio $1 failed"; umount /mnt/b; return 1; }
	devdelta $1 $2 "$d0"
	umount /mnt/b || return 1
	echo "job $1 done"
}
fill() { fio --name=fill --filename=$1 --rw=write --bs=1m --ioengine=libaio --iodepth=4 --direct=1 --size=$REGION >/dev/null || { echo "fill of $1 failed"; return 1; }; }
wipe() { for d in /dev/vda /dev/vdb; do dd if=/dev/zero of=$d bs=1M count=16 oflag=direct 2>/dev/null; done; }

bcache_round() { # ROUND
	make-bcache -C /dev/vda -B /dev/vdb --writeback >/tmp/mkb.out 2>&1 || { cat /tmp/mkb.out; return 1; }
	for d in /dev/vda /dev/vdb; do echo $d >/sys/fs/bcache/register 2>/dev/null; done
	for i in $(seq 1 100); do [ -e /sys/block/bcache0/bcache/cache_mode ] && break; sleep 0.2; done
	echo writeback >/sys/block/bcache0/bcache/cache_mode && echo 0 >/sys/block/bcache0/bcache/sequential_cutoff || return 1
	# bcache sends I/O around a cache device slower than these latencies
	# (2 ms reads, 20 ms writes); the emulated SSD often is: 0 turns that off.
	for u in /sys/fs/bcache/*-*; do echo 0 >$u/congested_read_threshold_us && echo 0 >$u/congested_write_threshold_us || return 1; done
	echo "bcache: $(cat /sys/block/bcache0/bcache/cache_mode)"
	fill /dev/bcache0 && job bcache-randread-$1 /dev/bcache0 randread && job bcache-randwrite-$1 /dev/bcache0 randwrite &&
		fsjob bcache-fsync-$1 /dev/bcache0 || return 1
	echo "bcache: $(cat /sys/block/bcache0/bcache/stats_total/cache_hit_ratio)% hits, dirty $(cat /sys/block/bcache0/bcache/dirty_data)"
	echo 1 >/sys/block/bcache0/bcache/stop
	for u in /sys/fs/bcache/*-*; do echo 1 >$u/stop; done
	for i in $(seq 1 100); do [ -e /sys/block/bcache0 ] || [ -n "$(ls -d /sys/fs/bcache/*-* 2>/dev/null)" ] || break; sleep 0.2; done
	wipe
}

dmcache_round() { # ROUND
	ssd=$(cat /sys/block/vda/size) hdd=$(cat /sys/block/vdb/size) meta=$((64*2048))
	dmsetup create dmc-meta --table "0 $meta linear /dev/vda 0" &&
		dmsetup create dmc-cdev --table "0 $((ssd-meta)) linear /dev/vda $meta" &&
		dmsetup mknodes dmc-meta && dmsetup mknodes dmc-cdev || return 1
	dd if=/dev/zero of=/dev/mapper/dmc-meta bs=1M count=1 oflag=direct 2>/dev/null
	dmsetup create dmc --table "0 $hdd cache /dev/mapper/dmc-meta /dev/mapper/dmc-cdev /dev/vdb 64 1 writeback smq 0" &&
		dmsetup mknodes dmc || return 1
	echo "dm-cache: $(dmsetup table dmc | cut -d' ' -f3,7-)"
	fill /dev/mapper/dmc && job dmcache-randread-$1 /dev/mapper/dmc randread && job dmcache-randwrite-$1 /dev/mapper/dmc randwrite &&
		fsjob dmcache-fsync-$1 /dev/mapper/dmc || return 1
	# status: ... <read hits> <read misses> <write hits> <write misses> ... <dirty>
	echo "dm-cache: status $(dmsetup status dmc | cut -d' ' -f4-14)"
	# Removing a writeback dm-cache would first write back every dirty
	# block through the throttled HDD: the table is replaced by an error
	# target, which drops them (the disks are wiped anyway).
	dmsetup suspend --nolockfs --noflush dmc && dmsetup load dmc --table "0 $hdd error" && dmsetup resume dmc &&
		dmsetup remove dmc && dmsetup remove dmc-cdev && dmsetup remove dmc-meta || return 1
	wipe
}

srvcpu() { awk '{print $14+$15}' /proc/$1/stat; }
nbdreqs() { awk '{print $1+$5}' /sys/block/nbd0/stat; }
measured() { # ROUND PID NAME CMD...
	r=$1 p=$2 n=$3; shift 3
	c0=$(srvcpu $p) q0=$(nbdreqs)
	"$@" || return 1
	echo "$n $c0 $(srvcpu $p) $q0 $(nbdreqs)" >>/host/tiercache-cpu-$r.txt
}

tiercache_round() { # ROUND
	$TC format --cache /dev/vda --backing disk=/dev/vdb --mode writeback >/tmp/fmt.out 2>&1 || { cat /tmp/fmt.out; return 1; }
	$TC serve --cache /dev/vda --listen unix:/run/tc.sock --admin /run/admin.sock >/tmp/tc.log 2>&1 &
	pid=$!
	for i in $(seq 1 100); do [ -S /run/tc.sock ] && [ -S /run/admin.sock ] && break; sleep 0.2; done
	$TC set disk sequential_cutoff=0 --admin /run/admin.sock >/dev/null || return 1
	nbd-client -unix /run/tc.sock /dev/nbd0 -N disk -b 4096 -C 2 >/dev/null || return 1
	fill /dev/nbd0 || return 1
	# The server's CPU (user + system, in clock ticks: 1/100 s) and nbd0's
	# requests (reads + writes completed) around the jobs and around
	# 10 s with the client connected and nothing to do:
	# /host/tiercache-cpu-ROUND.txt, one "JOB CPU0 CPU1 REQ0 REQ1" a line.
	: >/host/tiercache-cpu-$1.txt
	measured $1 $pid idle sleep 10 &&
		measured $1 $pid randread job tiercache-randread-$1 /dev/nbd0 randread &&
		measured $1 $pid randwrite job tiercache-randwrite-$1 /dev/nbd0 randwrite &&
		measured $1 $pid fsync fsjob tiercache-fsync-$1 /dev/nbd0 || return 1
	nbd-client -d /dev/nbd0 >/dev/null
	kill -TERM $pid && wait $pid || { echo "tiercache exit $?"; tail /tmp/tc.log; return 1; }
	rm -f /run/tc.sock /run/admin.sock
	wipe
}

echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
wipe
for r in $(seq 1 @ROUNDS@); do
	bcache_round $r || { echo "bcache round $r failed"; exit 1; }
	dmcache_round $r || { echo "dm-cache round $r failed"; exit 1; }
	tiercache_round $r || { echo "tiercache round $r failed"; exit 1; }
done
