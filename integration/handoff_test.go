package integration

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// A retry's due time is known only to the dispatcher that nacked it: a
// nack sends no notification. The tests below fill every slot of that
// dispatcher (A) once the retry is nacked, with messages producers lease
// to its offers at INSERT, which no other dispatcher hears of, while
// another dispatcher (B) serving the consumer is idle, with its fallback
// poll an hour away. A, with no free slot, must hand the retry over: B
// delivers it when it comes due. Before the fix, A's lane gave up at its
// full slots and the retry waited for one of them, or for B's poll (which
// then counted a missed notification, though none was lost).

// nackBatch is in the outcome batch's nack statement alone (sql/nack.sql).
const nackBatch = "AS a(id, token, delay_ms, hold_ms)"

// handOverSQL is in sql/hand_over.sql alone.
const handOverSQL = "pg_notify('bellhop', p)"

// handoffTracer counts A's claim passes, its invoke claims apart, and its
// hand-overs, and holds back its nacks while gate is set, until gate is
// closed.
type handoffTracer struct {
	claimCounter
	invoke    atomic.Int64
	handOvers atomic.Int64
	gate      atomic.Pointer[chan struct{}]
}

func (h *handoffTracer) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, handOverSQL) {
		h.handOvers.Add(1)
	}
	return h.claimCounter.TraceQueryStart(ctx, c, d)
}

func (h *handoffTracer) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if isClaim(q.SQL) && strings.Contains(q.SQL, "FROM outbox AS c") {
			h.invoke.Add(1)
		}
		if g := h.gate.Load(); g != nil && strings.Contains(q.SQL, nackBatch) {
			select {
			case <-*g:
			case <-ctx.Done():
			}
		}
	}
	return h.claimCounter.TraceBatchStart(ctx, c, d)
}

// handoff is the two dispatchers of a consumer of "q" with MaxInFlight 2:
// A leases at INSERT; B does not, and its poll is an hour away.
type handoff struct {
	e    *env
	cons bellhop.Consumer
	trA  *handoffTracer
	// A's handler: a message whose payload is "fail" fails its first
	// attempt with RetryAfter(retry) once fail is closed, and sends its
	// later attempts to retried; one whose payload is "hold" counts in
	// held and runs until the test ends.
	fail    chan struct{}
	first   chan struct{} // a "fail" message's first attempt started on A
	retried chan int      // attempts of a "fail" message after its first, on A
	held    atomic.Int32
	release func()    // ends the "hold" messages' handlers
	b       *recorder // B's deliveries
	trB     *claimCounter
}

// newHandoff starts A; startB starts B.
func newHandoff(t *testing.T, retry time.Duration) *handoff {
	t.Helper()
	h := &handoff{e: newEnv(t), trA: &handoffTracer{}, fail: make(chan struct{}), first: make(chan struct{}, 1),
		retried: make(chan int, 4), b: &recorder{}, trB: &claimCounter{}}
	h.cons = h.e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 2})
	release := make(chan struct{})
	var once sync.Once
	h.release = func() { once.Do(func() { close(release) }) }
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		switch {
		case string(m.Payload) == `"hold"`:
			h.held.Add(1)
			<-release
			return nil
		case m.Attempt > 1:
			h.retried <- m.Attempt
			return nil
		}
		h.first <- struct{}{}
		<-h.fail
		return bellhop.RetryAfter(retry)
	}))
	startDispatcher(t, h.e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, LeaseAtInsert: true},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = h.trA })
	// Before A's stop, which waits for its handlers.
	t.Cleanup(h.release)
	return h
}

func (h *handoff) startB(t *testing.T) {
	t.Helper()
	mux := bellhop.NewMux()
	mux.Handle("app", "q", h.b)
	startDispatcher(t, h.e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = h.trB })
	// B's scan after connecting has run, and found nothing to wake.
	waitFor(t, 10*time.Second, "B's wake scan", func() bool {
		return h.trB.scans.Load() >= 1 && h.trB.ended.Load() == h.trB.n.Load()
	})
}

func (h *handoff) waitFirst(t *testing.T) {
	t.Helper()
	select {
	case <-h.first:
	case <-time.After(10 * time.Second):
		t.Fatal("A did not deliver the first attempt")
	}
}

// lease enqueues a "hold" message while A has an offer out, and checks
// that the producer leased it to A at INSERT.
func (h *handoff) lease(t *testing.T) {
	t.Helper()
	waitFor(t, 5*time.Second, "A's offer", func() bool {
		return h.e.count(t, `SELECT count(*) FROM bellhop_offers`) == 1
	})
	id := h.e.enqueue(t, "q", "hold", bellhop.EnqueueOptions{})
	if h.e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id) != 1 {
		t.Fatal("the message was not leased at INSERT")
	}
}

// fillA fills A's two slots with leased messages.
func (h *handoff) fillA(t *testing.T) {
	t.Helper()
	for i := int32(1); i <= 2; i++ {
		h.lease(t)
		waitFor(t, 5*time.Second, "A delivers the leased message", func() bool { return h.held.Load() == i })
	}
}

// nacked waits for the nack of message id in table (queue_messages or
// outbox) and returns its due time.
func (h *handoff) nacked(t *testing.T, table string, id uuid.UUID) time.Time {
	t.Helper()
	waitFor(t, 10*time.Second, "A's nack", func() bool {
		return h.e.count(t, `SELECT count(*) FROM `+table+` WHERE id = $1 AND claim_token IS NULL`, id) == 1
	})
	var due time.Time
	if err := h.e.pool.QueryRow(context.Background(), `SELECT deliver_after FROM `+table+` WHERE id = $1`, id).Scan(&due); err != nil {
		t.Fatal(err)
	}
	return due
}

// quietA waits until A runs no claim pass, and returns how many it ran.
func (h *handoff) quietA(t *testing.T) (queue, invoke int64) {
	t.Helper()
	waitFor(t, 5*time.Second, "A's claims to end", func() bool { return h.trA.ended.Load() == h.trA.n.Load() })
	return h.trA.queue.Load(), h.trA.invoke.Load()
}

// expectB checks that B, not A, delivers message id's second attempt
// within pushLimit of its due time, though A's slots are all taken, and
// that A handed over once: its own notification, which finds no free slot
// either, does not make it hand over again, and again.
func (h *handoff) expectB(t *testing.T, id uuid.UUID, due time.Time) {
	t.Helper()
	if h.held.Load() != 2 {
		t.Fatalf("A runs %d held messages, want 2: its slots are not all taken", h.held.Load())
	}
	deadline := due.Add(5 * time.Second)
	for h.b.n.Load() == 0 && len(h.retried) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	switch {
	case h.b.n.Load() > 0:
		d := h.b.deliveries()[0]
		if d.ID != id || d.Attempt != 2 {
			t.Fatalf("B delivered %s attempt %d, want %s attempt 2", d.ID, d.Attempt, id)
		}
		t.Logf("B delivered the retry %s after its due time", d.Start.Sub(due).Round(time.Millisecond))
		if late := d.Start.Sub(due); late > pushLimit {
			t.Errorf("B delivered the retry %s after its due time, though it was idle", late.Round(time.Millisecond))
		}
		holdsFor(t, 300*time.Millisecond, "A's single hand-over", func() bool { return h.trA.handOvers.Load() == 1 })
	case len(h.retried) > 0:
		t.Errorf("A delivered the retry, with its slots all taken")
	default:
		t.Errorf("nobody delivered the retry within 5s of its due time: A's slots were taken, and B was never told")
	}
}

// TestRetryHandedOverByFullNacker: A nacks a queue message, arms its
// timer for the retry, and then has its slots filled by leased messages.
// When the timer fires, A hands the queue over, and B delivers the retry.
// The fill must be done before the retry is due, hence the 3s.
func TestRetryHandedOverByFullNacker(t *testing.T) {
	h := newHandoff(t, 3*time.Second)
	id := h.e.enqueue(t, "q", "fail", bellhop.EnqueueOptions{})
	h.waitFirst(t)
	h.startB(t)
	queue, _ := h.quietA(t)
	close(h.fail)
	due := h.nacked(t, "queue_messages", id)
	// The pass the nack asks for has run, with a slot free: A's timer is
	// armed for the retry, and the hand-over comes from its firing.
	waitFor(t, 5*time.Second, "A's pass after the nack", func() bool {
		q, _ := h.quietA(t)
		return q > queue
	})
	h.fillA(t)
	if !time.Now().Before(due) {
		t.Fatal("inconclusive: the set-up ran past the retry's due time")
	}
	h.expectB(t, id, due)
}

// TestInvokeRetryHandedOverByFullNacker: as TestRetryHandedOverByFullNacker,
// for an invoke_async delivery, whose retry A knows alone just the same,
// with A's slots filled by its consumer's queue messages: A hands the
// consumer's invoke deliveries over.
func TestInvokeRetryHandedOverByFullNacker(t *testing.T) {
	h := newHandoff(t, 3*time.Second)
	id, err := h.e.client.InvokeAsync(context.Background(), h.cons.ID, []byte(`"fail"`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	h.waitFirst(t)
	h.startB(t)
	_, invoke := h.quietA(t)
	close(h.fail)
	due := h.nacked(t, "outbox", id)
	waitFor(t, 5*time.Second, "A's invoke pass after the nack", func() bool {
		_, i := h.quietA(t)
		return i > invoke
	})
	h.fillA(t)
	if !time.Now().Before(due) {
		t.Fatal("inconclusive: the set-up ran past the retry's due time")
	}
	h.expectB(t, id, due)
}

// TestRetryHandedOverByNackWithoutSlot: A's slots are already all taken
// when its nack is written, so the pass the nack asks for cannot read the
// retry's due time and A arms no timer for it: that pass hands the queue
// over, and B arms its own. One slot holds an invoke delivery; the
// failing message's slot goes, as it frees, to a message leased to A
// meanwhile, before the nack is let through.
func TestRetryHandedOverByNackWithoutSlot(t *testing.T) {
	h := newHandoff(t, time.Second)
	id := h.e.enqueue(t, "q", "fail", bellhop.EnqueueOptions{})
	h.waitFirst(t)
	waitFor(t, 5*time.Second, "A's offer", func() bool {
		return h.e.count(t, `SELECT count(*) FROM bellhop_offers`) == 1
	})
	if _, err := h.e.client.InvokeAsync(context.Background(), h.cons.ID, []byte(`"hold"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "A delivers the invoke delivery", func() bool { return h.held.Load() == 1 })
	// The offer A made while it had a slot free is still out: this one
	// waits for a slot.
	h.lease(t)
	h.startB(t)
	gate := make(chan struct{})
	h.trA.gate.Store(&gate)
	close(h.fail)
	waitFor(t, 5*time.Second, "the leased message takes the freed slot", func() bool { return h.held.Load() == 2 })
	close(gate)
	due := h.nacked(t, "queue_messages", id)
	h.expectB(t, id, due)
}

// TestRetryAfterHandOverAlone: with A alone, its hand-over wakes only its
// own lane, which finds no free slot either: A hands over once, not again
// and again, and delivers the retry as soon as a slot frees, its timer
// having fired already.
func TestRetryAfterHandOverAlone(t *testing.T) {
	h := newHandoff(t, 2*time.Second)
	id := h.e.enqueue(t, "q", "fail", bellhop.EnqueueOptions{})
	h.waitFirst(t)
	queue, _ := h.quietA(t)
	close(h.fail)
	due := h.nacked(t, "queue_messages", id)
	waitFor(t, 5*time.Second, "A's pass after the nack", func() bool {
		q, _ := h.quietA(t)
		return q > queue
	})
	h.fillA(t)
	if !time.Now().Before(due) {
		t.Fatal("inconclusive: the set-up ran past the retry's due time")
	}
	waitFor(t, time.Until(due)+5*time.Second, "A's hand-over", func() bool { return h.trA.handOvers.Load() > 0 })
	holdsFor(t, 300*time.Millisecond, "A's single hand-over, and no retry without a slot", func() bool {
		return h.trA.handOvers.Load() == 1 && len(h.retried) == 0
	})
	freed := time.Now()
	h.release()
	select {
	case <-h.retried:
		if wait := time.Since(freed); wait > pushLimit {
			t.Errorf("A delivered the retry %s after its slots were freed", wait.Round(time.Millisecond))
		}
	case <-time.After(5 * time.Second):
		t.Fatal("A did not deliver the retry within 5s of its slots being freed")
	}
}
