package integration

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
)

// TestExtendLease: a handler that renews its lease before each deadline
// works on for more than twice its visibility timeout, its context never
// ends and its message is delivered once. A handler whose context has
// ended for its lease cannot renew it: ExtendLease says the lease is lost,
// though the database would still take the renewal.
func TestExtendLease(t *testing.T) {
	const vt = 2 * time.Second // the context ends 400 ms before the lease
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "long", VisibilityTimeout: vt})
	e.consumer(t, bellhop.ConsumerSpec{Queue: "late", VisibilityTimeout: vt, MaxAttempts: 1})

	type report struct {
		renewals  int
		errs      []error
		deadlines []time.Time
		ctxErr    error
		late      error // ExtendLease once the context ended
	}
	reports := make(chan report, 4)
	mux := bellhop.NewMux()
	mux.Handle("app", "long", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		var r report
		started := time.Now()
		for time.Since(started) < 2*vt+time.Second {
			// Renew 300 ms before the context would end.
			select {
			case <-ctx.Done():
				r.ctxErr = context.Cause(ctx)
				reports <- r
				return r.ctxErr
			case <-time.After(time.Until(m.LeaseDeadline()) - 300*time.Millisecond):
			}
			err := m.ExtendLease(ctx)
			r.renewals++
			r.errs = append(r.errs, err)
			r.deadlines = append(r.deadlines, m.LeaseDeadline())
		}
		r.ctxErr = ctx.Err()
		reports <- r
		return nil
	}))
	mux.Handle("app", "late", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		<-ctx.Done()
		r := report{ctxErr: context.Cause(ctx), late: m.ExtendLease(context.Background())}
		reports <- r
		return r.ctxErr
	}))
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)

	long := e.enqueue(t, "long", map[string]int{"n": 1}, bellhop.EnqueueOptions{})
	var r report
	select {
	case r = <-reports:
	case <-time.After(4*vt + 5*time.Second):
		t.Fatal("the renewing handler never finished")
	}
	if r.ctxErr != nil {
		t.Fatalf("the renewing handler's context ended (%v) after %d renewals: %v", r.ctxErr, r.renewals, r.errs)
	}
	if r.renewals < 3 {
		t.Errorf("%d renewals in more than twice the timeout, want at least 3", r.renewals)
	}
	for i, err := range r.errs {
		if err != nil {
			t.Errorf("renewal %d: %v", i+1, err)
		}
		if i > 0 && !r.deadlines[i].After(r.deadlines[i-1]) {
			t.Errorf("renewal %d did not move the deadline: %v then %v", i+1, r.deadlines[i-1], r.deadlines[i])
		}
	}
	waitFor(t, 5*time.Second, "the renewed message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1`, long) == 0
	})
	select {
	case extra := <-reports:
		t.Fatalf("the renewed message was delivered again: %+v", extra)
	default:
	}

	e.enqueue(t, "late", map[string]int{"n": 2}, bellhop.EnqueueOptions{})
	select {
	case r = <-reports:
	case <-time.After(2*vt + 5*time.Second):
		t.Fatal("the late handler's context never ended")
	}
	if !errors.Is(r.ctxErr, bellhop.ErrLeaseLost) {
		t.Errorf("the context ended with %v, want ErrLeaseLost", r.ctxErr)
	}
	if !errors.Is(r.late, bellhop.ErrLeaseLost) {
		t.Errorf("ExtendLease after the context ended: %v, want ErrLeaseLost", r.late)
	}
}

// TestLeaseDeadline: a handler's lease deadline, when its context ends, is
// its visibility timeout less a fifth of it, or less 5 s for timeouts over
// 25 s: a short lease keeps most of its length, and a long one ends 5 s
// early, not a fifth. It counts from just before the claim, and, after a
// renewal, from just before the renewal, which this measures exactly.
func TestLeaseDeadline(t *testing.T) {
	e := newEnv(t)
	want := map[string]time.Duration{ // queue: the deadline's distance from the lease's start
		"short": 1600 * time.Millisecond, // 2 s less 400 ms
		"long":  55 * time.Second,        // 60 s less 5 s
	}
	e.consumer(t, bellhop.ConsumerSpec{Queue: "short", VisibilityTimeout: 2 * time.Second})
	e.consumer(t, bellhop.ConsumerSpec{Queue: "long", VisibilityTimeout: time.Minute})
	type seen struct {
		queue        string
		left         time.Duration // to the deadline, at the handler's start
		afterRenewal time.Duration // from just before ExtendLease to the new deadline
		err          error
	}
	got := make(chan seen, 2)
	mux := bellhop.NewMux()
	for q := range want {
		mux.Handle("app", q, bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
			s := seen{queue: m.Queue, left: time.Until(m.LeaseDeadline())}
			before := time.Now()
			s.err = m.ExtendLease(ctx)
			s.afterRenewal = m.LeaseDeadline().Sub(before)
			got <- s
			return nil
		}))
	}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	for q := range want {
		e.enqueue(t, q, 1, bellhop.EnqueueOptions{})
	}
	for range want {
		select {
		case s := <-got:
			w := want[s.queue]
			// The claim's round trip and the hand-off come off the top;
			// under -race on a loaded machine, up to about a second.
			if s.left > w || s.left < w-time.Second {
				t.Errorf("queue %s: %s left to the lease deadline at the handler's start, want %s less the claim's round trip", s.queue, s.left, w)
			}
			// The renewal's start is read right after "before": only
			// scheduling lies between them.
			if s.err != nil || s.afterRenewal < w || s.afterRenewal > w+250*time.Millisecond {
				t.Errorf("queue %s: renewal %v, deadline %s after it began, want %s", s.queue, s.err, s.afterRenewal, w)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a message was not delivered")
		}
	}
}

// TestExtendAfterRemoval: a handler whose consumer was removed while it
// ran cannot renew its lease: ExtendLease is ErrNoConsumer, and the
// deadline stays where it was, since nothing would measure a longer lease;
// nor does the lease's start (claimed_at) move in the database.
func TestExtendAfterRemoval(t *testing.T) {
	e := newEnv(t)
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: 30 * time.Second})
	started := make(chan *bellhop.Message, 1)
	removed := make(chan struct{})
	renewed := make(chan error, 1)
	checked := make(chan struct{}) // the handler acks once the test has read claimed_at
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		started <- m
		select {
		case <-removed:
		case <-ctx.Done():
			return ctx.Err()
		}
		renewed <- m.ExtendLease(ctx)
		select {
		case <-checked:
		case <-ctx.Done():
		}
		return nil
	}))
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	var m *bellhop.Message
	select {
	case m = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10s")
	}
	defer close(checked)
	claimedAt := func() time.Time {
		t.Helper()
		var at time.Time
		if err := e.pool.QueryRow(context.Background(), `SELECT claimed_at FROM queue_messages WHERE id = $1`, m.ID).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}
	deadline, leasedAt := m.LeaseDeadline(), claimedAt()
	if err := e.client.RemoveConsumer(context.Background(), "app", cons.ID); err != nil {
		t.Fatal(err)
	}
	close(removed)
	select {
	case err := <-renewed:
		if !errors.Is(err, bellhop.ErrNoConsumer) {
			t.Errorf("ExtendLease after the consumer's removal: %v, want ErrNoConsumer", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not renew within 10s")
	}
	if got := m.LeaseDeadline(); !got.Equal(deadline) {
		t.Errorf("the lease deadline moved from %v to %v", deadline, got)
	}
	if got := claimedAt(); !got.Equal(leasedAt) {
		t.Errorf("claimed_at moved from %v to %v though the lease was not renewed", leasedAt, got)
	}
}
