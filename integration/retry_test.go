package integration

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
)

// TestRetriesAndDeadLetters: failed deliveries are retried with growing
// backoff and dead-lettered after max_attempts; Permanent dead-letters
// at once; RetryAfter sets the next attempt's time; a panic is a failure
// whose error is the panic, and so is a handler's runtime.Goexit. The fallback poll is an hour away, so every
// retry is driven by the dispatcher itself.
func TestRetriesAndDeadLetters(t *testing.T) {
	const (
		base       = 50 * time.Millisecond
		ceiling    = 400 * time.Millisecond
		retryAfter = 400 * time.Millisecond
		// slack is how much later than its due time a retry may start:
		// the dispatcher learns the due time when it writes the nack. It
		// only has to tell "at its due time" from "at the next poll", an
		// hour away. It was 300ms, and retries started up to 178ms late
		// on a loaded machine under -race; the lower bounds, which load
		// cannot break, say the waits are the backoff's.
		slack = 2 * time.Second
	)
	cases := []struct {
		name        string
		maxAttempts int
		handle      func(ctx context.Context, m *bellhop.Message) error
		// wantCalls handler calls; then dead-lettered at attempt
		// wantCalls with an error containing wantError, or acked if
		// wantError is "".
		wantCalls int
		wantError string
		// check inspects the calls, in order.
		check func(t *testing.T, calls []delivery)
	}{
		{
			name: "always fails: backoff, then dead letter", maxAttempts: 5,
			handle:    func(context.Context, *bellhop.Message) error { return errors.New("boom: downstream unavailable") },
			wantCalls: 5, wantError: "boom: downstream unavailable",
			check: func(t *testing.T, calls []delivery) {
				// The wait after attempt n is min(cap, base*2^(n-1)),
				// less up to half of it as jitter.
				var gaps []time.Duration
				for i := 1; i < len(calls); i++ {
					gap := calls[i].Start.Sub(calls[i-1].End)
					gaps = append(gaps, gap)
					full := min(ceiling, base<<(i-1))
					if gap < full/2 || gap > full+slack {
						t.Errorf("wait before attempt %d was %s; want %s to %s", i+1, gap, full/2, full+slack)
					}
				}
				// That the backoff grows is in the lower bounds: the last
				// waits' (200ms) exceed the first's whole backoff (50ms).
				// Comparing the waits themselves failed when load made
				// the first retry late.
				t.Logf("waits between attempts: %v", gaps)
			},
		},
		{
			name: "Permanent dead-letters at once", maxAttempts: 5,
			handle: func(context.Context, *bellhop.Message) error {
				return bellhop.Permanent(errors.New("malformed order"))
			},
			wantCalls: 1, wantError: "malformed order",
		},
		{
			name: "RetryAfter is honoured", maxAttempts: 5,
			handle: func(_ context.Context, m *bellhop.Message) error {
				if m.Attempt == 1 {
					return bellhop.RetryAfter(retryAfter)
				}
				return nil
			},
			wantCalls: 2,
			check: func(t *testing.T, calls []delivery) {
				gap := calls[1].Start.Sub(calls[0].End)
				t.Logf("retried %s after RetryAfter(%s)", gap, retryAfter)
				if gap < retryAfter {
					t.Errorf("retried after %s, before RetryAfter's %s", gap, retryAfter)
				}
				if gap > retryAfter+slack {
					t.Errorf("retried after %s; want about %s", gap, retryAfter)
				}
			},
		},
		{
			name: "panic is a failure with the panic as its error", maxAttempts: 2,
			handle:    func(context.Context, *bellhop.Message) error { panic("kaboom-7731") },
			wantCalls: 2, wantError: "handler panicked: kaboom-7731",
		},
		{
			// t.FailNow or testify's require in a handler: recover does
			// not see it, and the message must not stay leased.
			name: "runtime.Goexit is a failure", maxAttempts: 2,
			handle:    func(context.Context, *bellhop.Message) error { runtime.Goexit(); return nil },
			wantCalls: 2, wantError: "runtime.Goexit",
		},
	}

	e := newEnv(t)
	mux := bellhop.NewMux()
	recs := make([]*recorder, len(cases))
	for i, c := range cases {
		queue := fmt.Sprintf("retry-%d", i)
		e.consumer(t, bellhop.ConsumerSpec{Queue: queue, MaxAttempts: c.maxAttempts, BackoffBase: base, BackoffCap: ceiling})
		recs[i] = &recorder{result: c.handle}
		mux.Handle("app", queue, recs[i])
	}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)

	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rec := recs[i]
			id := e.enqueue(t, fmt.Sprintf("retry-%d", i), c.name, bellhop.EnqueueOptions{})
			waitFor(t, 10*time.Second, "the message to be settled", func() bool {
				return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1`, id) == 0
			})
			calls := rec.deliveries()
			if len(calls) != c.wantCalls {
				t.Fatalf("handler called %d times, want %d", len(calls), c.wantCalls)
			}
			for j, d := range calls {
				if d.ID != id || d.Attempt != j+1 {
					t.Errorf("call %d: message %s attempt %d; want %s attempt %d", j+1, d.ID, d.Attempt, id, j+1)
				}
			}
			checkDead(t, e, id, c.wantError, c.wantCalls, c.maxAttempts)
			if c.check != nil {
				c.check(t, calls)
			}
		})
	}
}

// checkDead checks that id was dead-lettered at attempt with an error
// containing wantError, or, if wantError is "", that it was not.
func checkDead(t *testing.T, e *env, id uuid.UUID, wantError string, attempt, maxAttempts int) {
	t.Helper()
	dl, ok := e.deadLetterOf(t, id)
	switch {
	case wantError == "" && ok:
		t.Errorf("dead-lettered (%+v); want acked", dl)
	case wantError == "":
	case !ok:
		t.Errorf("not dead-lettered")
	default:
		if dl.Attempt != attempt || dl.Max != maxAttempts {
			t.Errorf("dead letter at attempt %d of %d, want %d of %d", dl.Attempt, dl.Max, attempt, maxAttempts)
		}
		if !strings.Contains(dl.LastError, wantError) {
			t.Errorf("dead letter's last_error %q does not contain %q", dl.LastError, wantError)
		}
	}
}

// firstFails handles a test's one message: it records each delivery, the
// first runs until its context ends if untilLease and then returns fail's
// result, and the others succeed.
type firstFails struct {
	t          *testing.T
	e          *env
	untilLease bool
	fail       func(ctx context.Context) error

	mu       sync.Mutex
	started  int
	attempts []attempt // in the order they returned
}

// attempt is one delivery: when it started, the claimed_at its lease is
// measured from on the server, and, for a first one that ran until its
// context ended, why it ended.
type attempt struct {
	start, claimedAt time.Time
	cause            error
}

func (h *firstFails) Handle(ctx context.Context, m *bellhop.Message) error {
	a := attempt{start: time.Now()}
	if err := h.e.pool.QueryRow(context.Background(),
		`SELECT claimed_at FROM queue_messages WHERE id = $1`, m.ID).Scan(&a.claimedAt); err != nil {
		h.t.Errorf("attempt %d: read claimed_at: %v", m.Attempt, err)
	}
	h.mu.Lock()
	h.started++
	first := h.started == 1
	h.mu.Unlock()
	if first && h.untilLease {
		<-ctx.Done()
		a.cause = context.Cause(ctx)
	}
	h.mu.Lock()
	h.attempts = append(h.attempts, a)
	h.mu.Unlock()
	if first {
		return h.fail(ctx)
	}
	return nil
}

// waitTwo waits for two deliveries to return, and returns them.
func (h *firstFails) waitTwo(what string) (first, second attempt) {
	h.t.Helper()
	waitFor(h.t, 10*time.Second, what, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.attempts) == 2
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.attempts[0], h.attempts[1]
}

// TestAbandonedHandlerKeepsItsLease: a handler still running when its
// lease runs short is abandoned a fifth of the visibility timeout early,
// and its retry waits for the end of that lease even when the backoff or
// RetryAfter is shorter; so does the retry of a handler whose error wraps
// ErrAbandoned. An HTTP consumer does not learn that the dispatcher
// stopped waiting, so an earlier retry could overlap the request it is
// still serving.
func TestAbandonedHandlerKeepsItsLease(t *testing.T) {
	const vt = time.Second
	for _, c := range []struct {
		name string
		// untilLease: attempt 1 runs until its context ends (the lease
		// runs short); otherwise it fails at once.
		untilLease bool
		fail       func(ctx context.Context) error // attempt 1's result
	}{
		{"backoff", true, func(ctx context.Context) error { return ctx.Err() }},
		{"RetryAfter", true, func(context.Context) error { return bellhop.RetryAfter(time.Millisecond) }},
		// A handler that gives up on work that may still run, as an HTTP
		// push without a response does, says so with ErrAbandoned.
		{"ErrAbandoned", false, func(context.Context) error {
			return fmt.Errorf("no answer within 10ms: %w", bellhop.ErrAbandoned)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: vt,
				BackoffBase: time.Millisecond, BackoffCap: time.Millisecond, MaxAttempts: 3})
			h := &firstFails{t: t, e: e, untilLease: c.untilLease, fail: c.fail}
			mux := bellhop.NewMux()
			mux.Handle("app", "orders", h)
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
			e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
			first, second := h.waitTwo("the second attempt")
			if c.untilLease && !errors.Is(first.cause, bellhop.ErrLeaseLost) {
				t.Errorf("attempt 1's context ended with %v, want ErrLeaseLost", first.cause)
			}
			leaseEnd := first.claimedAt.Add(vt)
			t.Logf("attempt 1 claimed at %s, abandoned; attempt 2 started %s after its lease's end",
				first.claimedAt.Format("15:04:05.000"), second.start.Sub(leaseEnd))
			if second.start.Before(leaseEnd) {
				t.Errorf("attempt 2 started %s before attempt 1's lease ended", leaseEnd.Sub(second.start))
			}
			waitFor(t, 10*time.Second, "the message acked", func() bool {
				return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
			})
		})
	}
}

// TestRedriveAfterAbandonedLastAttempt: a last attempt whose handler gave
// up on work that may still run (cut off at its lease's end, or
// ErrAbandoned) is dead-lettered with its lease's end, and a redrive
// before then delivers the message no earlier: redriven at once, it went
// to a second handler while the first lease held. A message rejected for
// good leaves nothing running, and its redrive is delivered at once.
func TestRedriveAfterAbandonedLastAttempt(t *testing.T) {
	const vt = 3 * time.Second
	for _, c := range []struct {
		name string
		// untilLease: attempt 1 runs until its context ends (the lease
		// runs short); otherwise it fails at once.
		untilLease bool
		fail       func(ctx context.Context) error // attempt 1's result
		held       bool                            // whether the redrive waits for the lease's end
	}{
		{"lease ran short", true, func(ctx context.Context) error { return ctx.Err() }, true},
		{"ErrAbandoned", false, func(context.Context) error {
			return fmt.Errorf("no answer within 10ms: %w", bellhop.ErrAbandoned)
		}, true},
		{"rejected", false, func(context.Context) error { return bellhop.Permanent(errors.New("bad order")) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: vt, MaxAttempts: 1})
			h := &firstFails{t: t, e: e, untilLease: c.untilLease, fail: c.fail}
			mux := bellhop.NewMux()
			mux.Handle("app", "orders", h)
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
			id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
			waitFor(t, 10*time.Second, "the dead letter", func() bool {
				return e.count(t, `SELECT count(*) FROM dead_letters WHERE id = $1`, id) == 1
			})
			ds, err := e.client.DeadLetters(context.Background(), bellhop.DeadFilter{App: "app", ID: id})
			if err != nil || len(ds) != 1 {
				t.Fatalf("DeadLetters: %d, %v; want 1", len(ds), err)
			}
			if got := ds[0].RedriveAfter; c.held != (got != nil) {
				t.Errorf("dead letter's RedriveAfter = %v, want it set: %t", got, c.held)
			}
			if n, err := e.client.Redrive(context.Background(), "app", "", id); err != nil || n != 1 {
				t.Fatalf("Redrive: %d, %v; want 1 moved", n, err)
			}
			first, second := h.waitTwo("the redriven delivery")
			leaseEnd := first.claimedAt.Add(vt)
			if c.held && !ds[0].RedriveAfter.Equal(leaseEnd) {
				t.Errorf("dead letter's RedriveAfter = %s, want the lease's end, %s", ds[0].RedriveAfter, leaseEnd)
			}
			t.Logf("attempt 1 claimed at %s; the redriven delivery started %s after its lease's end",
				first.claimedAt.Format("15:04:05.000"), second.start.Sub(leaseEnd))
			if c.held && second.start.Before(leaseEnd) {
				t.Errorf("the redriven message was delivered %s before the last attempt's lease ended", leaseEnd.Sub(second.start))
			}
			if !c.held && !second.start.Before(leaseEnd) {
				t.Errorf("the redriven message waited for the lease's end, with nothing left running")
			}
		})
	}
}
