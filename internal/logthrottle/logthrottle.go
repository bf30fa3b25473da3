// Package logthrottle bounds how often a repeated log line is written. A
// failure that every message of a queue meets, or every queue, would
// otherwise write a line each time: a consumer that is down with 100,000
// messages queued, or a database that is away, would flood the log. The
// lines held back are counted, and the next line let through says how many
// there were.
package logthrottle

import (
	"sync"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/time/rate"
)

// Throttle lets burst lines through at once, then one every interval.
// It is safe for concurrent use.
type Throttle struct {
	limiter *rate.Limiter
	mu      sync.Mutex
	held    int64
}

// New returns a Throttle that lets burst lines through at once and then
// one every interval.
func New(burst int, interval time.Duration) *Throttle {
	return &Throttle{limiter: rate.NewLimiter(rate.Every(interval), burst)}
}

// Allow reports whether a line may be written now and, if it may, how many
// lines were held back since the last one written, for the line to say.
func (t *Throttle) Allow() (ok bool, heldBack int) {
	ok, held := t.allow(1)
	return ok, int(held)
}

// allow is Allow for a line about n things (n dead letters, say): if it
// is held back, the next line let through counts its n.
func (t *Throttle) allow(n int64) (bool, int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.limiter.Allow() {
		t.held += n
		return false, 0
	}
	heldBack := t.held
	t.held = 0
	return true, heldBack
}

// Event starts a line about n things at level if the throttle lets it
// through, with held_back saying how many things the lines held back
// since the last one were about; otherwise it starts a debug line, and
// the next line let through counts its n. A line at a level log leaves
// out takes no share, so that lines nobody reads (a lane's info lines
// under a warn logger) do not use up the share of those that are read.
func (t *Throttle) Event(log *zerolog.Logger, level zerolog.Level, n int64) *zerolog.Event {
	if level < log.GetLevel() || level < zerolog.GlobalLevel() {
		return log.WithLevel(level)
	}
	ok, held := t.allow(n)
	if !ok {
		return log.Debug()
	}
	ev := log.WithLevel(level)
	if held > 0 {
		ev = ev.Int64("held_back", held)
	}
	return ev
}
