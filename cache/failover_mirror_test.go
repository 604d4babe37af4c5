package cache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"

	"github.com/tiercache/tiercache/cache/internal/mirror"
	"github.com/tiercache/tiercache/device"
	"github.com/tiercache/tiercache/device/faultdev"
)

// The mirror target of TestDeviceFailureModel: the set is mirrored on two
// memory devices (B sometimes with fewer slots than A has buckets) and the
// fault is one member's, chosen at random: dead from a random device
// operation on (from the first, which lands it in Open, to a few hundred:
// late in the workload), for every operation (pulled), writes and syncs
// only, or reads only, sometimes after scattered transient errors. Beyond
// the model's properties:
//
//   - no request fails, not even once: one member lost loses nothing and
//     refuses nothing, and the set never fails over;
//   - a member that had a write or sync fail is failed (Stats.Mirror:
//     Degraded, Failed names it) and only that member ever is; a
//     writeback write after the run goes to the survivor, not around
//     the cache;
//   - after the run the set reopens, at random, on both healed members
//     (the failed one is refused as stale beside the survivor), on the
//     survivor alone, or on a power cut's clone of the survivor and the
//     backing devices; every block holds a content allowed after a
//     restart (the model's crash set: its last flushed content or a newer
//     one).
type mirrorFault struct {
	lost       mirror.Member
	mem        [2]*device.Mem
	dev        [2]device.Device
	fd         *faultdev.Device
	writeFails atomic.Int64 // write and sync errors injected
}

// newMirrorFault sizes B for the set of specs (slots: between the fewest
// allowed and one per bucket) and wraps member lost's device with inj.
func newMirrorFault(r *failRun, a *device.Mem, specs []BackingSpec, opts FormatOptions, nb int64, inj faultdev.Injector) *mirrorFault {
	opts.DryRun = true
	sb, err := Format(a, specs, opts)
	if err != nil {
		r.t.Fatal(err)
	}
	slots := mirror.MinSlots + r.rng.Int64N(nb-mirror.MinSlots+1)
	mf := &mirrorFault{lost: mirror.Member(r.rng.IntN(2))}
	mf.mem = [2]*device.Mem{a, device.NewMem(sb.BucketsOff + slots*(opts.BucketSize+blockSize))}
	mf.dev = [2]device.Device{a, mf.mem[1]}
	mf.fd = faultdev.Wrap(mf.mem[mf.lost], faultdev.InjectorFunc(func(op faultdev.Op) faultdev.Fault {
		f := inj.Inject(op)
		if f.Fail && op.Kind != faultdev.Read {
			mf.writeFails.Add(1)
		}
		return f
	}))
	mf.dev[mf.lost] = mf.fd
	r.logf("mirror: B has %d slots for %d buckets; member %v is the one to fail", slots, nb, mf.lost)
	return mf
}

// openMissing is what the operator does when Open fails on a member
// failing under it (the error names the member): open again with that
// member given as missing (--mirror-missing). Open may not guess: a
// member it cannot read may hold the newer label.
func (mf *mirrorFault) openMissing(r *failRun, specs []BackingSpec, opts OpenOptions, err error) (*Set, error) {
	r.t.Helper()
	r.logf("open with member %v failing: %v", mf.lost, err)
	if !errors.Is(err, faultdev.ErrInjected) || !strings.Contains(err.Error(), "member "+mf.lost.String()) {
		r.fatalf("mirror: open failed with %v, which does not name the failing member %v's fault", err, mf.lost)
	}
	a, b := mf.dev[mirror.A], mf.dev[mirror.B]
	if mf.lost == mirror.A {
		a = nil
	} else {
		b = nil
	}
	opts.Mirror, opts.MirrorMissing = b, true
	s, err := Open(a, specs, opts)
	if err != nil {
		r.fatalf("mirror: open with member %v missing: %v", mf.lost, err)
	}
	return s, nil
}

// checkRun checks the running set after the workload: not failed over,
// only the lost member failed, and taking a writeback write on the
// survivor when degraded.
func (mf *mirrorFault) checkRun(r *failRun, st SetStats) {
	r.t.Helper()
	if st.Failed {
		r.fatalf("mirror: one member lost failed the set over: %s", st.Cause)
	}
	m := st.Mirror
	if m == nil {
		r.fatalf("mirror: no mirror stats")
	}
	if m.Degraded && m.Failed != mf.lost.String() {
		r.fatalf("mirror: member %s failed; only %v had faults", m.Failed, mf.lost)
	}
	if !m.Degraded {
		return
	}
	// Writeback on the survivor: a write goes to the cache, not around it
	// as a failed or passthrough set's would.
	v := r.set.vols[0]
	if err := v.SetMode(Writeback); err != nil {
		r.fatalf("mirror: degraded set refuses writeback: %v", err)
	}
	before := v.Stats()
	r.wid++
	p := make([]byte, blockSize)
	stamp(p, r.wid, 0, 0)
	err := v.WriteAt(p, 0, false)
	r.logf("probe write w%d vol0 off=0 (degraded, writeback): %v", r.wid, err)
	r.noteErr(err)
	r.apply(0, 0, p, true, false)
	after := v.Stats()
	if after.Mode != Writeback || after.BypassCacheFailedBytes != before.BypassCacheFailedBytes || after.BypassModeBytes != before.BypassModeBytes {
		r.fatalf("mirror: a writeback write on the degraded set went around the cache: mode %v, bypassed (cache failed) %d → %d bytes, (mode) %d → %d",
			after.Mode, before.BypassCacheFailedBytes, after.BypassCacheFailedBytes, before.BypassModeBytes, after.BypassModeBytes)
	}
	r.read(0, 0, blockSize)
}

// checkStopped checks the stopped set (no background write can fail a
// member any more): degraded exactly when the lost member had a write or
// sync fail.
func (mf *mirrorFault) checkStopped(r *failRun, st SetStats) {
	r.t.Helper()
	if m := st.Mirror; mf.writeFails.Load() > 0 && !m.Degraded {
		r.fatalf("mirror: %d writes or syncs failed on member %v and it is not failed: %+v", mf.writeFails.Load(), mf.lost, m)
	}
}

// reopen opens the set again after the run (s stopped, the fault healed):
// on both members, on the survivor alone or on a power cut's clone of the
// survivor and backing devices (both members when none failed).
func (mf *mirrorFault) reopen(r *failRun, specs []BackingSpec, degraded bool) *Set {
	r.t.Helper()
	a, b := device.Device(mf.mem[mirror.A]), device.Device(mf.mem[mirror.B])
	how := []string{"both", "survivor", "power cut"}[r.rng.IntN(3)]
	if how == "power cut" {
		ms := []*device.Mem{mf.mem[mirror.A], mf.mem[mirror.B]}
		for _, sp := range specs {
			ms = append(ms, sp.Dev.(*device.Mem))
		}
		// No torn blocks: the model's contents are whole blocks.
		c := device.CrashCloneAll(device.CrashConfig{UnsyncedKeep: 0.5, Rand: rand.New(rand.NewPCG(r.seed, 0xc10e))}, ms...)
		a, b = c[0], c[1]
		specs = append([]BackingSpec(nil), specs...)
		for i := range specs {
			specs[i].Dev = c[2+i]
		}
	}
	cacheDev, mirrorDev := a, b
	if degraded && how != "both" {
		// The survivor alone: its label records the other's failure.
		cacheDev, mirrorDev = [2]device.Device{a, b}[1-mf.lost], nil
	}
	r.logf("heal + reopen (%s, degraded %t)", how, degraded)
	s, err := Open(cacheDev, specs, OpenOptions{Mirror: mirrorDev})
	if err != nil {
		r.fatalf("mirror: reopen (%s): %v", how, err)
	}
	if m := s.Stats().Mirror; m == nil || m.Degraded != degraded || (degraded && m.Failed != mf.lost.String()) {
		r.fatalf("mirror: reopened (%s): mirror %+v, want degraded %t (member %v failed)", how, m, degraded, mf.lost)
	}
	return s
}

func (mf *mirrorFault) String() string {
	return fmt.Sprintf("mirror member %v: %d ops, %d injected", mf.lost, mf.fd.Ops(), mf.fd.Injected())
}
