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

	"golang.org/x/time/rate"
)

// Throttle lets burst lines through at once, then one every interval.
// It is safe for concurrent use.
type Throttle struct {
	limiter *rate.Limiter
	mu      sync.Mutex
	held    int
}

// New returns a Throttle that lets burst lines through at once and then
// one every interval.
func New(burst int, interval time.Duration) *Throttle {
	return &Throttle{limiter: rate.NewLimiter(rate.Every(interval), burst)}
}

// Allow reports whether a line may be written now and, if it may, how many
// lines were held back since the last one written, for the line to say.
func (t *Throttle) Allow() (ok bool, heldBack int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.limiter.Allow() {
		t.held++
		return false, 0
	}
	heldBack, t.held = t.held, 0
	return true, heldBack
}
