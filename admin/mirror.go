package admin

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/tiercache/tiercache/cache"
)

// memberPaths returns the paths of the mirrored set's members A and B
// (for a set on one device: the cache device's and "").
func (s *Server) memberPaths() [2]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.paths
}

func (s *Server) resilveringPath() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.resilvering
}

func resilverInfo(p *cache.ResilverProgress, path string) *ResilverInfo {
	if p == nil {
		return nil
	}
	return &ResilverInfo{Member: p.Member, Path: path, Done: p.Done, Total: p.Total, ETASeconds: p.ETA.Seconds(), Rate: p.Rate}
}

func (s *Server) handleResilverRate(w http.ResponseWriter, r *http.Request) {
	var req ResilverRate
	if !decodeBody(w, r, &req, `{"rate": ...}`, true) {
		return
	}
	if s.cfg.Set == nil {
		writeError(w, http.StatusConflict, "", "this server serves no cache set: no resilver runs")
		return
	}
	if err := s.cfg.Set.SetResilverRate(req.Rate); err != nil {
		writeError(w, http.StatusConflict, "", err.Error())
		return
	}
	s.log.Info("resilver rate limit changed", "rate", req.Rate)
	writeJSON(w, http.StatusOK, req)
}

func (s *Server) handleReplace(w http.ResponseWriter, r *http.Request) {
	var req ReplaceRequest
	if !decodeBody(w, r, &req, `{"path": ..., "force": ..., "rate": ...}`, true) {
		return
	}
	switch {
	case s.cfg.Set == nil:
		writeError(w, http.StatusConflict, "", "this server serves no cache set: there is no mirror to replace a member of")
		return
	case s.cfg.ReplaceMember == nil:
		writeError(w, http.StatusNotImplemented, "", "this server cannot replace mirror members")
		return
	case s.cfg.ReadOnly:
		writeError(w, http.StatusConflict, "", "the server runs with --read-only: replace writes to the cache set")
		return
	case req.Path == "":
		writeError(w, http.StatusBadRequest, "", "replace needs the path of the new device")
		return
	case req.Rate < 0:
		writeError(w, http.StatusBadRequest, "", fmt.Sprintf("replace: a rate of %d bytes a second: give a positive rate, or 0 for no limit", req.Rate))
		return
	}
	attach := s.cfg.Set.Stats().Mirror == nil
	for i, p := range s.memberPaths() {
		switch {
		case p != "" && p == req.Path && attach:
			writeError(w, http.StatusConflict, "", fmt.Sprintf("%s is the set's cache device: give a second device for the mirror", req.Path))
			return
		case p != "" && p == req.Path:
			writeError(w, http.StatusConflict, "", fmt.Sprintf("%s is member %c of the set already: give the new device that replaces the failed member", req.Path, 'A'+i))
			return
		}
	}
	// A second replace is refused by the mirror (one resilver at a time).
	s.mu.Lock()
	mine := s.mu.resilvering == ""
	if mine {
		s.mu.resilvering = req.Path
	}
	s.mu.Unlock()
	if mine {
		defer func() {
			s.mu.Lock()
			s.mu.resilvering = ""
			s.mu.Unlock()
		}()
	}
	st := newStreamer(w)
	var last cache.ResilverProgress
	member, path, err := s.cfg.ReplaceMember(r.Context(), req, func(p cache.ResilverProgress) {
		last = p
		pr := Progress{Op: "replace", Done: p.Done, Total: p.Total, ETASeconds: p.ETA.Seconds()}
		if el := time.Since(p.Started).Seconds(); el > 0 && p.Done > 0 {
			pr.Rate = float64(p.Done) / el
		}
		st.send(pr, false)
	})
	final := Progress{Op: "replace", Finished: true, Done: last.Done, Total: last.Total}
	if err != nil {
		final.Error = interrupted(r.Context(), err).Error()
		if errors.Is(err, cache.ErrInvalid) {
			final.Message = "refused"
		}
		s.log.Warn("replace failed", "path", req.Path, "err", err)
		st.send(final, true)
		return
	}
	i := 1
	if member == "A" {
		i = 0
	}
	s.mu.Lock()
	s.mu.paths[i] = path
	s.mu.Unlock()
	final.Message = fmt.Sprintf("member %s is now %s: the mirror is in sync again", member, path)
	if attach {
		final.Message = fmt.Sprintf("%s is attached as the mirror (member B): the metadata and dirty data are on both devices now", path)
	}
	s.log.Info("replace", "member", member, "path", path)
	st.send(final, true)
}
