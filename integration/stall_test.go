package integration

import (
	"context"
	"encoding/json"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// stallTracer holds back the next claim batch for a while before it is
// sent, once armed: a database that stalls (the chaos soak's SIGSTOP
// freeze) between the dispatcher taking its lease clock and the claim
// running.
type stallTracer struct {
	claimCounter
	stall   time.Duration
	armed   atomic.Bool
	stalled atomic.Int32
}

func (s *stallTracer) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	ctx = s.claimCounter.TraceBatchStart(ctx, c, d)
	for _, q := range d.Batch.QueuedQueries {
		if strings.Contains(q.SQL, claimMarker) && strings.Contains(q.SQL, "queue_messages") && s.armed.CompareAndSwap(true, false) {
			time.Sleep(s.stall) // the stall being simulated
			s.stalled.Add(1)
			break
		}
	}
	return ctx
}

// TestClaimPastLeaseIsReleased: a claim that comes back only after the
// lease it took has run out (the database stalled for longer than the
// visibility timeout less its margin) does not spend the message's
// attempt on a delivery that cannot happen. Before the fix the handler
// started with its context already ended, the attempt was counted without
// the consumer seeing the message, and on its last attempt the message
// was dead-lettered undelivered (the chaos soak saw this after a freeze).
// Now the message is released, attempt refunded, and delivered at once.
func TestClaimPastLeaseIsReleased(t *testing.T) {
	e := newEnv(t)
	const vt = time.Second // the handler's context ends 800ms after the lease clock starts
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "stall", VisibilityTimeout: vt, MaxAttempts: 1})

	var mu sync.Mutex
	var attempts []int
	var ctxDead []bool
	delivered := make(chan struct{}, 4)
	mux := bellhop.NewMux()
	mux.Handle("app", "stall", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		ctxDead = append(ctxDead, ctx.Err() != nil)
		mu.Unlock()
		defer func() { delivered <- struct{}{} }()
		select { // a little work, which a dead context interrupts
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(50 * time.Millisecond):
			return nil
		}
	}))
	tr := &stallTracer{stall: vt + 200*time.Millisecond}
	logs := &syncBuffer{}
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour,
		Logger: zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t)))},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
	// Let the post-connect wake scan finish (it wakes no lane: the queue
	// is empty), so that the stall hits the claim of the message below.
	waitFor(t, 5*time.Second, "the post-connect wake scan", func() bool { return tr.scans.Load() >= 1 })

	tr.armed.Store(true)
	id := e.enqueue(t, "stall", map[string]int{"n": 1}, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the stalled claim", func() bool { return tr.stalled.Load() == 1 })
	waitFor(t, 10*time.Second, "the message settled", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	if d, dead := e.deadLetterOf(t, id); dead {
		t.Fatalf("dead-lettered (attempt %d of %d: %s): the stalled claim spent its only attempt", d.Attempt, d.Max, d.LastError)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 1 || attempts[0] != 1 || ctxDead[0] {
		t.Errorf("handler calls: attempts %v, context already ended %v; want one live call on attempt 1", attempts, ctxDead)
	}
	// The warning names the message as finish's lines do: source and
	// consumer_id were missing.
	const msg = "the claim returned after the lease had run out; releasing the message undelivered"
	var warning map[string]any
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var l map[string]any
		if err := json.Unmarshal([]byte(line), &l); err == nil && l["message"] == msg {
			warning = l
		}
	}
	for field, want := range map[string]any{
		"level": "warn", "app_id": cons.AppID.String(), "queue": "stall", "source": "queue",
		"consumer_id": cons.ID.String(), "message_id": id.String(), "attempt": float64(1),
	} {
		if got, ok := warning[field]; !ok || got != want {
			t.Errorf("%s = %v, want %v, in the warning %v", field, got, want, warning)
		}
	}
}
