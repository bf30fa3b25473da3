package claim

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop/internal/timeout"
)

// Combiner makes a dispatcher's claim passes. While fewer than its limit
// are in flight, a pass is sent at once, alone, as ClaimPass would send
// it. Beyond that, passes wait, and when one in flight ends, up to
// MaxCombined of the waiting queues' passes, asking for up to
// MaxCombinedMessages in all, go as one (ClaimPasses): one
// round trip, one transaction and one claim statement for them all. So a
// dispatcher whose queues are woken faster than it can claim for them one
// by one, as when ten thousand idle queues each get a message, spends a
// fraction of the server's time per queue (BENCHMARKS.md), and one whose
// queues are woken now and then claims exactly as before.
//
// A stop does not cut a pass short at once: cancelling a claim that has
// committed but whose answer is still on its way drops the answer, and
// its messages would stay leased, each with an attempt spent, until the
// lease ran out (dead-lettering one that was on its last attempt,
// undelivered). A pass is cancelled only once every caller it serves has
// been stopped for StopWait. A caller stopped before its pass is sent
// (while it waits, or before it calls) gets an empty Pass at once.
//
// A pass that has not answered within the Combiner's timeout is cancelled,
// and each of its callers gets an error: a pass stuck on a lock or on a
// connection that no longer answers would otherwise hold its callers, and
// once the limit of such passes is reached, every other queue's, for as
// long as it lasts (the kernel's TCP timeout of about 15 minutes, for a
// server gone behind a failover). pgx closes the pass's connection and
// sends the server a cancel request, so a pass that waits for a lock
// claims nothing; one whose claim had already committed, its answer not
// yet read, leaves those messages leased, an attempt spent, until their
// visibility timeout, as a stop's cancel does.
type Combiner struct {
	db      *pgxpool.Pool
	limit   int
	timeout time.Duration

	mu       sync.Mutex
	inFlight int
	waiting  []*call

	// passes counts the passes sent, for tests.
	passes atomic.Int64
}

// MaxCombined is the most queues a combined pass claims for.
const MaxCombined = 100

// MaxCombinedMessages is the most messages a combined pass asks for, the
// sum of its requests' Max; a request that asks for more goes alone. A
// combined pass is one statement, run by one server backend on one core.
// Without this bound, 100 queues at in-flight 1,000 were claimed for in
// statements of about 7,000 rows, 400 ms each, one after another, and
// their burn-down ran at 0.7 × its rate before combining, which claimed
// in passes of a few hundred rows that share the server's cores
// (BENCHMARKS.md, "combined claim passes").
const MaxCombinedMessages = 1000

// StopWait is how long a stop lets a claim pass already sent finish.
const StopWait = 5 * time.Second

// call is one caller's pass.
type call struct {
	ctx  context.Context
	req  Request
	pass Pass
	err  error
	done chan struct{} // closed once answered; nil for a call sent at once
}

// NewCombiner returns a Combiner that sends at most limit passes at once
// (at least 1), and cancels a pass that has not answered within
// passTimeout (none if 0).
func NewCombiner(db *pgxpool.Pool, limit int, passTimeout time.Duration) *Combiner {
	return &Combiner{db: db, limit: max(limit, 1), timeout: passTimeout}
}

// Pass makes r's claim pass, as ClaimPass does, combined with other
// queues' if passes are waiting (see Combiner). ctx stops the caller:
// see Combiner for what a stop does to a pass.
func (c *Combiner) Pass(ctx context.Context, r Request) (Pass, error) {
	if ctx.Err() != nil {
		// Stopped already, as a caller stopped while its pass waits: no
		// claim is sent. One sent at once leased messages only for the
		// caller to release them, and against a stalled server held its
		// stop for StopWait.
		return Pass{}, nil
	}
	cl := &call{ctx: ctx, req: r}
	c.mu.Lock()
	if c.inFlight < c.limit && len(c.waiting) == 0 {
		c.inFlight++
		c.mu.Unlock()
		c.run([]*call{cl}, false)
		return cl.pass, cl.err
	}
	cl.done = make(chan struct{})
	c.waiting = append(c.waiting, cl)
	c.mu.Unlock()
	select {
	case <-cl.done:
	case <-ctx.Done():
		// Answered now, not when a pass in flight ends: those passes
		// may be other lanes' and take long, and a stopping lane holds
		// its queue's busy key until it returns.
		c.mu.Lock()
		if i := slices.Index(c.waiting, cl); i >= 0 {
			c.waiting = slices.Delete(c.waiting, i, i+1)
			c.mu.Unlock()
			return Pass{}, nil
		}
		c.mu.Unlock()
		<-cl.done // taken into a pass already
	}
	return cl.pass, cl.err
}

// run makes calls' pass and answers them. Then, while passes wait, it
// sends the next combined one: from a goroutine of its own if the caller
// is Pass's (own is false), so that Pass answers at once.
func (c *Combiner) run(calls []*call, own bool) {
	for {
		c.send(calls)
		for _, cl := range calls {
			if cl.done != nil { // nil: Pass's own call, answered on return
				close(cl.done)
			}
		}
		c.mu.Lock()
		next := c.take()
		if len(next) == 0 {
			c.inFlight--
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		if !own {
			go c.run(next, true)
			return
		}
		calls = next
	}
}

// take removes from the waiting calls those to send together: the
// oldest, and if it is a queue's, up to MaxCombined of distinct queues,
// oldest first, while their messages asked for stay within
// MaxCombinedMessages. It answers those whose callers were stopped
// meanwhile and have not yet seen it. Hold mu.
func (c *Combiner) take() []*call {
	var out []*call
	asked := 0
	kept := c.waiting[:0]
	for _, cl := range c.waiting {
		switch {
		case cl.ctx.Err() != nil:
			close(cl.done)
		case len(out) == 0 || len(out) < MaxCombined && asked+cl.req.Max <= MaxCombinedMessages && combines(out, cl.req.Target):
			out = append(out, cl)
			asked += cl.req.Max
		default:
			kept = append(kept, cl)
		}
	}
	clear(c.waiting[len(kept):])
	c.waiting = kept
	return out
}

// combines reports whether a pass for t can join calls' combined pass:
// both are for queues, and none of calls is for t's queue.
func combines(calls []*call, t Target) bool {
	if t.Source != Queue || calls[0].req.Target.Source != Queue {
		return false
	}
	for _, cl := range calls {
		if cl.req.Target.AppID == t.AppID && cl.req.Target.Queue == t.Queue {
			return false
		}
	}
	return true
}

// send makes calls' pass and stores each caller's answer.
func (c *Combiner) send(calls []*call) {
	ctx, cancel := stopAfterAll(calls)
	defer cancel()
	ctx, cancelTimeout := timeout.Bound(ctx, c.timeout)
	defer cancelTimeout()
	c.passes.Add(1)
	if len(calls) == 1 {
		cl := calls[0]
		cl.pass, cl.err = ClaimPass(ctx, c.db, cl.req.Target, cl.req.Max, cl.req.Busy)
		cl.err = timeout.Explain(ctx, cl.err)
		return
	}
	reqs := make([]Request, len(calls))
	for i, cl := range calls {
		reqs[i] = cl.req
	}
	ps, err := ClaimPasses(ctx, c.db, reqs)
	err = timeout.Explain(ctx, err)
	for i, cl := range calls {
		if err != nil {
			cl.err = err
		} else {
			cl.pass = ps[i]
		}
	}
}

// stopAfterAll returns a context cancelled StopWait after every call's
// context is done, and a function to release it.
func stopAfterAll(calls []*call) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	var left atomic.Int32
	left.Store(int32(len(calls)))
	stops := make([]func() bool, len(calls))
	for i, cl := range calls {
		stops[i] = context.AfterFunc(cl.ctx, func() {
			if left.Add(-1) == 0 {
				t := time.AfterFunc(StopWait, cancel)
				context.AfterFunc(ctx, func() { t.Stop() })
			}
		})
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancel()
	}
}
