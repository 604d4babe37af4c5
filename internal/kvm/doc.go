// Package kvm boots a real Linux kernel for tests: Debian's stock kernel and
// a busybox initramfs with the guest tools (nbd-client, mkfs.ext4, mkfs.xfs,
// fio, dmsetup, make-bcache, util-linux), under qemu-system-x86_64 with TCG.
// It gives the tests what the host kernel here lacks (no nbd, device-mapper
// or bcache modules): the kernel's NBD client against tiercache served
// inside the guest, and dm-log-writes for power cuts of the whole machine.
//
// Build fetches the packages with apt-get download, unpacks them with
// dpkg-deb -x and packs the programs, the shared libraries they need and the
// modules into an uncompressed initramfs, cached under CacheDir by package
// versions. Run boots it with virtio disks backed by host files and a 9p
// share at /host holding the script; the script's exit status and the
// console log come back.
//
// TCG emulates the CPU: I/O paths and CPU are ~20 times slower than on the
// host. The guest is for function and for ratios measured inside one guest,
// never for absolute figures.
package kvm
