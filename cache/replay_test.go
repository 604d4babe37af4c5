package cache

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
)

// replayCfg is the shape of a randomized recovery: volumes (each in epoch
// or LBA writeback order), buckets, and how the set was shut down.
type replayCfg struct {
	nb, bpb int64
	orders  []string
	nblocks uint64
	clean   bool
}

// newReplaySet builds a set with cfg's volumes and an empty index with a
// reverse map, as Open has it before recovery, without devices.
func newReplaySet(cfg replayCfg, gens []uint32) *Set {
	s := &Set{bpb: cfg.bpb, log: slog.New(slog.DiscardHandler), epochOK: true}
	var vols []*Volume
	for i, o := range cfg.orders {
		st := DefaultSettings()
		st.WritebackOrder = o
		vols = append(vols, s.newVolume(i, BackingInfo{Name: fmt.Sprint("v", i), Size: int64(cfg.nblocks) * blockSize, Mode: Writeback, Settings: st}, nil))
	}
	s.setVols(vols)
	s.resetIndexLocked(cfg.nb, gens)
	return s
}

// replayGen writes a random journal the way a serving set would (blocks
// handed out append-only per bucket generation, reuse only of buckets
// without dirty data, epochs rising per volume), applying each record to
// sim in journal order as it goes.
type replayGen struct {
	rng    *rand.Rand
	cfg    replayCfg
	sim    *Set
	open   int64
	fill   int64
	state  []int // 0 free, 1 open, 2 sealed
	epochs []uint64
	recs   []*rec
}

func (g *replayGen) emit(t *testing.T, r *rec) {
	t.Helper()
	if err := g.sim.applyLocked(r); err != nil {
		t.Fatalf("generator wrote a record the journal order rejects: %v: %v", r, err)
	}
	g.recs = append(g.recs, r)
}

// alloc returns up to n blocks in the open bucket, opening (and if need
// be reusing) a bucket.
func (g *replayGen) alloc(t *testing.T, n int64) (uint32, int64) {
	if g.open < 0 || g.fill == g.cfg.bpb {
		if g.open >= 0 {
			g.state[g.open] = 2
		}
		g.open = -1
		var free []int64
		for b, st := range g.state {
			if st == 0 {
				free = append(free, int64(b))
			}
		}
		if len(free) == 0 {
			if !g.reuse(t) {
				t.Fatal("generator: no bucket to reuse")
			}
			return g.alloc(t, n)
		}
		g.open = free[g.rng.IntN(len(free))]
		g.state[g.open], g.fill = 1, 0
	}
	k := min(n, g.cfg.bpb-g.fill)
	loc := uint32(g.open*g.cfg.bpb + g.fill)
	g.fill += k
	return loc, k
}

// reuse frees a sealed bucket: its dirty versions are written back
// (clean records), then its generation is bumped.
func (g *replayGen) reuse(t *testing.T) bool {
	var sealed []int64
	for b, st := range g.state {
		if st == 2 {
			sealed = append(sealed, int64(b))
		}
	}
	if len(sealed) == 0 {
		return false
	}
	b := sealed[g.rng.IntN(len(sealed))]
	s := g.sim
	for loc := b * g.cfg.bpb; loc < (b+1)*g.cfg.bpb; loc++ {
		if k := s.mu.owner[loc]; k != 0 {
			vi, lba := splitOwner(k)
			e, ok := s.vols[vi].idx.tree.Get(ent{lba: lba})
			if (ok && e.block() == uint32(loc) && e.dirty()) || !ok || e.block() != uint32(loc) {
				g.emit(t, &rec{typ: recClean, vol: uint16(vi), lba: lba, loc: uint32(loc)})
			}
		}
	}
	gen := s.mu.buckets[b].gen + 1
	g.emit(t, &rec{typ: recReuse, bucket: uint32(b), gen: gen})
	g.state[b] = 0
	return true
}

// dirtyVersion picks a random dirty version (live or superseded).
func (g *replayGen) dirtyVersion() (vi int, lba uint64, loc uint32, ok bool) {
	s := g.sim
	vi = g.rng.IntN(len(s.vols))
	v := s.vols[vi]
	var all []ver
	v.idx.tree.Ascend(func(e ent) bool {
		if e.dirty() {
			all = append(all, ver{lba: e.lba, loc: e.block()})
		}
		return true
	})
	v.idx.sup.Ascend(func(e ent) bool { all = append(all, ver{lba: e.lba, loc: e.loc}); return true })
	if len(all) == 0 {
		return 0, 0, 0, false
	}
	x := all[g.rng.IntN(len(all))]
	return vi, x.lba, x.loc, true
}

func (g *replayGen) step(t *testing.T) {
	s := g.sim
	vi := g.rng.IntN(len(g.cfg.orders))
	hot := uint64(48)
	switch p := g.rng.IntN(100); {
	case p < 55:
		n := int64(1 + g.rng.IntN(4))
		lba := uint64(g.rng.IntN(int(hot)))
		loc, k := g.alloc(t, n)
		b := int64(loc) / g.cfg.bpb
		crcs := make([]uint32, k)
		for i := range crcs {
			crcs[i] = g.rng.Uint32()
		}
		g.emit(t, &rec{typ: recInsert, vol: uint16(vi), lba: lba, loc: loc, gen: s.mu.buckets[b].gen,
			dirty: g.rng.IntN(10) < 7, epoch: g.epochs[vi], crcs: crcs})
	case p < 65:
		g.epochs[vi] += uint64(1 + g.rng.IntN(2)) // a client FLUSH
	case p < 78:
		if vj, lba, loc, ok := g.dirtyVersion(); ok {
			g.emit(t, &rec{typ: recClean, vol: uint16(vj), lba: lba, loc: loc})
		} else {
			g.emit(t, &rec{typ: recClean, vol: uint16(vi), lba: uint64(g.rng.IntN(int(g.cfg.nblocks) + 8)), loc: uint32(g.rng.Int64N(g.cfg.nb * g.cfg.bpb))})
		}
	case p < 88:
		lba := uint64(g.rng.IntN(int(hot)))
		n := uint64(1 + g.rng.IntN(6))
		switch g.rng.IntN(6) {
		case 0:
			lba, n = uint64(g.rng.IntN(8)), uint64(maxInvalItems+1+g.rng.IntN(int(g.cfg.nblocks)))
		case 1:
			n = 1 << 50 // clamped to the volume
		}
		g.emit(t, &rec{typ: recInvalidate, vol: uint16(vi), lba: lba, n: n})
	case p < 93:
		g.reuse(t)
	default:
		if g.open >= 0 {
			g.state[g.open] = 2 // seal early
			g.open = -1
		}
	}
}

// replayCase builds a checkpoint (encoded and decoded as Open reads it)
// after a random prefix of a workload, and the journal of the rest.
func replayCase(t *testing.T, seed uint64) (replayCfg, *ckptData, []*rec, *Set) {
	rng := rand.New(rand.NewPCG(seed, 7))
	cfg := replayCfg{nb: int64(6 + rng.IntN(6)), bpb: 8, nblocks: 600, clean: rng.IntN(2) == 0}
	for range 1 + rng.IntN(3) {
		cfg.orders = append(cfg.orders, []string{"epoch", "lba"}[rng.IntN(2)])
	}
	g := &replayGen{rng: rng, cfg: cfg, open: -1, state: make([]int, cfg.nb), epochs: make([]uint64, len(cfg.orders))}
	g.sim = newReplaySet(cfg, make([]uint32, cfg.nb))
	for range rng.IntN(300) {
		g.step(t)
	}
	s := g.sim
	gens := make([]uint32, cfg.nb)
	for i := range s.mu.buckets {
		gens[i] = s.mu.buckets[i].gen
	}
	var trees []*ptree
	var epochs []uint64
	var vers []verSnap
	epochOf := s.snapshotEpochsLocked()
	for _, v := range s.vols {
		trees = append(trees, v.idx.tree.Clone())
		// The volume's epoch as a checkpoint records it: the replayed
		// inserts' highest.
		epochs = append(epochs, v.idx.epoch)
		vers = append(vers, verSnap{epochOf: epochOf, sup: v.idx.sup.Clone(), dirty: int(v.idx.dirty)})
	}
	var body bytes.Buffer
	if err := encodeCkptBodyVers(gens, epochs, trees, vers, func(p []byte) error { body.Write(p); return nil }); err != nil {
		t.Fatal(err)
	}
	volBlocks := make([]uint64, len(cfg.orders))
	for i := range volBlocks {
		volBlocks[i] = cfg.nblocks
	}
	cd, err := decodeCkptBody(body.Bytes(), cfg.nb, cfg.bpb, volBlocks)
	if err != nil {
		t.Fatalf("seed %d: checkpoint: %v", seed, err)
	}
	g.recs = nil
	for range rng.IntN(600) {
		g.step(t)
	}
	return cfg, cd, g.recs, s
}

// dumpRecovered describes everything recovery builds: per volume the entries,
// superseded versions (in their order), version tree, counts and epoch;
// per bucket the generation, counts, and the epoch of each dirty block;
// the reverse map.
func dumpRecovered(s *Set) string {
	var b bytes.Buffer
	for vi, v := range s.vols {
		fmt.Fprintf(&b, "vol %d: cached %d dirty %d nsup %d epoch %d\n", vi, v.idx.cached, v.idx.dirty, v.idx.nsup, v.idx.epoch)
		v.idx.tree.Ascend(func(e ent) bool {
			fmt.Fprintf(&b, " ent %d -> %d dirty=%t crc %x\n", e.lba, e.block(), e.dirty(), e.crc)
			return true
		})
		v.idx.sup.Ascend(func(e ent) bool {
			fmt.Fprintf(&b, " sup %d -> %d crc %x epoch %d\n", e.lba, e.loc, e.crc, s.blockEpoch(e.loc))
			return true
		})
	}
	for i := range s.mu.buckets {
		bk := &s.mu.buckets[i]
		fmt.Fprintf(&b, "bucket %d: gen %d live %d dirty %d epochs %t\n", i, bk.gen, bk.live, bk.dirty, bk.ep != nil)
	}
	for loc, k := range s.mu.owner {
		if k != 0 {
			vi, lba := splitOwner(k)
			e, ok := s.vols[vi].idx.tree.Get(ent{lba: lba})
			dirty := (ok && e.block() == uint32(loc) && e.dirty()) || !ok || e.block() != uint32(loc)
			fmt.Fprintf(&b, "block %d: vol %d lba %d", loc, vi, lba)
			if dirty {
				fmt.Fprintf(&b, " epoch %d", s.blockEpoch(uint32(loc)))
			}
			b.WriteString("\n")
		}
	}
	return b.String()
}

// recoverBoth recovers cfg's set from cd and recs by the bulk replay
// (recoverIndex) and by the record-by-record path of before (replayOld
// and dropCleanLocked), and fails the test if anything differs.
func recoverBoth(t *testing.T, what string, cfg replayCfg, cd *ckptData, recs []*rec) (*Set, bool, error) {
	t.Helper()
	var payload []byte
	for _, r := range recs {
		payload = appendRec(payload, r)
	}
	jr := &jrecs{blocks: []jblockRef{{off: 4096, seq: 1, payload: payload}}, n: len(recs)}
	fast := newReplaySet(cfg, cd.gens)
	c := newCollector(fast, cfg.nb)
	for _, r := range recs {
		c.add(r)
	}
	fdrop, took, ferr := fast.recoverIndex(cfg.nb, cd, c, jr, cfg.clean)
	old := newReplaySet(cfg, cd.gens)
	oerr := old.replayOld(cd, jr)
	odrop := 0
	if oerr == nil && !cfg.clean {
		odrop = old.dropCleanLocked()
	}
	if fmt.Sprint(ferr) != fmt.Sprint(oerr) {
		t.Fatalf("%s: bulk replay: %v; record by record: %v", what, ferr, oerr)
	}
	if ferr != nil {
		return fast, took, ferr
	}
	if fdrop != odrop {
		t.Fatalf("%s: bulk replay dropped %d clean entries, record by record %d", what, fdrop, odrop)
	}
	if fd, od := dumpRecovered(fast), dumpRecovered(old); fd != od {
		t.Fatalf("%s: bulk replay (fast path %t) and record-by-record replay differ:\n%s", what, took, diffLines(fd, od))
	}
	fast.listBucketsLocked()
	old.listBucketsLocked()
	fc, oc := fast.checkIndexLocked(true), old.checkIndexLocked(true)
	if fmt.Sprint(fc) != fmt.Sprint(oc) {
		t.Fatalf("%s: check: bulk %v, record by record %v", what, fc, oc)
	}
	return fast, took, nil
}

func diffLines(a, b string) string {
	al, bl := bytes.Split([]byte(a), []byte("\n")), bytes.Split([]byte(b), []byte("\n"))
	var out bytes.Buffer
	for i := 0; i < max(len(al), len(bl)); i++ {
		var x, y []byte
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if !bytes.Equal(x, y) {
			fmt.Fprintf(&out, "line %d:\n  bulk: %s\n  old:  %s\n", i, x, y)
			if out.Len() > 2000 {
				break
			}
		}
	}
	return out.String()
}

// TestReplayMatchesSequential compares the bulk replay with the record-by-
// record replay of before over randomized journals (overwrites, multi-block
// inserts, trims small and large, writeback cleans, bucket reuse with
// generation bumps, clean and dirty data, up to three volumes in epoch or
// LBA order with rising flush epochs, clean and unclean shutdown), and,
// after a clean shutdown, with the state the generator reached applying
// every record from the start in journal order. Then it breaks the
// journals (a wrong generation, a reused block, a reuse dropping dirty
// data, a bad volume) and expects both paths to agree again, errors
// included.
func TestReplayMatchesSequential(t *testing.T) {
	seeds := 400
	if testing.Short() {
		seeds = 100
	}
	fastN := 0
	// What the journals exercised: superseded versions recovered, reuse
	// records, large invalidations, multi-block inserts, superseded
	// versions in checkpoints.
	var cover [5]int
	for seed := uint64(0); seed < uint64(seeds); seed++ {
		cfg, cd, recs, sim := replayCase(t, seed)
		what := fmt.Sprintf("seed %d (%d volumes %v, %d buckets, clean %t, %d records)", seed, len(cfg.orders), cfg.orders, cfg.nb, cfg.clean, len(recs))
		s, took, err := recoverBoth(t, what, cfg, cd, recs)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if took {
			fastN++
		}
		for _, v := range s.vols {
			cover[0] += int(v.idx.nsup)
		}
		for _, r := range recs {
			switch {
			case r.typ == recReuse:
				cover[1]++
			case r.typ == recInvalidate && r.n > maxInvalItems:
				cover[2]++
			case r.typ == recInsert && len(r.crcs) > 1:
				cover[3]++
			}
		}
		for _, cv := range cd.vols {
			cover[4] += len(cv.sup)
		}
		if err := s.checkIndexLocked(true); err != nil {
			t.Fatalf("%s: recovered index: %v", what, err)
		}
		if cfg.clean {
			sim.listBucketsLocked()
			if a, b := dumpRecovered(s), dumpRecovered(sim); a != b {
				t.Fatalf("%s: recovered index differs from the journal-order state:\n%s", what, diffLines(a, b))
			}
		}
		// Broken journals.
		rng := rand.New(rand.NewPCG(seed, 9))
		if len(recs) == 0 {
			continue
		}
		bad := slices.Clone(recs)
		i := rng.IntN(len(bad))
		r := *bad[i]
		switch rng.IntN(7) {
		case 0:
			r.gen++
		case 1:
			r.vol = uint16(len(cfg.orders))
		case 2:
			// An insert into a block some earlier insert used.
			for _, x := range bad[:i] {
				if x.typ == recInsert {
					r = rec{typ: recInsert, vol: x.vol, lba: uint64(rng.IntN(40)), loc: x.loc, gen: x.gen, dirty: true, epoch: x.epoch, crcs: []uint32{1}}
					break
				}
			}
		case 3:
			// Reuse of a bucket that may hold dirty data.
			r = rec{typ: recReuse, bucket: uint32(rng.Int64N(cfg.nb)), gen: uint32(rng.IntN(3))}
		case 5, 6:
			// An insert into a block of a checkpoint entry (of its own
			// LBA or another), in the checkpoint's generation.
			if vi := rng.IntN(len(cd.vols)); len(cd.vols[vi].ents) > 0 {
				e := cd.vols[vi].ents[rng.IntN(len(cd.vols[vi].ents))]
				lba := e.lba
				if rng.IntN(2) == 0 {
					lba = uint64(rng.IntN(40))
				}
				r = rec{typ: recInsert, vol: uint16(vi), lba: lba, loc: e.block(), gen: cd.gens[int64(e.block())/cfg.bpb], dirty: true, epoch: 1 << 20, crcs: []uint32{4}}
			}
		case 4:
			r = rec{typ: recInsert, vol: 0, lba: uint64(rng.IntN(40)), loc: uint32(rng.Int64N(cfg.nb * cfg.bpb)), gen: uint32(rng.IntN(3)), dirty: rng.IntN(2) == 0, crcs: []uint32{2, 3}}
		}
		bad[i] = &r
		recoverBoth(t, what+fmt.Sprintf(", record %d replaced by %v", i, &r), cfg, cd, bad)
	}
	t.Logf("%d of %d valid journals took the bulk path; superseded %d, reuses %d, large invalidations %d, multi-block inserts %d, checkpointed superseded %d",
		fastN, seeds, cover[0], cover[1], cover[2], cover[3], cover[4])
	for i, n := range cover {
		if n == 0 {
			t.Errorf("the journals never exercised case %d", i)
		}
	}
	if fastN < seeds*9/10 {
		t.Fatalf("only %d of %d valid journals took the bulk path", fastN, seeds)
	}
}

// TestReplayCheckpointWithoutEpochs: a checkpoint without the epoch section
// (written for slots too small for it) may hold dirty entries; recovery
// gives them epoch 0 on both paths. The record-by-record load indexed a
// nil epoch table (a panic on data from disk).
func TestReplayCheckpointWithoutEpochs(t *testing.T) {
	cfg := replayCfg{nb: 4, bpb: 8, orders: []string{"epoch"}, nblocks: 64, clean: true}
	tr := newPtree()
	tr.ReplaceOrInsert(ent{lba: 3, loc: 5 | dirtyBit, crc: 7})
	tr.ReplaceOrInsert(ent{lba: 9, loc: 6, crc: 8})
	var body bytes.Buffer
	if err := encodeCkptBody(make([]uint32, cfg.nb), []uint64{4}, []*ptree{tr}, func(p []byte) error { body.Write(p); return nil }); err != nil {
		t.Fatal(err)
	}
	cd, err := decodeCkptBody(body.Bytes(), cfg.nb, cfg.bpb, []uint64{cfg.nblocks})
	if err != nil || cd.vols[0].epochOf != nil {
		t.Fatalf("decode: %v (epoch table %v)", err, cd.vols[0].epochOf)
	}
	recs := []*rec{{typ: recInsert, vol: 0, lba: 3, loc: 8, gen: 0, dirty: true, epoch: 5, crcs: []uint32{1}}}
	s, took, err := recoverBoth(t, "no epoch section", cfg, cd, recs)
	if err != nil || !took {
		t.Fatalf("recovery: %v (bulk %t)", err, took)
	}
	if n := s.vols[0].idx.nsup; n != 1 {
		t.Fatalf("%d superseded versions, want the checkpoint's dirty entry (epoch 0) kept under the epoch-5 write", n)
	}
}
