package cache

import (
	"fmt"

	"github.com/tiercache/tiercache/cache/internal/ondisk"
)

// JournalLossError reports acknowledged metadata that is gone (journal
// blocks before the journal head record, or a checkpoint newer than the
// newest valid one); see ondisk/journalhead.go. It wraps ErrCorrupt.
type JournalLossError = ondisk.JournalLossError

// IsJournalLoss reports whether err is (or wraps) a *JournalLossError.
func IsJournalLoss(err error) bool { return ondisk.IsJournalLoss(err) }

// writeJournalHeadLocked records that the journal of generation gen is
// durable up to (not including) block pos, and syncs: after this, replay
// that ends before pos is damage, not a torn tail.
// REQUIRES: s.commitMu
func (s *Set) writeJournalHeadLocked(gen uint64, pos ondisk.JournalPos) error {
	s.jr.headN++
	h := ondisk.JournalHead{N: s.jr.headN, Gen: gen, Seq: pos.Seq, Blk: pos.Blk, Nonce: s.nonce}
	off := ondisk.JournalHeadOff(int(h.N % 2))
	if _, err := s.dev.WriteAt(h.Encode(), off); err != nil {
		return fmt.Errorf("writing journal head record at %d: %w", off, err)
	}
	if err := s.dev.Sync(); err != nil {
		return fmt.Errorf("syncing journal head record: %w", err)
	}
	return nil
}
