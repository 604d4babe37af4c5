package cache

import (
	"fmt"
	"testing"
)

// TestRoute is route's whole table: every combination of its inputs, with
// the decision spelled out.
func TestRoute(t *testing.T) {
	type row struct {
		in   routeIn
		want routeOut
	}
	around := func(why bypassReason) routeOut { return routeOut{dest: toAround, why: why} }
	dirty := routeOut{dest: toCacheDirty}
	deferred := routeOut{dest: toCacheDirty, deferred: true}
	var rows []row
	for _, m := range []Mode{Writeback, Writethrough, Writearound, None} {
		for _, op := range []routeOp{opWrite, opZeroes, opTrim} {
			for _, seq := range []bool{false, true} {
				for _, failed := range []bool{false, true} {
					for _, older := range []bool{false, true} {
						for _, small := range []bool{false, true} {
							for _, keeps := range []bool{false, true} {
								in := routeIn{mode: m, op: op, seq: seq, failed: failed, olderDirty: older, small: small, keeps: keeps}
								var want routeOut
								switch {
								case failed && op == opWrite:
									want = around(bypassFailed)
								case failed:
									want = around(bypassMode)
								case keeps && m == Writeback && (op == opZeroes || op == opTrim && small):
									// Over an object-store image: nothing
									// the next flush would need the store for.
									want = dirty
								case keeps && m == Writeback && op == opTrim:
									want = routeOut{dest: toNothing}
								case older && op == opWrite && seq:
									// Degrade, then as in lba order.
									switch m {
									case Writeback, Writethrough:
										want = around(bypassSequential)
									default:
										want = around(bypassMode)
									}
									want.degrade = degradeSequential
								case older && op == opWrite && m == Writeback:
									want = dirty
								case older && (op == opWrite || small):
									want = deferred
								case older && op == opZeroes:
									want = around(bypassMode)
									want.degrade = degradeLargeZeroes
								case older:
									want = routeOut{dest: toNothing}
								case op != opWrite:
									want = around(bypassMode)
								case seq && (m == Writeback || m == Writethrough):
									want = around(bypassSequential)
								case m == Writeback:
									want = dirty
								case m == Writethrough:
									want = routeOut{dest: toCacheClean}
								default:
									want = around(bypassMode)
								}
								rows = append(rows, row{in, want})
							}
						}
					}
				}
			}
		}
	}
	for _, r := range rows {
		if got := route(r.in); got != r.want {
			t.Errorf("route(%s): %s, want %s", fmtRouteIn(r.in), fmtRouteOut(got), fmtRouteOut(r.want))
		}
	}
	// Where olderDirtyMatters says no, olderDirty must not change the
	// decision (routeBlocks does not compute it there).
	skipped := 0
	for _, r := range rows {
		if r.in.olderDirtyMatters() {
			continue
		}
		skipped++
		a, b := r.in, r.in
		a.olderDirty, b.olderDirty = false, true
		if ga, gb := route(a), route(b); ga != gb {
			t.Errorf("route(%s) depends on olderDirty (%s vs %s) but olderDirtyMatters is false", fmtRouteIn(r.in), fmtRouteOut(ga), fmtRouteOut(gb))
		}
	}
	if skipped == 0 {
		t.Error("olderDirtyMatters is true for every input")
	}
	// A few rows by hand, as an operator would read them.
	for _, r := range []row{
		{routeIn{mode: Writeback, op: opWrite}, dirty},
		{routeIn{mode: Writeback, op: opWrite, seq: true}, around(bypassSequential)},
		{routeIn{mode: Writeback, op: opWrite, seq: true, olderDirty: true},
			routeOut{dest: toAround, why: bypassSequential, degrade: degradeSequential}},
		{routeIn{mode: Writethrough, op: opWrite, olderDirty: true}, deferred},
		{routeIn{mode: None, op: opZeroes, olderDirty: true, small: true}, deferred},
		{routeIn{mode: Writeback, op: opTrim, olderDirty: true}, routeOut{dest: toNothing}},
		{routeIn{mode: Writeback, op: opWrite, failed: true, olderDirty: true}, around(bypassFailed)},
		{routeIn{mode: Writeback, op: opZeroes, keeps: true}, dirty},
		{routeIn{mode: Writeback, op: opZeroes, keeps: true, olderDirty: true}, dirty},
		{routeIn{mode: Writeback, op: opTrim, keeps: true, small: true}, dirty},
		{routeIn{mode: Writeback, op: opTrim, keeps: true}, routeOut{dest: toNothing}},
		{routeIn{mode: Writethrough, op: opZeroes, keeps: true}, around(bypassMode)},
		{routeIn{mode: Writeback, op: opWrite, keeps: true, seq: true}, around(bypassSequential)},
	} {
		if got := route(r.in); got != r.want {
			t.Errorf("route(%s): %s, want %s", fmtRouteIn(r.in), fmtRouteOut(got), fmtRouteOut(r.want))
		}
	}
}

func fmtRouteIn(in routeIn) string {
	return fmt.Sprintf("%v %v seq=%v failed=%v older=%v small=%v keeps=%v", in.mode, in.op, in.seq, in.failed, in.olderDirty, in.small, in.keeps)
}

func fmtRouteOut(o routeOut) string {
	return fmt.Sprintf("%v why=%d degrade=%q deferred=%v", o.dest, o.why, o.degrade, o.deferred)
}
