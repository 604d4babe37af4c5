# TestPowerCutCompare's guest script: for each of bcache and dm-cache
# (writeback), the power-cut workload of TestPowerCut on the cache's
# devices as slices of one dm-log-writes device, then the replay of that
# log in this guest (kvmreplay). The system's data disk and log disk are
# /dev/vd[2i] and /dev/vd[2i+1].
set -u
S=/host/cachesys.sh
run_sys() { # SYSTEM DATA LOG
	sys=$1 data=$2 log=$3 lw=lw-$1
	size=$(((8+32+81)*2048))
	dmsetup create $lw --table "0 $size log-writes $data $log" >/dev/null && dmsetup mknodes $lw || return 1
	dash $S up $sys /dev/mapper/$lw format || return 1
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/mapper/$sys-fs && mount -t ext4 /dev/mapper/$sys-fs /mnt || return 1
	sync
	dash /host/lwmark.sh $lw fsready
	/host/kvmload -dev /dev/mapper/$sys-disk -blocks @BLOCKS@ -writes @WRITES@ -seed @SEED@ -events /host/$sys.events \
		-mark "dash /host/lwmark.sh $lw" &
	lpid=$!
	for i in $(seq 1 @FILES@); do
		yes "tiercache file $i" | head -c $((1000 + i * 3001 % 60000)) >/mnt/f$i
		xfs_io -c fsync /mnt/f$i && xfs_io -c fsync /mnt && dash /host/lwmark.sh $lw e$i || return 1
	done
	wait $lpid || { echo "kvmload failed"; return 1; }
	umount /mnt && dash $S down $sys || return 1
	dmsetup status $lw
	dmsetup remove $lw || return 1
	echo "WORKLOAD $sys done"
	truncate -s $((size*512)) /tmp/work.img && losetup /dev/loop0 /tmp/work.img || return 1
	/host/kvmreplay -name $sys -log $log -events /host/$sys.events -size $((size*512)) -base /tmp/base.img -work /dev/loop0 \
		-up "dash $S up $sys /dev/loop0" -down "dash $S down $sys" -stamp /dev/mapper/$sys-disk -fs /dev/mapper/$sys-fs \
		-seed @SEED@ -points @POINTS@ @FULL@ || return 1
	losetup -d /dev/loop0
	rm -f /tmp/work.img /tmp/base.img
}
