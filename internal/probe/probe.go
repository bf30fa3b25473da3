// Package probe shares a health check among the callers that ask for it
// at about the same time, so that a readiness endpoint anyone can reach
// costs the database at most one check in flight, and one a period,
// however often it is asked: while the checks succeed, and while they fail
// too, when each check may be a new connection's attempt (a login the
// server logs, or counts against the role).
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
	last    *call     // the last check that ended; nil before the first
	ended   time.Time // when last ended
}

type call struct {
	done    chan struct{}
	err     error // set before done is closed
	waiters int   // under Probe.mu: the callers waiting for it, for tests
}

// New returns a Probe that runs check with a deadline of timeout, and
// answers with a check's result, success or failure, without running it
// again for fresh after it ended: a recovery shows at most fresh late.
func New(check func(context.Context) error, timeout, fresh time.Duration) *Probe {
	return &Probe{check: check, timeout: timeout, fresh: fresh}
}

// Check answers with the check in flight if there is one, with the last
// check's result if it ended less than fresh ago, and otherwise starts a check and
// waits for it. It returns ctx's error if ctx ends first; the check goes
// on, within its own timeout, for the callers that ask after it. The
// check runs detached from any caller's context, since its answer is
// theirs too.
func (p *Probe) Check(ctx context.Context) error {
	p.mu.Lock()
	c := p.running
	if c == nil {
		if p.last != nil && time.Since(p.ended) < p.fresh {
			err := p.last.err
			p.mu.Unlock()
			return err
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
	p.running, p.last, p.ended = nil, c, time.Now()
	p.mu.Unlock()
	close(c.done)
}
