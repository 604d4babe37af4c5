#!/usr/bin/env bash
# Installs what `make test` needs on a fresh Debian machine: the real NBD
# clients and peers the interop tests run (fio, qemu-utils, libnbd-bin,
# nbdkit), the kernel-path tools (fuse3, e2fsprogs, util-linux for losetup)
# and staticcheck; qemu-system-x86 and the test guest of internal/kvm (Debian
# packages fetched with apt-get download into $TIERCACHE_KVM_CACHE, default
# ~/.cache/tiercache/kvm, and packed into an initramfs once per package
# versions) and versitygw, the real S3 server the object-store tests start
# (built from the module proxy once, about 2-4 minutes; then cached in
# $(go env GOPATH)/bin). Idempotent: installs only what is missing.
#
# --bench also installs what `make bench` adds for its application scenario
# (S6): PostgreSQL (server and pgbench) and rocksdb-tools (db_bench). They
# are not needed by `make test`, whose quick suite skips S6 without them.
set -euo pipefail

bench=0
if [ "${1:-}" = "--bench" ]; then bench=1; fi

need=()
have() { command -v "$1" >/dev/null 2>&1; }
havepg() { have "$1" || compgen -G "/usr/lib/postgresql/*/bin/$1" >/dev/null; }
have fio      || need+=(fio)
have qemu-img || need+=(qemu-utils)
have qemu-io  || need+=(qemu-utils)
have nbdinfo  || need+=(libnbd-bin)
have nbdfuse  || need+=(libnbd-bin)
have nbdkit   || need+=(nbdkit)
have fusermount3 || need+=(fuse3)
have mkfs.ext4 || need+=(e2fsprogs)
have losetup  || need+=(mount)
have debugfs  || need+=(e2fsprogs)
have qemu-system-x86_64 || need+=(qemu-system-x86)
have dpkg-deb || need+=(dpkg)
if [ $bench = 1 ]; then
  havepg initdb  || need+=(postgresql)
  havepg pgbench || need+=(postgresql)
  have db_bench  || need+=(rocksdb-tools)
fi

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-deps: missing ${need[*]} and not root; install them or run as root" >&2
    exit 1
  fi
  echo "install-deps: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
fi

GOBIN=$(go env GOPATH)/bin
if [ ! -x "$GOBIN/staticcheck" ]; then
  echo "install-deps: installing staticcheck"
  GOFLAGS= go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
fi
if [ ! -x "$GOBIN/versitygw" ] || ! go version -m "$GOBIN/versitygw" 2>/dev/null | grep -q "mod.*github.com/versity/versitygw.*v1\.8\.0"; then
  echo "install-deps: installing versitygw (the object-store tests' S3 server)"
  (cd / && GOFLAGS= go install github.com/versity/versitygw/cmd/versitygw@v1.8.0)
fi
# The kernel tests' guest: downloads the packages once, rebuilds the image
# only when a package version changes.
img=$(cd "$(dirname "$0")/.." && go run ./internal/kvm/cmd/kvm-image) || { echo "install-deps: building the test guest image failed" >&2; exit 1; }
echo "install-deps: test guest $img"
echo "install-deps: ok"
