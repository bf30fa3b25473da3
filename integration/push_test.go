package integration

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// TestPushNotPoll: with the fallback poll an hour away, every message is
// handled within a second of its enqueue, so notifications (not the poll)
// deliver it; and an idle dispatcher runs no claim statement at all. The
// bound only has to tell a notification from the hour-long poll: it is far
// above the scheduling noise of -race on two cores shared with other
// packages' tests (a median of 10ms alone, over 100ms under such load).
// The figures are logged.
func TestPushNotPoll(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})

	const n = 100
	var mu sync.Mutex
	started := make([]time.Time, n)
	var handled sync.WaitGroup
	handled.Add(n)
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		now := time.Now()
		var p struct{ I int }
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			t.Errorf("payload %s: %v", m.Payload, err)
			return bellhop.Permanent(err)
		}
		mu.Lock()
		first := started[p.I].IsZero()
		if first {
			started[p.I] = now
		}
		mu.Unlock()
		if first {
			handled.Done()
		} else {
			t.Errorf("message %d delivered twice", p.I)
		}
		return nil
	}))
	claims := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })

	enqueued := make([]time.Time, n)
	for i := range n {
		enqueued[i] = time.Now()
		e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{})
	}
	waitDone(t, &handled, 10*time.Second, "all 100 messages handled")

	lat := make([]time.Duration, n)
	for i := range n {
		lat[i] = started[i].Sub(enqueued[i])
	}
	slices.Sort(lat)
	t.Logf("enqueue → handler start: p50 %s, p90 %s, p99 %s, max %s", lat[n/2], lat[n*90/100-1], lat[n*99/100-1], lat[n-1])
	if lat[n-1] >= pushLimit {
		t.Errorf("slowest message took %s from enqueue to handler; want < %s with the poll at 1h", lat[n-1], pushLimit)
	}

	// Idle: once every message is acked, and the lane has stopped polling
	// (100 messages back to back are a stream: it marks the queue and
	// polls until a window passes with nothing new), nothing should claim
	// any more.
	waitFor(t, 5*time.Second, "all messages acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "the lane settled")
	// The unmark is a write of its own after the lane's last claim, which
	// a loaded machine may run after the quiet spell: waited for, as
	// TestSteadyStreamMarksQueue does, rather than counted at once. A mark
	// that stays fails the wait.
	waitFor(t, 5*time.Second, "no busy mark left after the lane settled", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_busy`) == 0
	})
	before := claims.n.Load()
	if before == 0 {
		t.Fatal("the tracer saw no claim statement: it would not see idle claims either")
	}
	// The one timed wait that is the point of the test: an idle spell.
	holdsFor(t, 5*time.Second, "zero claim statements while idle", func() bool { return claims.n.Load() == before })
	t.Logf("%d claim statements for %d messages; none in 5s idle", before, n)
}

// pushLimit bounds the time from an enqueue (or a deliver_after) to the
// handler's start in the tests that tell a notification or a timer from
// the fallback poll, which they set an hour away. A second is far below
// the poll and far above the scheduler's noise under -race on a loaded
// two-core machine, where single deliveries have taken over 100ms.
const pushLimit = time.Second

// waitDone waits for wg with a deadline.
func waitDone(t *testing.T, wg *sync.WaitGroup, timeout time.Duration, what string) {
	t.Helper()
	ch := make(chan struct{})
	go func() { wg.Wait(); close(ch) }()
	select {
	case <-ch:
	case <-time.After(timeout):
		t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}

// TestDeliverAfter: with the poll an hour away, delayed messages are
// delivered by the dispatcher's own timer as each falls due, out of
// enqueue order: no earlier than their deliver_after, and less than
// pushLimit (a second) later, which tells the timer from the poll; the
// lateness is logged (typically under 10ms).
func TestDeliverAfter(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "later"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "later", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)

	cases := []struct {
		name string
		opts bellhop.EnqueueOptions
		in   time.Duration // DeliverAfter, from the enqueue
	}{
		{name: "delay 1.5s", opts: bellhop.EnqueueOptions{Delay: 1500 * time.Millisecond}},
		{name: "delay 0.5s", opts: bellhop.EnqueueOptions{Delay: 500 * time.Millisecond}},
		{name: "deliver_after in 1s", in: time.Second},
	}
	due := map[uuid.UUID]time.Time{}
	names := map[uuid.UUID]string{}
	ctx := context.Background()
	for _, c := range cases {
		if c.in > 0 {
			// Set now, not with the cases: a stall during the enqueues
			// before it would leave it in the past, the message
			// delivered at once, and late by the stall.
			c.opts.DeliverAfter = time.Now().Add(c.in)
		}
		// Read deliver_after back as stored (microseconds) in the
		// enqueue's own transaction: before its commit, which notifies,
		// no dispatcher can see the row. Read after the commit, the row
		// could already be claimed or gone when a loaded machine ran the
		// read half a second late.
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		payload, err := json.Marshal(c.name)
		if err != nil {
			t.Fatal(err)
		}
		id, err := e.client.EnqueueTx(ctx, tx, "app", "later", payload, c.opts)
		if err != nil {
			_ = tx.Rollback(ctx)
			t.Fatalf("%s: enqueue: %v", c.name, err)
		}
		var at time.Time
		if err := tx.QueryRow(ctx, `SELECT deliver_after FROM queue_messages WHERE id = $1`, id).Scan(&at); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatalf("%s: read deliver_after: %v", c.name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("%s: commit: %v", c.name, err)
		}
		names[id], due[id] = c.name, at
	}
	waitFor(t, 5*time.Second, "all delayed messages delivered", func() bool { return rec.n.Load() == int32(len(cases)) })

	for _, d := range rec.deliveries() {
		want, ok := due[d.ID]
		if !ok {
			t.Fatalf("unexpected delivery of %s", d.ID)
		}
		late := d.Start.Sub(want)
		t.Logf("%s: deliver_after %s, handler started %+.1fms after it", names[d.ID], want.Format("15:04:05.000000"), float64(late)/1e6)
		if late < 0 {
			t.Errorf("%s: delivered %s before its deliver_after", names[d.ID], -late)
		}
		if late >= pushLimit {
			t.Errorf("%s: delivered %s after its deliver_after; want < %s with the poll at 1h", names[d.ID], late, pushLimit)
		}
		if d.Attempt != 1 {
			t.Errorf("%s: attempt %d, want 1", names[d.ID], d.Attempt)
		}
	}
}
