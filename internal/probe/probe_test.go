package probe

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// gate is a check that counts its runs, and blocks each until the test
// sends it an answer.
type gate struct {
	runs   atomic.Int32
	answer chan error
	// deadline is the time left to the last run's context when it began.
	deadline atomic.Int64
}

func newGate() *gate { return &gate{answer: make(chan error, 100)} }

func (g *gate) check(ctx context.Context) error {
	g.runs.Add(1)
	if d, ok := ctx.Deadline(); ok {
		g.deadline.Store(int64(time.Until(d)))
	}
	select {
	case err := <-g.answer:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// waitFor polls cond every millisecond until it holds, failing the test
// after 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// waiting is how many callers wait for the check in flight.
func (p *Probe) waiting() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running == nil {
		return 0
	}
	return p.running.waiters
}

// TestCallersShareTheCheckInFlight: callers that ask while a check runs
// all get its answer, success or failure, and no second check starts.
func TestCallersShareTheCheckInFlight(t *testing.T) {
	refused := errors.New("database: connection refused")
	for _, tc := range []struct {
		name   string
		answer error
	}{{"success", nil}, {"failure", refused}} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGate()
			p := New(g.check, 10*time.Second, time.Hour)
			const callers = 50
			got := make(chan error, callers)
			for range callers {
				go func() { got <- p.Check(context.Background()) }()
			}
			waitFor(t, "every caller to wait for the check", func() bool { return p.waiting() == callers })
			g.answer <- tc.answer
			for range callers {
				select {
				case err := <-got:
					if err != tc.answer {
						t.Errorf("a caller got %v, want %v", err, tc.answer)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("a caller had no answer within 10s")
				}
			}
			if n := g.runs.Load(); n != 1 {
				t.Errorf("%d checks ran for %d callers, want 1", n, callers)
			}
		})
	}
}

// TestSuccessIsReusedWhileFresh: after a success, callers get nil without
// a check while it is fresh; once it is stale, a check runs again.
func TestSuccessIsReusedWhileFresh(t *testing.T) {
	g := newGate()
	p := New(g.check, 10*time.Second, time.Hour)
	g.answer <- nil
	for range 100 {
		if err := p.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := g.runs.Load(); n != 1 {
		t.Errorf("%d checks ran for 100 callers within an hour of a success, want 1", n)
	}

	// Fresh for 20 ms: a check runs again soon, and answers at once.
	g = newGate()
	for range cap(g.answer) {
		g.answer <- nil
	}
	p = New(g.check, 10*time.Second, 20*time.Millisecond)
	waitFor(t, "a second check once the first success is stale", func() bool {
		if err := p.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
		return g.runs.Load() >= 2
	})
}

// TestFailureIsReusedWhileFresh: a failed check answers, as a success
// does, the callers that ask while it is fresh, without a check of their
// own; once it is stale, the next caller's check sees the recovery. A
// failure used to be checked again at once by the next caller: an
// unauthenticated /readyz in a loop made one connection attempt after
// another while the database refused them.
func TestFailureIsReusedWhileFresh(t *testing.T) {
	g := newGate()
	p := New(g.check, 10*time.Second, time.Hour)
	down := errors.New("down")
	g.answer <- down
	for range 100 {
		if err := p.Check(context.Background()); err != down {
			t.Fatalf("got %v, want %v", err, down)
		}
	}
	if n := g.runs.Load(); n != 1 {
		t.Errorf("%d checks ran for 100 callers within an hour of a failure, want 1", n)
	}

	// Fresh for 20 ms: the failure is checked again soon, and the recovery
	// shows.
	g = newGate()
	g.answer <- down
	for range cap(g.answer) - 1 {
		g.answer <- nil
	}
	p = New(g.check, 10*time.Second, 20*time.Millisecond)
	if err := p.Check(context.Background()); err != down {
		t.Fatalf("got %v, want %v", err, down)
	}
	waitFor(t, "the recovery seen once the failure is stale", func() bool {
		return p.Check(context.Background()) == nil
	})
	if n := g.runs.Load(); n != 2 {
		t.Errorf("%d checks ran, want 2: the failure, then the recovery", n)
	}
}

// TestCallerGivesUpCheckGoesOn: a caller whose context ends gets its
// error at once; the check, bounded by its own timeout rather than the
// caller's, carries on for the next caller.
func TestCallerGivesUpCheckGoesOn(t *testing.T) {
	g := newGate()
	const timeout = time.Minute
	p := New(g.check, timeout, time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan error, 1)
	go func() { gaveUp <- p.Check(ctx) }()
	waitFor(t, "the first caller to wait", func() bool { return p.waiting() == 1 })
	cancel()
	select {
	case err := <-gaveUp:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("the caller that gave up got %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a caller whose context ended still waited after 10s")
	}
	next := make(chan error, 1)
	go func() { next <- p.Check(context.Background()) }()
	waitFor(t, "the next caller to join the same check", func() bool { return p.waiting() == 2 })
	g.answer <- nil
	if err := <-next; err != nil {
		t.Errorf("the next caller got %v, want nil", err)
	}
	if n := g.runs.Load(); n != 1 {
		t.Errorf("%d checks ran, want 1", n)
	}
	if d := time.Duration(g.deadline.Load()); d <= timeout-10*time.Second || d > timeout {
		t.Errorf("the check's context had %s left when it began, want about %s", d, timeout)
	}
}
