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
