package admin

import (
	"context"
	"crypto/subtle"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Access decides who may use the API. On the unix socket (mode 0600) the
// peer's credentials (SO_PEERCRED) must be the server's own user or root:
// those could open every device the server opens anyway, which answers
// whose permissions apply to attach (the server's, for requesters who hold
// them). Over TCP every request needs the bearer token
// (Authorization: Bearer TOKEN), whose file only the server's user can read;
// GET /metrics is exempt only with OpenMetrics.
type Access struct {
	// Token is the bearer token TCP clients must send. Empty: every TCP
	// request is refused.
	Token string
	// TokenFile names where an operator finds the token, for refusals.
	TokenFile string
	// OpenMetrics lets GET /metrics over TCP in without the token (it is
	// read-only; export names are its only strings).
	OpenMetrics bool
}

// peer is what the listener knows about a connection's other end.
type peer struct {
	unix     bool
	uid, pid int // unix: from SO_PEERCRED; -1 when it could not be read
	remote   string
}

type peerKey struct{}

// ConnContext records the connection's peer for the API's access checks:
// set it as the http.Server's ConnContext. Requests on connections without
// it are refused.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	p := peer{remote: c.RemoteAddr().String(), uid: -1, pid: -1}
	if uc, ok := c.(*net.UnixConn); ok {
		p.unix = true
		if rc, err := uc.SyscallConn(); err == nil {
			rc.Control(func(fd uintptr) {
				if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
					p.uid, p.pid = int(cred.Uid), int(cred.Pid)
				}
			})
		}
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// authorize refuses requests that Access does not let in.
func (s *Server) authorize(next http.Handler) http.Handler {
	a := s.cfg.Access
	euid := os.Geteuid()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, ok := r.Context().Value(peerKey{}).(peer)
		switch {
		case !ok:
			writeError(w, http.StatusForbidden, "", "the admin API refuses connections of an unknown kind (the server did not record the peer)")
			return
		case p.unix:
			if p.uid != 0 && p.uid != euid {
				s.log.Warn("admin API: refused a unix socket peer that is neither the server's user nor root", "uid", p.uid, "pid", p.pid, "path", r.URL.Path)
				writeError(w, http.StatusForbidden, "", fmt.Sprintf("the admin socket serves its owner (uid %d) and root only; this peer is uid %d", euid, p.uid))
				return
			}
		case a.OpenMetrics && (r.Method == http.MethodGet || r.Method == http.MethodHead) && r.URL.Path == "/metrics":
		default:
			tok, bearer := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !bearer || a.Token == "" || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(a.Token)) != 1 {
				why := "no bearer token"
				if bearer {
					why = "a wrong bearer token"
				}
				s.log.Warn("admin API: refused a TCP request with "+why, "remote", p.remote, "method", r.Method, "path", r.URL.Path)
				w.Header().Set("WWW-Authenticate", `Bearer realm="tiercache"`)
				writeError(w, http.StatusUnauthorized, "", fmt.Sprintf("the admin API over TCP needs its bearer token (this request had %s): send \"Authorization: Bearer TOKEN\" with the token in %s (readable by the server's user only)", why, a.TokenFile))
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}
