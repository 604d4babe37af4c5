SHELL := /bin/bash
# tiercache build and test entry points. `make test` is the one command that
# passes everything on a fresh Debian machine (CI runs exactly that).
GO ?= go
GOBIN := $(shell $(GO) env GOPATH)/bin
PKGS := ./...

.PHONY: all build test deps lint unit race interop bench bench-deps bench-quick bench-nbd fuzz stress clean

all: build

build:
	$(GO) build -o bin/tiercache ./cmd/tiercache

deps:
	./scripts/install-deps.sh

# Everything: lint, unit tests with the race detector and invariant checks,
# every fuzz target for a minute, then the interop tests with real clients
# against the built binary.
test: deps lint race bench-quick fuzz interop

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GOBIN)/staticcheck $(PKGS)

# Unit, model and crash tests, with the invariants build tag and the race
# detector; the interop package runs separately below.
race:
	$(GO) test -race -tags invariants -timeout 15m $$($(GO) list $(PKGS) | grep -v /internal/interop)

# A leg without the invariants tag, as production builds run.
unit:
	$(GO) test -timeout 15m $$($(GO) list $(PKGS) | grep -v /internal/interop)

# Real clients (nbdinfo, qemu-io, qemu-img, nbdcopy, fio, nbdfuse + loop +
# ext4) against a race-enabled tiercache binary. Needs root for the kernel path.
interop:
	$(GO) test -count=1 -timeout 20m ./internal/interop/

# Every fuzz target (NBD parsers, on-disk decoders, recovery of forged
# metadata) for FUZZTIME each (60s), two at a time; a crasher fails and stays
# in the package's testdata/fuzz/ (scripts/fuzz.sh).
fuzz:
	GO=$(GO) ./scripts/fuzz.sh

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
	TIERCACHE_CRASH_CYCLES=1000 $(GO) test -count=1 -timeout 3h -run 'TestKillCycles$$' -v ./internal/interop/

# The cache scenarios S1-S9 (HDD/SSD models, fio through NBD, side by side;
# S6 pgbench and db_bench on ext4 through the kernel, needs root; S7-S8
# writes larger than the cache in every writeback order; S9 warm-up);
# docs/BENCHMARKS.md has the method and results. BENCHFLAGS="--rounds 3"
# for medians.
bench: bench-deps
	$(GO) run ./cmd/tcbench cache $(BENCHFLAGS)

bench-deps:
	./scripts/install-deps.sh --bench

# Only checks that every scenario runs end to end (part of make test).
bench-quick:
	$(GO) run ./cmd/tcbench cache --quick $(BENCHFLAGS)

# tiercache's NBD server vs qemu-nbd and nbdkit on a plain file.
bench-nbd:
	$(GO) run ./cmd/tcbench $(BENCHFLAGS)

clean:
	rm -rf bin interop.out bench/out
