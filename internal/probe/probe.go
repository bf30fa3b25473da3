// Package probe shares a health check among the callers that ask for it
// at about the same time, so that a readiness endpoint anyone can reach
// costs the database at most one check in flight, and one a period while
// the checks succeed, however often it is asked.
package probe

import (
	"context"
	"sync"
	"time"
)

// Probe runs a check on behalf of many callers. Its zero value is not
// usable; make one with New.
type Probe struct {
	check   func(context.Context) error
	timeout time.Duration
	fresh   time.Duration

	mu      sync.Mutex
	running *call     // the check in flight; nil when none is
	passed  time.Time // when the last check that succeeded ended
}

type call struct {
	done    chan struct{}
	err     error // set before done is closed
	waiters int   // under Probe.mu: the callers waiting for it, for tests
}

// New returns a Probe that runs check with a deadline of timeout, and
// answers nil without running it again for fresh after a check succeeds.
// A failed check is not reused: the next caller starts another, so that
// recovery shows at once.
func New(check func(context.Context) error, timeout, fresh time.Duration) *Probe {
	return &Probe{check: check, timeout: timeout, fresh: fresh}
}

// Check answers with the check in flight if there is one, with nil if a
// check succeeded less than fresh ago, and otherwise starts a check and
// waits for it. It returns ctx's error if ctx ends first; the check goes
// on, within its own timeout, for the callers that ask after it. The
// check runs detached from any caller's context, since its answer is
// theirs too.
func (p *Probe) Check(ctx context.Context) error {
	p.mu.Lock()
	c := p.running
	if c == nil {
		if !p.passed.IsZero() && time.Since(p.passed) < p.fresh {
			p.mu.Unlock()
			return nil
		}
		c = &call{done: make(chan struct{})}
		p.running = c
		go p.run(c)
	}
	c.waiters++
	p.mu.Unlock()
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *Probe) run(c *call) {
	ctx, cancel := context.WithTimeout(context.Background(), p.timeout)
	c.err = p.check(ctx)
	cancel()
	p.mu.Lock()
	p.running = nil
	if c.err == nil {
		p.passed = time.Now()
	}
	p.mu.Unlock()
	close(c.done)
}
