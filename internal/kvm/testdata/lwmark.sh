# lwmark.sh LW NAME: append mark NAME to the log of dm-log-writes device LW
# once every write and FLUSH in flight on LW has completed.
#
# dm-log-writes hands each completed write to the first FLUSH it maps after
# it, and logs them when that FLUSH completes. Two FLUSHes in flight at
# once (a cache's commit and a file system's fsync on other slices of the
# same device) may complete in the other order: a write that was durable
# when the later FLUSH completed is then logged after it, and after a mark
# appended then. Suspending LW (--nolockfs: no file system to freeze; no
# FLUSH is issued) waits for everything in flight, so the mark lands after
# the batches of every FLUSH completed before it. The workload's writer and
# the file-system part mark at the same time: mkdir is the lock (the guest
# has no flock).
set -u
until mkdir /run/lwmark-"$1" 2>/dev/null; do sleep 0.01; done
trap 'rmdir /run/lwmark-"$1"' EXIT
dmsetup suspend --nolockfs "$1" || exit 1
dmsetup message "$1" 0 mark "$2"
r=$?
dmsetup resume "$1" || exit 1
exit $r
