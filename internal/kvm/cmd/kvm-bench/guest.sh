# kvm-bench's guest script: bcache (writeback), dm-cache (smq, writeback)
# and tiercache (writeback, served in the guest to the kernel NBD client
# with 2 connections), each on its own pair of disks, all three set up at
# once: bcache on /dev/vda (SSD) and /dev/vdb (HDD, throttled by qemu),
# dm-cache on vdc and vdd, tiercache on vde and vdf. dm-cache keeps its
# metadata in its SSD's first 64 MiB and caches in 32 KiB blocks (its
# smallest). Each system first fills the region sequentially (so that it
# is cached). Then, round after round, the systems take turns job by job
# (the first system of a round rotates): 4 KiB random reads (cache hits)
# and 4 KiB random writes over the region at QD16; after all rounds of
# those, in turns again, a file-system job: ext4 on the device's first
# GiB and fio 4 KiB random writes with an fsync after each, QD1, into a
# 64 MiB file. So the jobs compared are seconds apart, not minutes, on a
# host whose load swings. While the others run their jobs the tiercache
# server is stopped (SIGSTOP), so that its background work (writeback)
# takes no CPU from them; the kernel caches' background threads cannot be
# stopped. fio's JSON goes to /host/SYSTEM-JOB-ROUND.json. The guest's
# clock source is printed first (kvm-bench boots it with tsc=reliable).
set -u
TC=/host/tiercache
REGION=@REGION@
ROUNDS=@ROUNDS@
# A system's device and its SSD and HDD.
dev_bcache=/dev/bcache0 ssd_bcache=vda hdd_bcache=vdb
dev_dmcache=/dev/mapper/dmc ssd_dmcache=vdc hdd_dmcache=vdd
dev_tiercache=/dev/nbd0 ssd_tiercache=vde hdd_tiercache=vdf
get() { eval echo \$$1_$2; }

# The requests the system's SSD, its HDD and its own device completed
# during a fio run, its ramp included: /host/devstat.txt, one "NAME DEV
# SSD HDD OWN" line a job, each device as READS WRITES FLUSHES
# (/sys/block/X/stat fields 1, 5 and 16). /dev/mapper/dmc is a node of
# its own, not a link to its dm-N: the kernel name is found by the node's
# major:minor.
kname() { mm=$(ls -lL $1 | awk '{sub(",", "", $5); print $5 ":" $6}'); for d in /sys/block/*; do [ "$(cat $d/dev)" = "$mm" ] && basename $d; done; }
devstat() { # SYSTEM
	awk '{printf " %d %d %d", $1, $5, $16}' /sys/block/$(get ssd $1)/stat /sys/block/$(get hdd $1)/stat /sys/block/$(kname $(get dev $1))/stat
}
devdelta() { # NAME SYSTEM BEFORE
	echo "$1 $(kname $(get dev $2)) $(echo "$3 $(devstat $2)" | awk '{for (i = 1; i <= 9; i++) printf " %d", $(i+9) - $i}')" >>/host/devstat.txt
}
job() { # SYSTEM RW ROUND
	n=$1-$2-$3 dev=$(get dev $1)
	d0=$(devstat $1)
	fio --name=$n --filename=$dev --rw=$2 --bs=4k --ioengine=libaio --iodepth=16 --direct=1 --size=$REGION \
		--time_based --runtime=@RUNTIME@ --ramp_time=@RAMP@ --randrepeat=0 --output-format=json --output=/host/$n.json >/dev/null \
		|| { echo "fio $n failed"; return 1; }
	devdelta $n $1 "$d0"
	echo "job $n done"
}
fsjob() { # SYSTEM fsync ROUND
	n=$1-$2-$3 dev=$(get dev $1)
	mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 $dev 1G || { echo "mkfs of $dev failed"; return 1; }
	mkdir -p /mnt/b && mount -o noinit_itable $dev /mnt/b || { echo "mount of $dev failed"; return 1; }
	d0=$(devstat $1)
	fio --name=$n --filename=/mnt/b/f --rw=randwrite --bs=4k --ioengine=psync --fsync=1 --size=64M \
		--time_based --runtime=@RUNTIME@ --ramp_time=@RAMP@ --randrepeat=0 --output-format=json --output=/host/$n.json >/dev/null \
		|| { echo "fio $n failed"; umount /mnt/b; return 1; }
	devdelta $n $1 "$d0"
	umount /mnt/b || return 1
	echo "job $n done"
}
fill() { fio --name=fill --filename=$1 --rw=write --bs=1m --ioengine=libaio --iodepth=4 --direct=1 --size=$REGION >/dev/null || { echo "fill of $1 failed"; return 1; }; }

bcache_up() {
	make-bcache -C /dev/vda -B /dev/vdb --writeback >/tmp/mkb.out 2>&1 || { cat /tmp/mkb.out; return 1; }
	for d in /dev/vda /dev/vdb; do echo $d >/sys/fs/bcache/register 2>/dev/null; done
	for i in $(seq 1 100); do [ -e /sys/block/bcache0/bcache/cache_mode ] && break; sleep 0.2; done
	echo writeback >/sys/block/bcache0/bcache/cache_mode && echo 0 >/sys/block/bcache0/bcache/sequential_cutoff || return 1
	# bcache sends I/O around a cache device slower than these latencies
	# (2 ms reads, 20 ms writes); the emulated SSD often is: 0 turns that off.
	for u in /sys/fs/bcache/*-*; do echo 0 >$u/congested_read_threshold_us && echo 0 >$u/congested_write_threshold_us || return 1; done
	echo "bcache: $(cat /sys/block/bcache0/bcache/cache_mode)"
	fill /dev/bcache0
}

dmcache_up() {
	ssd=$(cat /sys/block/vdc/size) hdd=$(cat /sys/block/vdd/size) meta=$((64*2048))
	dmsetup create dmc-meta --table "0 $meta linear /dev/vdc 0" &&
		dmsetup create dmc-cdev --table "0 $((ssd-meta)) linear /dev/vdc $meta" &&
		dmsetup mknodes dmc-meta && dmsetup mknodes dmc-cdev || return 1
	dd if=/dev/zero of=/dev/mapper/dmc-meta bs=1M count=1 oflag=direct 2>/dev/null
	dmsetup create dmc --table "0 $hdd cache /dev/mapper/dmc-meta /dev/mapper/dmc-cdev /dev/vdd 64 1 writeback smq 0" &&
		dmsetup mknodes dmc || return 1
	echo "dm-cache: $(dmsetup table dmc | cut -d' ' -f3,7-)"
	fill /dev/mapper/dmc
}

srvcpu() { awk '{print $14+$15}' /proc/$pid/stat; }
nbdreqs() { awk '{print $1+$5}' /sys/block/nbd0/stat; }
# The server's CPU (user + system, in clock ticks: 1/100 s) and nbd0's
# requests (reads + writes completed) around each of its jobs, and around
# 10 s after the fill with the client connected and nothing to do:
# /host/tiercache-cpu-ROUND.txt, one "JOB CPU0 CPU1 REQ0 REQ1" a line.
measured() { # ROUND NAME CMD...
	mr=$1 mn=$2; shift 2
	c0=$(srvcpu) q0=$(nbdreqs)
	"$@" || return 1
	echo "$mn $c0 $(srvcpu) $q0 $(nbdreqs)" >>/host/tiercache-cpu-$mr.txt
}

tiercache_up() {
	$TC format --cache /dev/vde --backing disk=/dev/vdf --mode writeback >/tmp/fmt.out 2>&1 || { cat /tmp/fmt.out; return 1; }
	$TC serve --cache /dev/vde --listen unix:/run/tc.sock --admin /run/admin.sock >/tmp/tc.log 2>&1 &
	pid=$!
	for i in $(seq 1 100); do [ -S /run/tc.sock ] && [ -S /run/admin.sock ] && break; sleep 0.2; done
	$TC set disk sequential_cutoff=0 --admin /run/admin.sock >/dev/null || return 1
	nbd-client -unix /run/tc.sock /dev/nbd0 -N disk -b 4096 -C 2 >/dev/null || return 1
	fill /dev/nbd0 || return 1
	for r in $(seq 1 $ROUNDS); do : >/host/tiercache-cpu-$r.txt; done
	measured 1 idle sleep 10 || return 1
	kill -STOP $pid
}

turn() { # SYSTEM JOB ROUND
	f=job
	[ $2 = fsync ] && f=fsjob
	if [ $1 = tiercache ]; then
		kill -CONT $pid
		measured $3 $2 $f $1 $2 $3 || return 1
		# The server's counters after each of its jobs (writeback, bypass,
		# latencies): /host/tiercache-stats-JOB-ROUND.txt.
		$TC stats --admin /run/admin.sock >/host/tiercache-stats-$2-$3.txt 2>&1
		kill -STOP $pid
	else
		$f $1 $2 $3
	fi
}

echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
bcache_up || { echo "bcache set-up failed"; exit 1; }
dmcache_up || { echo "dm-cache set-up failed"; exit 1; }
tiercache_up || { echo "tiercache set-up failed"; exit 1; }
order="bcache dmcache tiercache"
rotate() { set -- $order; order="$2 $3 $1"; }
for jobs in "randread randwrite" fsync; do
	for r in $(seq 1 $ROUNDS); do
		for j in $jobs; do
			for s in $order; do turn $s $j $r || { echo "$s $j round $r failed"; exit 1; }; done
		done
		rotate
	done
done
echo "bcache: $(cat /sys/block/bcache0/bcache/stats_total/cache_hit_ratio)% hits, dirty $(cat /sys/block/bcache0/bcache/dirty_data)"
# status: ... <read hits> <read misses> <write hits> <write misses> ... <dirty>
echo "dm-cache: status $(dmsetup status dmc | cut -d' ' -f4-14)"
kill -CONT $pid
nbd-client -d /dev/nbd0 >/dev/null
kill -TERM $pid && wait $pid || { echo "tiercache exit $?"; tail /tmp/tc.log; exit 1; }
