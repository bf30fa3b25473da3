package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// stallTracer holds back the next claim batch for a while before it is
// sent, once armed: a database that stalls (the chaos soak's SIGSTOP
// freeze) between the dispatcher taking its lease clock and the claim
// running. While hold is set, every other claim batch waits until it is
// closed: the test looks at the messages before they are claimed again.
// released counts the messages that sql/release.sql released.
type stallTracer struct {
	claimCounter
	stall    time.Duration
	armed    atomic.Bool
	stalled  atomic.Int32
	hold     atomic.Pointer[chan struct{}]
	released atomic.Int64
}

// releaseMarker is in sql/release.sql alone: it refunds the attempt.
const releaseMarker = "attempt = greatest(m.attempt - 1, 0)"

func (s *stallTracer) TraceBatchQuery(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.claimCounter.TraceBatchQuery(ctx, c, d)
	if d.Err == nil && strings.Contains(d.SQL, releaseMarker) {
		s.released.Add(d.CommandTag.RowsAffected())
	}
}

func (s *stallTracer) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	ctx = s.claimCounter.TraceBatchStart(ctx, c, d)
	for _, q := range d.Batch.QueuedQueries {
		if strings.Contains(q.SQL, claimMarker) && strings.Contains(q.SQL, "queue_messages") {
			if s.armed.CompareAndSwap(true, false) {
				time.Sleep(s.stall) // the stall being simulated
				s.stalled.Add(1)
			} else if h := s.hold.Load(); h != nil {
				<-*h
			}
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
// Each release is logged at warn with what names the message and what
// explains it (how long the claim took, against which visibility
// timeout), throttled as the lane's other per-message lines: one stall
// can release a whole batch, and a database that keeps stalling, every
// batch.
func TestClaimPastLeaseIsReleased(t *testing.T) {
	e := newEnv(t)
	const (
		vt = time.Second // the handler's context ends 800ms after the lease clock starts
		// the stalled claim's batch: more than the lane's burst of
		// per-message lines at warn (msgLogBurst, 10)
		n = 20
	)
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "stall", VisibilityTimeout: vt, MaxAttempts: 1, MaxInFlight: n})

	var mu sync.Mutex
	attempts := map[uuid.UUID][]int{}
	var ctxDead []bool
	mux := bellhop.NewMux()
	mux.Handle("app", "stall", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		mu.Lock()
		attempts[m.ID] = append(attempts[m.ID], m.Attempt)
		ctxDead = append(ctxDead, ctx.Err() != nil)
		mu.Unlock()
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

	// Claims after the stalled one wait until the released messages are
	// checked.
	hold := make(chan struct{})
	var once sync.Once
	unhold := func() { once.Do(func() { close(hold) }) }
	t.Cleanup(unhold) // before the dispatcher stops
	tr.hold.Store(&hold)
	tr.armed.Store(true)
	// One statement, so one wake: the lane claims all n in one batch,
	// the one stalled.
	batch := make([]bellhop.NewMessage, n)
	for i := range batch {
		batch[i] = bellhop.NewMessage{Queue: "stall", Payload: []byte(fmt.Sprintf(`{"n": %d}`, i))}
	}
	armed := time.Now()
	ids, err := e.client.EnqueueMany(context.Background(), "app", batch)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the stalled claim", func() bool { return tr.stalled.Load() == 1 })
	// Released: claimable at once (not held until the lease would have
	// ended, as a stop's release of a push cut short is), attempt
	// refunded.
	waitFor(t, 10*time.Second, "the messages released", func() bool { return tr.released.Load() == n })
	if got := e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now()) AND attempt = 0`); got != n {
		t.Errorf("%d of %d released messages claimable now with no attempt counted", got, n)
	}
	unhold()
	waitFor(t, 20*time.Second, "the messages settled", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	for _, id := range ids {
		if d, dead := e.deadLetterOf(t, id); dead {
			t.Fatalf("%s dead-lettered (attempt %d of %d: %s): the stalled claim spent its only attempt", id, d.Attempt, d.Max, d.LastError)
		}
	}
	mu.Lock()
	for _, id := range ids {
		if a := attempts[id]; len(a) != 1 || a[0] != 1 {
			t.Errorf("message %s: handler calls on attempts %v, want one on attempt 1", id, a)
		}
	}
	if slices.Contains(ctxDead, true) {
		t.Errorf("handler calls with their context already ended: %v", ctxDead)
	}
	mu.Unlock()

	// Each release is logged once, naming its message as finish's lines
	// do (source and consumer_id were missing), with how long its claim
	// took against the visibility timeout; past the lane's burst, at
	// debug rather than warn.
	const msg = "the claim returned after the lease had run out; releasing the message undelivered"
	released := map[string]int{}
	levels := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var l map[string]any
		if err := json.Unmarshal([]byte(line), &l); err != nil || l["message"] != msg {
			continue
		}
		levels[fmt.Sprint(l["level"])]++
		id, _ := l["message_id"].(string)
		released[id]++
		for field, want := range map[string]any{
			"app_id": cons.AppID.String(), "queue": "stall", "source": "queue",
			"consumer_id": cons.ID.String(), "attempt": float64(1), "visibility_timeout": vt.String(),
		} {
			if got, ok := l[field]; !ok || got != want {
				t.Errorf("%s = %v, want %v, in the line %v", field, got, want, l)
			}
		}
		// The lease clock started before the stall, so the claim took
		// longer than the lease less its margin.
		if took, err := time.ParseDuration(fmt.Sprint(l["claim_took"])); err != nil || took < vt-vt/5 {
			t.Errorf("claim_took = %v, want a duration of at least %s, in the line %v", l["claim_took"], vt-vt/5, l)
		}
	}
	for _, id := range ids {
		if released[id.String()] != 1 {
			t.Errorf("message %s: %d release lines, want 1", id, released[id.String()])
		}
	}
	// msgLogBurst at once, then one a second.
	if limit := 10 + int(time.Since(armed)/time.Second) + 1; levels["warn"] < 10 || levels["warn"] > limit ||
		levels["warn"]+levels["debug"] != n {
		t.Errorf("release lines by level: %v, want %d in all, at warn 10 to %d", levels, n, limit)
	}
}
