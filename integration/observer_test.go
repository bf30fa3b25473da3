package integration

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
)

// settledObserver records the deliveries and outcomes a dispatcher
// reports.
type settledObserver struct {
	mu        sync.Mutex
	delivered int
	settled   map[bellhop.Outcome]int
	handled   []time.Duration
}

func (o *settledObserver) Delivered(*bellhop.Message) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.delivered++
}

func (o *settledObserver) Settled(_ *bellhop.Message, out bellhop.Outcome, handled time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.settled == nil {
		o.settled = map[bellhop.Outcome]int{}
	}
	o.settled[out]++
	o.handled = append(o.handled, handled)
}

func (o *settledObserver) Polled(int)                {}
func (o *settledObserver) Reclaimed(int64, int64)    {}
func (o *settledObserver) Finished(*bellhop.Message) {}

// report returns the deliveries, the outcomes and the handler durations
// reported so far.
func (o *settledObserver) report() (int, map[bellhop.Outcome]int, []time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.delivered, maps.Clone(o.settled), append([]time.Duration(nil), o.handled...)
}

// waitSettled waits until n outcomes have been reported and returns the
// report.
func (o *settledObserver) waitSettled(t *testing.T, n int) (int, map[bellhop.Outcome]int, []time.Duration) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		delivered, settled, handled := o.report()
		total := 0
		for _, c := range settled {
			total += c
		}
		if total >= n {
			return delivered, settled, handled
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s, delivered %d and settled %v: want %d outcomes reported", delivered, settled, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSettledLeaseLost: a handler that ignores its context and outlives
// its lease has its message reclaimed and delivered again; its ack then
// finds the lease gone and is reported as lease_lost, beside the second
// delivery's ack, so that every delivery is counted, with its handler's
// duration. Only acks written were reported: the reviewer's run gave two
// deliveries and settled map[acked:1].
func TestSettledLeaseLost(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "slow", VisibilityTimeout: time.Second})
	second := make(chan struct{})
	var once sync.Once
	mux := bellhop.NewMux()
	mux.Handle("app", "slow", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		if m.Attempt > 1 {
			once.Do(func() { close(second) })
			return nil
		}
		// Ignores its context: returns once the message has been
		// delivered again, long after its lease ran out.
		select {
		case <-second:
		case <-time.After(30 * time.Second):
		}
		return nil
	}))
	obs := &settledObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, Observer: obs}, nil)
	e.enqueue(t, "slow", 1, bellhop.EnqueueOptions{})

	delivered, settled, handled := obs.waitSettled(t, 2)
	want := map[bellhop.Outcome]int{bellhop.Acked: 1, bellhop.LeaseLost: 1}
	if delivered != 2 || !maps.Equal(settled, want) {
		t.Errorf("delivered %d, settled %v; want 2 and %v", delivered, settled, want)
	}
	if len(handled) != 2 {
		t.Errorf("%d handler durations reported, want one per delivery, 2", len(handled))
	}
}

// refuse makes every op (DELETE, UPDATE) on queue_messages fail with
// SQLSTATE code, by a trigger.
func (e *env) refuse(t *testing.T, op, code string) {
	t.Helper()
	e.refuseOn(t, "queue_messages", op, code)
}

// refuseOn is refuse for another of Bellhop's tables.
func (e *env) refuseOn(t *testing.T, table, op, code string) {
	t.Helper()
	name := "refuse_" + table + "_" + op
	for _, sql := range []string{
		`CREATE FUNCTION ` + name + `() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN RAISE EXCEPTION '` + op + ` on ` + table + ` refused by the test' USING ERRCODE = '` + code + `'; END $$`,
		`CREATE TRIGGER ` + name + ` BEFORE ` + op + ` ON ` + table + ` FOR EACH ROW EXECUTE FUNCTION ` + name + `()`,
	} {
		if _, err := e.pool.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSettledWriteFailed: an ack that cannot be written (a trigger
// refuses the DELETE on every try) is reported as write_failed, with its
// handler's duration. It was not reported at all.
func TestSettledWriteFailed(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	e.refuse(t, "DELETE", "P0001")
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	obs := &settledObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, Observer: obs}, nil)
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})

	delivered, settled, handled := obs.waitSettled(t, 1) // after the completer's five tries
	want := map[bellhop.Outcome]int{bellhop.WriteFailed: 1}
	if delivered != 1 || !maps.Equal(settled, want) || len(handled) != 1 {
		t.Errorf("delivered %d, settled %v, %d handler durations; want 1, %v and 1", delivered, settled, len(handled), want)
	}
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id); n != 1 {
		t.Errorf("%d leased rows for the message, want it still leased (the ack not written)", n)
	}
}

// failureObserver is a settledObserver that also counts the failed
// statements a dispatcher reports (bellhop.FailureObserver).
type failureObserver struct {
	settledObserver
	fmu    sync.Mutex
	failed map[bellhop.Operation]int
}

func (o *failureObserver) Failed(op bellhop.Operation) {
	o.fmu.Lock()
	defer o.fmu.Unlock()
	if o.failed == nil {
		o.failed = map[bellhop.Operation]int{}
	}
	o.failed[op]++
}

func (o *failureObserver) failures(op bellhop.Operation) int {
	o.fmu.Lock()
	defer o.fmu.Unlock()
	return o.failed[op]
}

// TestFailedStatementsObserved: a dispatcher whose claims and reclaim
// passes fail (its role lost UPDATE on queue_messages, here a trigger
// that refuses every UPDATE) tells a FailureObserver of each, retrying.
// Such failures were only logged, at most once every 10 s, while /readyz
// passed and no metric moved.
func TestFailedStatementsObserved(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	// A second message whose lease ran out an hour ago, for the reclaim.
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
		SELECT id, 'orders', '2', gen_random_uuid(), now() - interval '1 hour', 1 FROM apps WHERE name = 'app'`); err != nil {
		t.Fatal(err)
	}
	e.refuse(t, "UPDATE", "42501") // insufficient_privilege
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	obs := &failureObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, Observer: obs}, nil)

	waitFor(t, 30*time.Second, "two failed claims and a failed reclaim pass reported", func() bool {
		return obs.failures(bellhop.OpClaim) >= 2 && obs.failures(bellhop.OpReclaim) >= 1
	})
	if n := len(rec.deliveries()); n != 0 {
		t.Errorf("%d deliveries, want none: every claim fails", n)
	}
	if n := obs.failures(bellhop.OpReload) + obs.failures(bellhop.OpPoll); n != 0 {
		t.Errorf("%d reload and poll failures reported, want none: those statements succeed", n)
	}
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL AND attempt = 0`, id); n != 1 {
		t.Errorf("the message is not as enqueued (%d rows), want it untouched", n)
	}
}

// TestFailedOffersObserved: with LeaseAtInsert, an offer that cannot be
// made (its role lacks INSERT on bellhop_offers, here a trigger that
// refuses it) is reported to a FailureObserver as OpOffer, and the queue
// is still served, by claims. It was logged at debug only: leasing at
// INSERT was off with nothing to show it (found by the metrics review).
func TestFailedOffersObserved(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	e.refuseOn(t, "bellhop_offers", "INSERT", "42501") // insufficient_privilege
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	obs := &failureObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, LeaseAtInsert: true, Observer: obs}, nil)
	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	waitFor(t, 30*time.Second, "a failed offer reported once the lane is idle", func() bool {
		return obs.failures(bellhop.OpOffer) >= 1
	})
	e.enqueue(t, "orders", 2, bellhop.EnqueueOptions{})
	waitFor(t, 30*time.Second, "both messages delivered by claims", func() bool { return len(rec.deliveries()) >= 2 })
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers`); n != 0 {
		t.Errorf("%d offers stored, want none: every INSERT was refused", n)
	}
	if n := obs.failures(bellhop.OpClaim) + obs.failures(bellhop.OpReload) + obs.failures(bellhop.OpPoll); n != 0 {
		t.Errorf("%d claim, reload and poll failures reported, want none: those statements succeed", n)
	}
}
