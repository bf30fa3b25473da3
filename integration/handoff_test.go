package integration

import (
	"context"
	"fmt"
	"math"
	"slices"
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
// hand-overs (handedAt, when each started), and holds back its nacks while
// gate is set, until gate is closed.
type handoffTracer struct {
	claimCounter
	invoke    atomic.Int64
	handOvers atomic.Int64
	gate      atomic.Pointer[chan struct{}]
	mu        sync.Mutex
	handedAt  []time.Time
}

func (h *handoffTracer) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, handOverSQL) {
		h.mu.Lock()
		h.handedAt = append(h.handedAt, time.Now())
		h.mu.Unlock()
		h.handOvers.Add(1)
	}
	return h.claimCounter.TraceQueryStart(ctx, c, d)
}

// handOverTimes returns when each hand-over so far started.
func (h *handoffTracer) handOverTimes() []time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]time.Time(nil), h.handedAt...)
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
	// held and runs until the test ends. Other failing payloads
	// (newHandoffFailing) do as "fail" does, each with its own gate and
	// retry delay, kept in fails by payload; those of handoffOpts.holds
	// hold their later attempts as "hold" does.
	fail    chan struct{}
	fails   map[string]failing
	first   chan struct{} // a failing message's first attempt started on A
	retried chan int      // attempts of a "fail" message after its first, on A
	held    atomic.Int32
	release func()    // ends the "hold" messages' handlers
	b       *recorder // B's deliveries
	trB     *claimCounter
	noMarks bool // A and B run with DisableBusyMarks
}

// failing is how A's handler fails a message's first attempt: once gate
// is closed, with RetryAfter(retry). With hold, its later attempts do as
// "hold" does.
type failing struct {
	gate  chan struct{}
	retry time.Duration
	hold  bool
}

// handoffOpts is what newHandoffWith sets up.
type handoffOpts struct {
	retries map[string]time.Duration // failing payloads, with their retry delays
	holds   []string                 // failing payloads whose later attempts are held
	noMarks bool                     // A and B run with DisableBusyMarks
}

// newHandoff starts A; startB starts B.
func newHandoff(t *testing.T, retry time.Duration) *handoff {
	t.Helper()
	return newHandoffFailing(t, map[string]time.Duration{"fail": retry})
}

// newHandoffFailing is newHandoff with one failing payload per entry of
// retries, each failing with its own delay once its gate (h.fails) is
// closed; h.fail is the gate of "fail", if there is one.
func newHandoffFailing(t *testing.T, retries map[string]time.Duration) *handoff {
	t.Helper()
	return newHandoffWith(t, handoffOpts{retries: retries})
}

// newHandoffWith is newHandoff as o says.
func newHandoffWith(t *testing.T, o handoffOpts) *handoff {
	t.Helper()
	h := &handoff{e: newEnv(t), trA: &handoffTracer{}, fails: make(map[string]failing), first: make(chan struct{}, len(o.retries)),
		retried: make(chan int, 4), b: &recorder{}, trB: &claimCounter{}, noMarks: o.noMarks}
	for payload, retry := range o.retries {
		h.fails[`"`+payload+`"`] = failing{gate: make(chan struct{}), retry: retry, hold: slices.Contains(o.holds, payload)}
	}
	h.fail = h.fails[`"fail"`].gate
	h.cons = h.e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 2})
	release := make(chan struct{})
	var once sync.Once
	h.release = func() { once.Do(func() { close(release) }) }
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		switch {
		case string(m.Payload) == `"hold"` || m.Attempt > 1 && h.fails[string(m.Payload)].hold:
			h.held.Add(1)
			<-release
			return nil
		case m.Attempt > 1:
			h.retried <- m.Attempt
			return nil
		}
		f, ok := h.fails[string(m.Payload)]
		if !ok {
			return bellhop.Permanent(fmt.Errorf("unexpected payload %s", m.Payload))
		}
		h.first <- struct{}{}
		<-f.gate
		return bellhop.RetryAfter(f.retry)
	}))
	startDispatcher(t, h.e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, LeaseAtInsert: true,
		DisableBusyMarks: o.noMarks}, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = h.trA })
	// Before A's stop, which waits for its handlers.
	t.Cleanup(h.release)
	return h
}

func (h *handoff) startB(t *testing.T) {
	t.Helper()
	mux := bellhop.NewMux()
	mux.Handle("app", "q", h.b)
	startDispatcher(t, h.e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, DisableBusyMarks: h.noMarks},
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
	h.leased(t, "hold")
}

// leased is lease for a message of payload, whose id it returns.
func (h *handoff) leased(t *testing.T, payload string) uuid.UUID {
	t.Helper()
	waitFor(t, 5*time.Second, "A's offer", func() bool {
		return h.e.count(t, `SELECT count(*) FROM bellhop_offers`) == 1
	})
	id := h.e.enqueue(t, "q", payload, bellhop.EnqueueOptions{})
	if h.e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id) != 1 {
		t.Fatal("the message was not leased at INSERT")
	}
	return id
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
	h.handedOverAtDue(t, id, "queue_messages")
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
	h.handedOverAtDue(t, id, "outbox")
}

// handedOverAtDue runs the timer case of the two tests above for message
// id of table (queue_messages, or outbox for an invoke delivery): A's
// first attempt fails once B is up, A's pass after the nack arms its
// timer with a slot free, A's slots are then filled, and B must deliver
// the retry as the timer fires.
func (h *handoff) handedOverAtDue(t *testing.T, id uuid.UUID, table string) {
	t.Helper()
	// The claim passes of the lane that nacks: A's queue or invoke lane.
	passes := func() int64 {
		q, i := h.quietA(t)
		if table == "outbox" {
			return i
		}
		return q
	}
	h.waitFirst(t)
	h.startB(t)
	before := passes()
	close(h.fail)
	due := h.nacked(t, table, id)
	// The pass the nack asks for has run, with a slot free: A's timer is
	// armed for the retry, and the hand-over comes from its firing.
	waitFor(t, 5*time.Second, "A's pass after the nack", func() bool { return passes() > before })
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

// handOffEvery is lane.go's: the least time between two hand-overs of a
// lane.
const handOffEvery = time.Second

// TestHandOffsRateLimited: a failing consumer with a backlog finds its
// slots taken by the next messages at nearly every pass a nack asks for,
// each of which owes the other dispatchers a hand-over; a lane sends at
// most one each handOffEvery. Before that limit, a scratch test of 3,000
// such messages counted 515 hand-overs, each a notification that wakes
// every dispatcher's lane.
func TestHandOffsRateLimited(t *testing.T) {
	const n = 1500
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 10, MaxAttempts: 100})
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, max_attempts)
		SELECT id, 'q', '{}', 100 FROM apps, generate_series(1, $1::int)`, n); err != nil {
		t.Fatal(err)
	}
	var delivered, again atomic.Int64
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		// Every message's retry is an hour away: more deliveries than
		// messages are repeats.
		if delivered.Add(1) > n {
			again.Add(1)
		}
		time.Sleep(5 * time.Millisecond) // a handler's work
		return bellhop.RetryAfter(time.Hour)
	}))
	tr := &handoffTracer{}
	start := time.Now()
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
	// Until every nack is written: the hand-overs come from the passes
	// the nacks ask for.
	waitFor(t, 60*time.Second, "every message delivered and nacked", func() bool {
		return delivered.Load() >= n &&
			e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL AND deliver_after > now() + interval '30 minutes'`) == n
	})
	elapsed := time.Since(start)
	handOvers := tr.handOvers.Load()
	t.Logf("%d messages delivered and nacked in %s, with %d hand-overs", n, elapsed.Round(time.Millisecond), handOvers)
	if again.Load() > 0 {
		t.Errorf("%d messages delivered again, though their retries are an hour away", again.Load())
	}
	if limit := 2 + int64(math.Ceil(elapsed.Seconds()/handOffEvery.Seconds())); handOvers > limit {
		t.Errorf("%d hand-overs in %s, want at most %d: one each %s", handOvers, elapsed.Round(time.Millisecond), limit, handOffEvery)
	}
}

// TestOwedHandOffSent: A's slots are taken when the passes two nacks ask
// for run, within the same second. The first pass hands the queue over
// at once, and B arms its timer for the first retry, due late; the second
// owes a hand-over, which the rate limit holds back until the second
// ends: A, still full then, sends it, and B, reading the due times again,
// delivers the second retry, due well before the first, on time. Were the
// owed hand-over dropped, B would find the second retry only when its
// timer for the first fired, or, when A's busy mark had B watching it, at
// the mark's end (up to a BusyLease after the retry's due time, so maybe
// within pushLimit): A's count of hand-overs tells that case apart.
func TestOwedHandOffSent(t *testing.T) {
	h := newHandoffFailing(t, map[string]time.Duration{"fail": 5 * time.Second, "soon": 1500 * time.Millisecond})
	x := h.e.enqueue(t, "q", "fail", bellhop.EnqueueOptions{})
	y := h.e.enqueue(t, "q", "soon", bellhop.EnqueueOptions{})
	h.waitFirst(t)
	h.waitFirst(t)
	h.startB(t)

	// X fails; its freed slot goes to a message leased to A before its
	// nack is written, so the pass the nack asks for finds A full.
	gate := make(chan struct{})
	h.trA.gate.Store(&gate)
	close(h.fail)
	h.lease(t)
	waitFor(t, 5*time.Second, "the leased message takes X's slot", func() bool { return h.held.Load() == 1 })
	// B's claim passes so far (on A's busy mark, say) are over: the next
	// is the one on the hand-over.
	h.trB.waitQuiet(t, 10*time.Second, 100*time.Millisecond, "B's claims to end")
	bClaims := h.trB.n.Load()
	close(gate)
	dueX := h.nacked(t, "queue_messages", x)
	waitFor(t, 5*time.Second, "A's first hand-over", func() bool { return h.trA.handOvers.Load() == 1 })
	first := h.trA.handOverTimes()[0]
	// B's pass on it has read X's due time, and Y's nack is not yet
	// written: B's timer is armed for X.
	waitFor(t, 5*time.Second, "B's pass on the hand-over", func() bool {
		n := h.trB.n.Load()
		return n > bClaims && h.trB.ended.Load() == n
	})

	// The same for Y, within the second.
	gate = make(chan struct{})
	h.trA.gate.Store(&gate)
	close(h.fails[`"soon"`].gate)
	h.lease(t)
	waitFor(t, 5*time.Second, "the leased message takes Y's slot", func() bool { return h.held.Load() == 2 })
	since := time.Since(first)
	if since >= handOffEvery {
		t.Fatalf("inconclusive: Y's nack was let through %s after A's first hand-over, which a second one then need not wait for",
			since.Round(time.Millisecond))
	}
	t.Logf("Y's nack let through %s after A's first hand-over", since.Round(time.Millisecond))
	close(gate)
	dueY := h.nacked(t, "queue_messages", y)
	if dueY.Add(3 * pushLimit).After(dueX) {
		t.Fatalf("inconclusive: Y is due at %s, X at %s: too close to tell B's timers apart", dueY, dueX)
	}

	// B's deliveries of Y's retry: its first claim after X's due time
	// would take both, X's first, were Y's due time not handed over.
	ofY := func() (delivery, bool) {
		for _, d := range h.b.deliveries() {
			if d.ID == y {
				return d, true
			}
		}
		return delivery{}, false
	}
	deadline := dueX.Add(5 * time.Second)
	d, ok := ofY()
	for !ok && len(h.retried) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
		d, ok = ofY()
	}
	if len(h.retried) > 0 {
		t.Fatal("A delivered a retry, with its slots all taken")
	}
	if !ok {
		t.Fatal("B did not deliver Y's retry within 5s of X's due time")
	}
	if d.Attempt != 2 {
		t.Fatalf("B delivered Y's attempt %d, want 2", d.Attempt)
	}
	late := d.Start.Sub(dueY)
	t.Logf("B delivered Y %s after its due time (X is due %s after Y)", late.Round(time.Millisecond), dueX.Sub(dueY).Round(time.Millisecond))
	if late > pushLimit {
		t.Errorf("B delivered Y %s after its due time, though A owed it a hand-over %s before", late.Round(time.Millisecond),
			dueY.Sub(first.Add(handOffEvery)).Round(time.Millisecond))
	}
	handed := h.trA.handOverTimes()
	if len(handed) != 2 {
		t.Fatalf("A handed over %d times by Y's delivery, want 2: at X's nack, and for Y's once the second ended", len(handed))
	}
	if gap := handed[1].Sub(handed[0]); gap < handOffEvery {
		t.Errorf("A's second hand-over came %s after its first, want at least %s", gap.Round(time.Millisecond), handOffEvery)
	}
	// A, still full, sends no more: its own notifications leave nothing
	// owed, and no timer of its is armed for X.
	holdsFor(t, 300*time.Millisecond, "A's two hand-overs", func() bool { return h.trA.handOvers.Load() == 2 })
}

// TestFillingClaimKeepsNextDue: A nacks R1 and R2, R2 due well after R1:
// both due times are A's alone. One of A's slots is then taken by a
// leased message, and at R1's due time A's timer fires and its claim
// takes R1's retry (which runs until the test ends), filling A's slots.
// That claim also read R2's due time: A, full, arms its timer for it, and
// as it fires hands the queue over, and B, idle, delivers R2 on time. A
// claim that filled the slots used to drop the due time it read, and the
// next round, finding no free slot, armed nothing and owed nothing: R2
// waited for a slot on A or for B's poll. Queue lanes, with busy marks
// (a lane not yet marked busy: R2 is leased at INSERT, with no claim
// pass to make a stream with R1's) and without, and invoke lanes.
func TestFillingClaimKeepsNextDue(t *testing.T) {
	for _, tc := range []struct {
		name            string
		invoke, noMarks bool
	}{
		{"queue", false, false},
		{"queue-nomarks", false, true},
		{"invoke", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHandoffWith(t, handoffOpts{
				retries: map[string]time.Duration{"r1": 1500 * time.Millisecond, "r2": 4 * time.Second},
				holds:   []string{"r1"}, noMarks: tc.noMarks})
			table := "queue_messages"
			var r1, r2 uuid.UUID
			if tc.invoke {
				table = "outbox"
				var err error
				if r1, err = h.e.client.InvokeAsync(context.Background(), h.cons.ID, []byte(`"r1"`), bellhop.EnqueueOptions{}); err != nil {
					t.Fatal(err)
				}
				if r2, err = h.e.client.InvokeAsync(context.Background(), h.cons.ID, []byte(`"r2"`), bellhop.EnqueueOptions{}); err != nil {
					t.Fatal(err)
				}
				h.waitFirst(t)
				h.waitFirst(t)
			} else {
				r1 = h.e.enqueue(t, "q", "r1", bellhop.EnqueueOptions{})
				h.waitFirst(t)
				r2 = h.leased(t, "r2")
				h.waitFirst(t)
			}
			h.startB(t)
			close(h.fails[`"r1"`].gate)
			close(h.fails[`"r2"`].gate)
			due1, due2 := h.nacked(t, table, r1), h.nacked(t, table, r2)
			// The passes the nacks asked for have run, with slots free:
			// A's timer is armed for R1.
			h.quietA(t)
			h.lease(t)
			waitFor(t, 5*time.Second, "A delivers the leased message", func() bool { return h.held.Load() == 1 })
			if !time.Now().Before(due1) {
				t.Fatal("inconclusive: the set-up ran past R1's due time")
			}
			waitFor(t, time.Until(due1)+5*time.Second, "A's claim of R1's retry, which fills its slots", func() bool {
				if n := h.b.n.Load(); n > 0 {
					t.Fatalf("inconclusive: B delivered %s first", h.b.deliveries()[0].ID)
				}
				return h.held.Load() == 2
			})
			h.expectB(t, r2, due2)
		})
	}
}

// TestNackAfterReplaceHandedOver: A's consumer is replaced while A runs
// its handler's first attempt, and the lane serving the queue now has all
// its slots taken when the nack is written. The nack wakes that lane
// (pokeServing) for the pass it asks for, which cannot read the retry's
// due time: the lane hands the queue over, as the nacking lane would
// have, and B delivers the retry on time. The wake-up used to be a plain
// poke, which owed nothing.
func TestNackAfterReplaceHandedOver(t *testing.T) {
	h := newHandoff(t, time.Second)
	ctx := context.Background()
	waitFor(t, 10*time.Second, "A's wake scan after connecting", func() bool { return h.trA.scans.Load() == 1 })
	id := h.e.enqueue(t, "q", "fail", bellhop.EnqueueOptions{})
	h.waitFirst(t)
	if err := h.e.client.RemoveConsumer(ctx, "app", h.cons.ID); err != nil {
		t.Fatal(err)
	}
	h.cons = h.e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 2})
	waitFor(t, 10*time.Second, "A's wake scan after the reload", func() bool { return h.trA.scans.Load() == 2 })
	h.e.enqueue(t, "q", "hold", bellhop.EnqueueOptions{})
	h.e.enqueue(t, "q", "hold", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "A's new lane delivers both held messages", func() bool { return h.held.Load() == 2 })
	h.startB(t)
	close(h.fail)
	due := h.nacked(t, "queue_messages", id)
	h.expectB(t, id, due)
}

// TestSaturatedHandOversBounded: a healthy lane kept full by a ready
// backlog, with delayed messages coming due every 10ms meanwhile. Its
// claims fill its slots and read due times it has no slot for: the lane
// arms its timer for each, and as each is reached with the slots still
// full, it owes the other dispatchers a hand-over, which it sends at most
// once each handOffEvery (a scratch run counted 3 in 3s, against 0 when
// a filling claim dropped the due time it read).
func TestSaturatedHandOversBounded(t *testing.T) {
	const ready, delayed = 2000, 300
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "q", MaxInFlight: 10})
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload)
		SELECT id, 'q', '{}' FROM apps, generate_series(1, $1::int)`, ready); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, deliver_after)
		SELECT id, 'q', '{}', now() + g * interval '10 milliseconds' FROM apps, generate_series(1, $1::int) g`, delayed); err != nil {
		t.Fatal(err)
	}
	var n atomic.Int64
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		n.Add(1)
		time.Sleep(5 * time.Millisecond) // a handler's work
		return nil
	}))
	tr := &handoffTracer{}
	start := time.Now()
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
	waitFor(t, 120*time.Second, "every message delivered", func() bool { return n.Load() >= ready+delayed })
	elapsed := time.Since(start)
	handOvers := tr.handOvers.Load()
	t.Logf("%d messages delivered in %s, with %d hand-overs and %d claim passes", n.Load(), elapsed.Round(time.Millisecond),
		handOvers, tr.n.Load())
	if limit := 2 + int64(math.Ceil(elapsed.Seconds()/handOffEvery.Seconds())); handOvers > limit {
		t.Errorf("%d hand-overs in %s, want at most %d: one each %s", handOvers, elapsed.Round(time.Millisecond), limit, handOffEvery)
	}
}

// servedResolver resolves every consumer that serve accepts to h, and
// records each consumer a reload resolved, and how often: a test knows
// that the dispatcher has read a change once it has resolved the consumer
// since (a reload applies what it resolved under the lock that routes
// notifications).
type servedResolver struct {
	h     bellhop.Handler
	serve func(bellhop.Consumer) bool
	mu    sync.Mutex
	seen  map[uuid.UUID]int
}

func newServedResolver(h bellhop.Handler, serve func(bellhop.Consumer) bool) *servedResolver {
	return &servedResolver{h: h, serve: serve, seen: map[uuid.UUID]int{}}
}

func (r *servedResolver) Resolve(c bellhop.Consumer) bellhop.Handler {
	r.mu.Lock()
	r.seen[c.ID]++
	r.mu.Unlock()
	if !r.serve(c) {
		return nil
	}
	return r.h
}

// resolved returns how many reloads resolved consumer id.
func (r *servedResolver) resolved(id uuid.UUID) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seen[id]
}

// expectRetryOn waits for b's delivery of message id's second attempt,
// which must come within pushLimit of its due time, and checks that a
// handed it over once.
func expectRetryOn(t *testing.T, b *recorder, trA *handoffTracer, id uuid.UUID, due time.Time) {
	t.Helper()
	waitFor(t, time.Until(due)+5*time.Second, "B's delivery of the retry", func() bool { return b.n.Load() > 0 })
	d := b.deliveries()[0]
	if d.ID != id || d.Attempt != 2 {
		t.Fatalf("B delivered %s attempt %d, want %s attempt 2", d.ID, d.Attempt, id)
	}
	t.Logf("B delivered the retry %s after its due time", d.Start.Sub(due).Round(time.Millisecond))
	if late := d.Start.Sub(due); late > pushLimit {
		t.Errorf("B delivered the retry %s after its due time, though it was idle", late.Round(time.Millisecond))
	}
	holdsFor(t, 300*time.Millisecond, "A's single hand-over", func() bool { return trA.handOvers.Load() == 1 })
}

// TestNackAfterReplaceByPushHandedOver: a Go handler's consumer, served
// by dispatcher A, is replaced by a push consumer, which A does not serve
// and B does (as `bellhop run` serves URL consumers), while A's handler
// runs; the handler then fails with RetryAfter(200ms). No lane of A serves
// the queue now, so A wakes every dispatcher for it, and B delivers the
// retry on time. A did nothing (pokeServing found no lane), and B, idle,
// found the retry at its fallback poll (never, with an hour's).
func TestNackAfterReplaceByPushHandedOver(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	old := e.consumer(t, bellhop.ConsumerSpec{Queue: "q"})
	first := make(chan struct{}, 1)
	fail := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(fail) }) }) // before A's stop, should the test fail
	goHandler := bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		first <- struct{}{}
		<-fail
		return bellhop.RetryAfter(200 * time.Millisecond)
	})
	rA := newServedResolver(goHandler, func(c bellhop.Consumer) bool { return c.URL == "" })
	trA, id := startA(t, e, rA, first)

	b := &recorder{}
	rB := newServedResolver(b, func(c bellhop.Consumer) bool { return c.URL != "" })
	trB := startIdleB(t, e, rB)
	if err := e.client.RemoveConsumer(ctx, "app", old.ID); err != nil {
		t.Fatal(err)
	}
	push := e.consumer(t, bellhop.ConsumerSpec{Queue: "q", URL: "http://consumer.test/hook"})
	waitFor(t, 10*time.Second, "A's reload, which stops the old consumer's lanes", func() bool { return rA.resolved(push.ID) > 0 })
	// B's reload starts the push consumer's lanes and ends with a wake
	// scan, which finds nothing: the message is still leased to A.
	waitFor(t, 10*time.Second, "B's wake scan after its reload", func() bool {
		return trB.scans.Load() == 2 && trB.ended.Load() == trB.n.Load()
	})
	if n := trA.handOvers.Load(); n != 0 {
		t.Fatalf("A handed over %d times before the nack", n)
	}

	once.Do(func() { close(fail) })
	waitFor(t, 10*time.Second, "A's nack", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id) == 1
	})
	var due time.Time
	if err := e.pool.QueryRow(ctx, `SELECT deliver_after FROM queue_messages WHERE id = $1`, id).Scan(&due); err != nil {
		t.Fatal(err)
	}
	expectRetryOn(t, b, trA, id, due)
}

// TestStoppedTimedLaneHandedOver: dispatcher A nacks a message with
// RetryAfter(2s) and arms its lane's timer for the retry; then a reload
// stops A serving the consumer (its Resolver returns nil), while B, which
// serves it too, is idle. As A tidies the stopped lane up, it wakes every
// dispatcher for the queue, and B delivers the retry on time. Only the
// stop of a dispatcher handed a lane's due time over, and B found the
// retry at its fallback poll (never, with an hour's).
func TestStoppedTimedLaneHandedOver(t *testing.T) {
	e := newEnv(t)
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "q"})
	first := make(chan struct{}, 1)
	fail := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(fail) }) })
	var off atomic.Bool
	rA := newServedResolver(bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		if m.Attempt > 1 {
			return bellhop.Permanent(fmt.Errorf("A delivered attempt %d", m.Attempt))
		}
		first <- struct{}{}
		<-fail
		return bellhop.RetryAfter(2 * time.Second)
	}), func(bellhop.Consumer) bool { return !off.Load() })
	trA, id := startA(t, e, rA, first)
	b := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "q", b)
	startIdleB(t, e, mux)

	before := trA.queue.Load()
	once.Do(func() { close(fail) })
	waitFor(t, 10*time.Second, "A's nack", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id) == 1
	})
	var due time.Time
	if err := e.pool.QueryRow(context.Background(), `SELECT deliver_after FROM queue_messages WHERE id = $1`, id).Scan(&due); err != nil {
		t.Fatal(err)
	}
	// The pass the nack asks for reads the retry's due time and arms A's
	// timer for it.
	waitFor(t, 5*time.Second, "A's pass after the nack", func() bool {
		return trA.queue.Load() > before && trA.ended.Load() == trA.n.Load()
	})
	k := rA.resolved(cons.ID)
	off.Store(true)
	notifyConsumers(t, e)
	waitFor(t, 5*time.Second, "A's reload, which stops the consumer's lanes", func() bool { return rA.resolved(cons.ID) > k })
	if !time.Now().Before(due) {
		t.Fatal("inconclusive: the set-up ran past the retry's due time")
	}
	expectRetryOn(t, b, trA, id, due)
}

// startA starts dispatcher A of a hand-over test, serving with r and
// counting its hand-overs, enqueues a message to queue q and waits for
// A's handler to say on first that it has it.
func startA(t *testing.T, e *env, r bellhop.Resolver, first <-chan struct{}) (*handoffTracer, uuid.UUID) {
	t.Helper()
	tr := &handoffTracer{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: r, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
	id := e.enqueue(t, "q", "x", bellhop.EnqueueOptions{})
	select {
	case <-first:
	case <-time.After(10 * time.Second):
		t.Fatal("A did not deliver the first attempt")
	}
	return tr, id
}

// startIdleB starts dispatcher B of a hand-over test, serving with r,
// and waits for its first wake scan to end: B is idle from then on.
func startIdleB(t *testing.T, e *env, r bellhop.Resolver) *claimCounter {
	t.Helper()
	tr := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: r, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
	waitFor(t, 10*time.Second, "B's wake scan", func() bool { return tr.scans.Load() == 1 && tr.ended.Load() == tr.n.Load() })
	return tr
}
