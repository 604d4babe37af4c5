SHELL := /bin/bash
# tiercache build and test entry points. `make test` is the one command that
# passes everything on a fresh Debian machine (CI runs exactly that).
GO ?= go
GOBIN := $(shell $(GO) env GOPATH)/bin
PKGS := ./...

.PHONY: all build install test deps lint unit race interop kernel kernel-sweep bench bench-guest bench-deps bench-quick bench-nbd bench-remote bench-objstore fuzz fuzz-quick stress clean

all: build

# The version --version and the admin API report: git describe of the
# tree (a tag, else the commit; -dirty with uncommitted changes).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/tiercache/tiercache/internal/cli.Version=$(VERSION)

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/tiercache ./cmd/tiercache

# Installs the binary, the systemd unit (its ExecStart pointing at the
# installed binary), the config file (only when none is there: an edited
# one is kept), bash/zsh/fish completion and a man page per command.
# DESTDIR stages the tree for a package. Not part of make test.
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
SYSTEMDDIR ?= $(SYSCONFDIR)/systemd/system
install: build
	install -D -m 0755 bin/tiercache $(DESTDIR)$(PREFIX)/bin/tiercache
	sed 's|/usr/local/bin/tiercache|$(PREFIX)/bin/tiercache|g; s|/etc/tiercache/|$(SYSCONFDIR)/tiercache/|g; s|/usr/local/share/doc|$(PREFIX)/share/doc|g' dist/tiercache.service > bin/tiercache.service
	install -D -m 0644 bin/tiercache.service $(DESTDIR)$(SYSTEMDDIR)/tiercache.service
	test -e $(DESTDIR)$(SYSCONFDIR)/tiercache/tiercache.toml || install -D -m 0644 dist/tiercache.toml $(DESTDIR)$(SYSCONFDIR)/tiercache/tiercache.toml
	install -d $(DESTDIR)$(PREFIX)/share/bash-completion/completions $(DESTDIR)$(PREFIX)/share/zsh/site-functions $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d
	bin/tiercache completion bash > $(DESTDIR)$(PREFIX)/share/bash-completion/completions/tiercache
	bin/tiercache completion zsh > $(DESTDIR)$(PREFIX)/share/zsh/site-functions/_tiercache
	bin/tiercache completion fish > $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/tiercache.fish
	rm -rf bin/man && bin/tiercache man bin/man >/dev/null
	install -d $(DESTDIR)$(PREFIX)/share/man/man1
	install -m 0644 bin/man/*.1 $(DESTDIR)$(PREFIX)/share/man/man1/
	install -D -m 0644 docs/OPERATIONS.md $(DESTDIR)$(PREFIX)/share/doc/tiercache/OPERATIONS.md

deps:
	./scripts/install-deps.sh

# Everything: lint, unit tests with the race detector and invariant checks,
# the quick benchmark, every fuzz target for 30 seconds, then the interop
# tests with real clients against the built binary and the real-kernel tests
# side by side: the guest (qemu TCG) keeps about one core busy and the
# interop tests, which mostly wait on their clients, about half of the
# other, so the two together take little longer than the kernel leg alone.
# Each leg's output is printed whole when it ends.
test: deps lint race bench-quick fuzz-quick
	$(MAKE) -j2 --output-sync=target interop kernel

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GOBIN)/staticcheck $(PKGS)

# Unit, model and crash tests, with the invariants build tag and the race
# detector; the interop and kernel (VM) packages run separately below.
race:
	$(GO) test -race -tags invariants -timeout 15m $$($(GO) list $(PKGS) | grep -v -e /internal/interop -e /internal/kvm)

# A leg without the invariants tag, as production builds run.
unit:
	$(GO) test -timeout 15m $$($(GO) list $(PKGS) | grep -v -e /internal/interop -e /internal/kvm)

# Real clients (nbdinfo, qemu-io, qemu-img, nbdcopy, fio, nbdfuse + loop +
# ext4) against a race-enabled tiercache binary. Needs root for the kernel path.
# The long self-contained tests (own files, sockets, processes, tmpfs) call
# t.Parallel and run four at a time after the others; a test that swaps loop
# devices or sets the environment stays serial.
interop:
	$(GO) test -count=1 -parallel 4 -timeout 20m ./internal/interop/

# A real kernel (Debian's, under qemu TCG; internal/kvm, docs/TESTING.md):
# the kernel NBD client against tiercache served inside the guest, and power
# cuts of the whole guest (TestPowerCut: a short workload in every cache mode
# and both writeback orders, a seeded sample of 4 points of each kind per
# mode replayed from the dm-log-writes log; TestPowerCutCompare: the same
# against bcache and dm-cache, replayed in the guest, 1 point per kind).
# Four guest boots. First the package's tests that need no guest (the point
# choice, the oracle of a mark), with the race detector, in seconds.
KVM_GUEST_TESTS = TestBoot$$|TestKernelNBD$$|TestPowerCut$$|TestPowerCutCompare$$
kernel:
	$(GO) test -race -count=1 -skip '$(KVM_GUEST_TESTS)' ./internal/kvm/...
	$(GO) test -count=1 -timeout 40m -v -run '$(KVM_GUEST_TESTS)' ./internal/kvm/

# Every power-cut point of the log (every mark, FLUSH and FUA, and a torn
# point per FLUSH interval) in every cache mode, with a longer workload,
# and the same for bcache and dm-cache (TestPowerCutCompare).
# TIERCACHE_KVM_SEED=N repeats a run's workload and points;
# TIERCACHE_KVM_KEEP=DIR keeps (and replays) its logs.
kernel-sweep:
	TIERCACHE_KVM_FULL=1 $(GO) test -count=1 -timeout 3h -v -run 'TestPowerCut$$' ./internal/kvm/
	TIERCACHE_KVM_FULL=1 $(GO) test -count=1 -timeout 4h -v -run 'TestPowerCutCompare$$' ./internal/kvm/

# Every fuzz target (NBD parsers, on-disk decoders, recovery of forged
# metadata) for FUZZTIME each (60s), two at a time; a crasher fails and stays
# in the package's testdata/fuzz/ (scripts/fuzz.sh).
fuzz:
	GO=$(GO) ./scripts/fuzz.sh

# The same for 30s per target, as part of make test.
fuzz-quick:
	FUZZTIME=30s GO=$(GO) ./scripts/fuzz.sh

# Many more SIGKILL cycles of the process-crash test (make interop runs 50),
# the crash-point and error-point enumeration over 40 workload seeds (make
# race runs 2), and the seeded model tests at STRESS_SEEDS seeds from
# STRESS_START (make race runs 80/20/30/200 of them): the failing-device
# model, power cuts at every device operation under concurrent clients, and
# the concurrent and single-threaded crash models. A failure prints its seed
# and the one-line command that replays it; a later sweep continues with
# e.g. `make stress STRESS_START=5000`.
STRESS_SEEDS ?= 5000
STRESS_START ?= 0
stress:
	TIERCACHE_FAILMODEL_SEEDS=$(STRESS_SEEDS) TIERCACHE_FAILMODEL_START=$(STRESS_START) $(GO) test -count=1 -timeout 3h -run 'TestDeviceFailureModel$$' ./cache/
	TIERCACHE_CRASHPOINTCONC_SEEDS=$$(( $(STRESS_SEEDS) / 10 )) TIERCACHE_CRASHPOINTCONC_START=$(STRESS_START) TIERCACHE_CRASHPOINTCONC_POINTS=all $(GO) test -count=1 -timeout 3h -run 'TestCrashPointsConcurrent$$' -v ./cache/
	TIERCACHE_CRASHCONC_SEEDS=$(STRESS_SEEDS) TIERCACHE_CRASHCONC_START=$(STRESS_START) $(GO) test -count=1 -timeout 3h -run 'TestCrashConcurrent$$' ./cache/
	TIERCACHE_CRASHMODEL_SEEDS=$(STRESS_SEEDS) TIERCACHE_CRASHMODEL_START=$(STRESS_START) $(GO) test -count=1 -timeout 3h -run 'TestCrashModel$$' ./cache/
	TIERCACHE_CRASHPOINT_SEEDS=40 $(GO) test -count=1 -timeout 1h -run 'Test(Crash|Error)Points$$' -v ./cache/
	TIERCACHE_WARMHIT_SEEDS=$$(( $(STRESS_SEEDS) / 10 )) TIERCACHE_WARMHIT_START=$(STRESS_START) $(GO) test -count=1 -timeout 1h -run 'TestWarmHitRatio$$' -v ./cache/
	TIERCACHE_CRASH_CYCLES=1000 $(GO) test -count=1 -timeout 3h -run 'TestKillCycles$$' -v ./internal/interop/

# The cache scenarios S1-S9 (HDD/SSD models, fio through NBD, side by side;
# S6 pgbench and db_bench on ext4 through the kernel, needs root; S7-S8
# writes larger than the cache in every writeback order; S9 warm-up);
# docs/BENCHMARKS.md has the method and results. BENCHFLAGS="--rounds 3"
# for medians.
bench: bench-deps
	$(GO) run ./cmd/tcbench cache $(BENCHFLAGS)
	$(MAKE) bench-guest

# tiercache (kernel NBD client, 2 connections) against bcache and dm-cache, all
# writeback, in the test guest on the same virtual disks (2 GiB SSD, 8 GiB
# HDD at 200 IOPS): fio 4K QD16 random writes and cache-hit reads, ratios
# (internal/kvm/cmd/kvm-bench; GUESTBENCHFLAGS="--rounds 3").
bench-guest:
	$(GO) run ./internal/kvm/cmd/kvm-bench $(GUESTBENCHFLAGS)

bench-deps:
	./scripts/install-deps.sh --bench

# Only checks that every scenario runs end to end (part of make test).
bench-quick:
	$(GO) run ./cmd/tcbench cache --quick $(BENCHFLAGS)

# A remote backing device (nbdkit on loopback TCP): 4 KiB random I/O
# straight to it and through a writeback cache set in front of it (hits,
# misses, writes); docs/BENCHMARKS.md "Remote backing device".
bench-remote: build
	./scripts/bench-remote.sh bin/tiercache

# Issue 22's figures, each against a local versitygw on loopback
# (docs/BENCHMARKS.md "Object-store backing"): bytes PUT per byte written
# back and space and GC write amplification (byte counts); cold 1 MiB
# sequential reads through a fresh cache set vs a plain ranged-GET loop
# (interleaved rounds, medians); pgbench on ext4 in writeback over an
# object-store image beside the HDD model (S6, 3 interleaved rounds, report
# in bench/out/objstore). uptime before and after.
bench-objstore:
	uptime
	$(GO) test ./device/objstore -run 'TestPutAmplification$$|TestGC$$' -count=1 -v
	TIERCACHE_INTEROP_NORACE=1 TIERCACHE_MEASURE=1 $(GO) test ./internal/interop -run 'TestMeasureObjStoreColdRead$$' -count=1 -v
	$(GO) run ./cmd/tcbench cache --only S6 --s6 writeback,writeback-s3 --rounds 3 --out bench/out/objstore $(BENCHFLAGS)
	uptime

# tiercache's NBD server vs qemu-nbd and nbdkit on a plain file.
bench-nbd:
	$(GO) run ./cmd/tcbench $(BENCHFLAGS)

clean:
	rm -rf bin interop.out bench/out
