package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestNackAfterReplaceIsRetriedOnTime: a consumer replaced (removed and
// registered again) while a handler of the old one runs, which then fails
// with RetryAfter(200ms). nack.sql sends no notification, and the old lane
// is stopped, so the lane serving the queue now is poked instead: the
// retry comes on time. It used to come at the fallback poll (never, with
// an hour's).
func TestNackAfterReplaceIsRetriedOnTime(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	old := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		if m.Attempt == 1 {
			started <- struct{}{}
			select {
			case <-release:
			case <-ctx.Done():
			}
			return bellhop.RetryAfter(200 * time.Millisecond)
		}
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	cc := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = cc })
	waitFor(t, 10*time.Second, "the wake scan after connecting", func() bool { return cc.scans.Load() == 1 })

	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("first attempt not delivered")
	}
	if err := e.client.RemoveConsumer(ctx, "app", old.ID); err != nil {
		t.Fatal(err)
	}
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	// The new consumer's reload ends with a wake scan, which finds nothing
	// unclaimed: the message is still leased to the old consumer's handler.
	waitFor(t, 10*time.Second, "the wake scan after the new consumer's reload", func() bool { return cc.scans.Load() == 2 })
	close(release)
	waitFor(t, 10*time.Second, "the nack written", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL AND deliver_after IS NOT NULL`) == 1
	})
	waitFor(t, 5*time.Second, "the retry, due 200ms after its nack", func() bool { return rec.n.Load() == 2 })
}

// lateProducerAcrossChange runs a busy queue (one slot, three messages:
// the dispatcher holds the queue's busy key, so producers' WHEN clauses
// queue no notification; "second" is held until unblock is called or the
// test ends) while a producer inserts and does not commit. change then
// gives up the lane's key and mark, and must return once the queue is
// served again; the serving lane's first pass delivers "third" (or, when
// change lets the busy lane drain, the busy lane did). Only then does the
// producer commit, unless change has called commit already, and its
// message must be delivered with the fallback poll at an hour.
func lateProducerAcrossChange(t *testing.T, tweak func(*pgxpool.Config),
	change func(e *env, cons bellhop.Consumer, unblock func(), commit func())) {
	e := newEnv(t)
	ctx := context.Background()
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 1})
	unblock := make(chan struct{})
	var done sync.Map
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		// "first" returns at once: its finish wakes the busy lane, whose
		// next pass takes the busy key and claims "second", which waits.
		if string(m.Payload) == `"second"` {
			select {
			case <-unblock:
			case <-ctx.Done():
			}
		}
		done.Store(string(m.Payload), true)
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, tweak)
	var once sync.Once
	release := func() { once.Do(func() { close(unblock) }) }
	t.Cleanup(release)
	if _, err := e.client.EnqueueMany(ctx, "app", []bellhop.NewMessage{
		{Queue: "orders", Payload: []byte(`"first"`)},
		{Queue: "orders", Payload: []byte(`"second"`)},
		{Queue: "orders", Payload: []byte(`"third"`)},
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the busy key held", func() bool { return e.count(t, busyKeyHeld, "orders") == 1 })

	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"late"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	var committed sync.Once
	var commitErr error
	commit := func() { committed.Do(func() { commitErr = tx.Commit(ctx) }) }
	change(e, cons, release, commit)
	waitFor(t, 10*time.Second, "the serving lane's first pass (delivers third)", func() bool {
		_, ok := done.Load(`"third"`)
		return ok
	})
	commit()
	if commitErr != nil {
		t.Fatal(commitErr)
	}
	waitFor(t, 5*time.Second, "the message committed after the change", func() bool {
		_, ok := done.Load(`"late"`)
		return ok
	})
}

// keyGivenUp waits until nobody holds the queue's busy key or mark.
func keyGivenUp(t *testing.T, e *env) {
	t.Helper()
	waitFor(t, 10*time.Second, "the busy key and mark given up", func() bool {
		return e.count(t, busyKeyHeld, "orders") == 0 && e.count(t, `SELECT count(*) FROM queue_busy`) == 0
	})
}

// TestReplacedBusyConsumerLosesNoWakeUp: the busy consumer is replaced.
// The old lane, giving up its key and mark, waits for the producers that
// saw the key to commit (the queue lock) and then wakes the dispatchers
// for the queue (lane.settleGone). The message used to wait for the
// fallback poll.
func TestReplacedBusyConsumerLosesNoWakeUp(t *testing.T) {
	lateProducerAcrossChange(t, nil, func(e *env, cons bellhop.Consumer, _, _ func()) {
		if err := e.client.RemoveConsumer(context.Background(), "app", cons.ID); err != nil {
			t.Fatal(err)
		}
		keyGivenUp(t, e)
		e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 10})
	})
}

// TestPausedBusyConsumerLosesNoWakeUp: the busy consumer is paused and
// resumed. The paused lane drops its key and mark but keeps its settle
// (dropMark), so the resumed lane's passes confirm the queue lock, and
// claim once more after the producer commits.
func TestPausedBusyConsumerLosesNoWakeUp(t *testing.T) {
	lateProducerAcrossChange(t, nil, func(e *env, cons bellhop.Consumer, _, _ func()) {
		off, on, ten := false, true, 10
		if err := e.client.UpdateConsumer(context.Background(), "app", cons.ID, bellhop.ConsumerUpdate{Enabled: &off}); err != nil {
			t.Fatal(err)
		}
		keyGivenUp(t, e)
		if err := e.client.UpdateConsumer(context.Background(), "app", cons.ID, bellhop.ConsumerUpdate{Enabled: &on, MaxInFlight: &ten}); err != nil {
			t.Fatal(err)
		}
	})
}

// TestDrainedBusyLaneLosesNoWakeUp: the busy lane drains its queue and
// gives up its key while a producer that saw the key has not committed.
// Its settle (docs/busy-marks.md step 3) goes on checking the queue lock
// for as long as the producer holds it (here for 15 checks: the quick
// tries, then the backoff's first, over a second), and after the check
// that succeeds it claims once more. The
// producer commits just after one of the settle's claims, before the
// next check: a settle that checked after claiming would end there
// without a claim to find the message. Found by review: the stress test
// cited for this guarantee (TestBusyMarksLoseNoWakeUp) still passed with
// a settle that waited for nobody, since the next message notified
// covered the stranded one; here nothing comes after it, and the poll is
// an hour away.
func TestDrainedBusyLaneLosesNoWakeUp(t *testing.T) {
	checks := &busyLockChecks{}
	lateProducerAcrossChange(t, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = checks },
		func(e *env, _ bellhop.Consumer, unblock, commit func()) {
			unblock()
			keyGivenUp(t, e)
			from := checks.n.Load()
			waitFor(t, 30*time.Second, "the settle to keep checking the queue lock", func() bool { return checks.n.Load() >= from+15 })
			done := make(chan struct{})
			after := func() {
				commit()
				close(done)
			}
			checks.afterClaim.Store(&after)
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("no claim by the settling lane within 10s")
			}
		})
}

// busyLockChecks counts the dispatcher's statements that check the queue
// lock and busy key (sql/busy_lock.sql), alone or in a batch, and its
// queue claims (claims), and runs afterClaim, once, when a queue claim
// statement has ended. While stallGone is set, a check of a stopped
// lane's settle (lane.settleGone: a lone statement bounded to 5s, where
// the lanes' checks have StatementTimeout, 10s) waits until its context
// ends before it is sent, as on a server that does not answer; stalled
// counts those, and stalledTill holds the last one's deadline (Unix ns).
type busyLockChecks struct {
	n           atomic.Int64
	claims      atomic.Int64
	afterClaim  atomic.Pointer[func()]
	stallGone   atomic.Bool
	stalled     atomic.Int64
	stalledTill atomic.Int64
}

type claimKey struct{}

func (c *busyLockChecks) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == queries.BusyLock {
		c.n.Add(1)
		if dl, ok := ctx.Deadline(); ok && c.stallGone.Load() && time.Until(dl) < 6*time.Second {
			c.stalledTill.Store(dl.UnixNano())
			c.stalled.Add(1)
			<-ctx.Done()
		}
	}
	if isQueueClaim(d.SQL) {
		c.claims.Add(1)
		ctx = context.WithValue(ctx, claimKey{}, true)
	}
	return ctx
}

func (c *busyLockChecks) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	c.claimEnded(ctx)
}

func (c *busyLockChecks) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if q.SQL == queries.BusyLock {
			c.n.Add(1)
		}
		if isQueueClaim(q.SQL) {
			c.claims.Add(1)
			ctx = context.WithValue(ctx, claimKey{}, true)
		}
	}
	return ctx
}

func (c *busyLockChecks) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *busyLockChecks) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	c.claimEnded(ctx)
}

func (c *busyLockChecks) claimEnded(ctx context.Context) {
	if ctx.Value(claimKey{}) == nil {
		return
	}
	if f := c.afterClaim.Swap(nil); f != nil {
		(*f)()
	}
}

// lockedReadyRow enqueues one message, locks it in a transaction of its
// own (rolled back when t ends, or by the caller), and starts a dispatcher
// with cfg (PollInterval an hour) whose claims cc counts.
func lockedReadyRow(t *testing.T, cfg bellhop.DispatcherConfig) (*env, pgx.Tx, *recorder, *claimCounter) {
	t.Helper()
	e := newEnv(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT 1 FROM queue_messages FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	cc := &claimCounter{}
	cfg.Resolver, cfg.PollInterval = mux, time.Hour
	startDispatcher(t, e.dsn, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = cc })
	return e, tx, rec, cc
}

// TestLockedReadyRowBacksOff: a ready message that an outside transaction
// holds locked (an operator's SELECT ... FOR UPDATE) is skipped by the
// claim, which then looks again, since a dying claim would leave such
// rows unannounced. The look-agains back off to once a second: they used
// to stay at 20 ms, fifty claims a second for as long as the lock lasted.
// Once the lock goes, the message is delivered.
func TestLockedReadyRowBacksOff(t *testing.T) {
	_, tx, rec, cc := lockedReadyRow(t, bellhop.DispatcherConfig{})
	ctx := context.Background()
	waitFor(t, 10*time.Second, "the first claim", func() bool { return cc.queue.Load() >= 1 })
	first := time.Now()
	// Ten more: at 20 ms apart they took about 0.2 s; backing off from
	// 2 ms, doubling, they take over 2 s.
	waitFor(t, 30*time.Second, "ten more claims", func() bool { return cc.queue.Load() >= 11 })
	if d := time.Since(first); d < time.Second {
		t.Errorf("ten claims of a locked row in %s: not backing off", d.Round(time.Millisecond))
	}
	if n := rec.n.Load(); n != 0 {
		t.Fatalf("%d deliveries of a row another transaction holds locked", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the message, once its row is free", func() bool { return rec.n.Load() == 1 })
}

// TestLockedRowBackoffStartsOver: the look-agains' backoff starts over
// once a pass leaves no ready row behind, on a lane without busy marks
// too: it used to stay at its longest (a second) for the lane's life after
// one long lock, so rows a dying claim left behind later waited a second
// instead of milliseconds.
func TestLockedRowBackoffStartsOver(t *testing.T) {
	e, tx, rec, cc := lockedReadyRow(t, bellhop.DispatcherConfig{DisableBusyMarks: true})
	ctx := context.Background()
	waitFor(t, 30*time.Second, "eleven claims of the locked row", func() bool { return cc.queue.Load() >= 11 })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the first message", func() bool { return rec.n.Load() == 1 })

	// A second episode: a message due in 2s, locked before it is due.
	id := e.enqueue(t, "orders", 2, bellhop.EnqueueOptions{Delay: 2 * time.Second})
	tx2, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx)
	if _, err := tx2.Exec(ctx, `SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	// The pass the enqueue's notification starts finds nothing due; the
	// next claim is the timer's, at the due time.
	cc.waitQuiet(t, 10*time.Second, 300*time.Millisecond, "the pass after the enqueue done")
	base := cc.queue.Load()
	waitFor(t, 10*time.Second, "the claim at the due time", func() bool { return cc.queue.Load() > base })
	first := time.Now()
	base = cc.queue.Load()
	waitFor(t, 30*time.Second, "four more looks", func() bool { return cc.queue.Load() >= base+4 })
	if d := time.Since(first); d > time.Second {
		t.Errorf("the second lock's first four look-agains took %s: the backoff did not start over", d.Round(time.Millisecond))
	}
}

// TestLockedInvokeDeliveryLooksAgain: the invoke lane, like the queue's
// (TestLockedReadyRowBacksOff), looks again at a ready delivery that an
// outside transaction holds locked, since its claim reports it left
// (next_due_invoke.sql), and delivers it once the lock goes, with no
// notification and no poll (an hour away); and it stops looking once no
// ready delivery is left.
func TestLockedInvokeDeliveryLooksAgain(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	id, err := e.client.InvokeAsync(ctx, c.ID, []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	cc := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = cc })

	waitFor(t, 30*time.Second, "five claims of the locked delivery", func() bool { return cc.invoke.Load() >= 5 })
	if n := rec.n.Load(); n != 0 {
		t.Fatalf("%d deliveries of a row another transaction holds locked", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the delivery, once its row is free", func() bool {
		d := rec.deliveries()
		return len(d) == 1 && d[0].ID == id && d[0].Invoked
	})
	// Nothing ready is left: the look-agains end. They come at least once
	// a second while a claim reports a row left.
	cc.waitQuiet(t, 10*time.Second, 300*time.Millisecond, "the passes after the delivery done")
	base := cc.invoke.Load()
	holdsFor(t, 2500*time.Millisecond, "no invoke claim with nothing ready", func() bool { return cc.invoke.Load() == base })
}

// TestHeartbeatAfterConnect: the scan after connecting carries the
// listener's first heartbeat, so a listener that hears is known to from
// the start, not from the first fallback poll (an hour away here), and it
// costs no reconnect. Through transaction pooling the same heartbeat
// finds a deaf listener (TestDispatcherThroughPgBouncerSession).
func TestHeartbeatAfterConnect(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", &recorder{})
	d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	// Nothing else notifies on this idle database: the one notification is
	// the heartbeat.
	waitFor(t, 10*time.Second, "the heartbeat heard", func() bool { return d.ListenerStats().Notifications == 1 })
	if st := d.ListenerStats(); st.HungRestarts != 0 || st.Connects != 1 || st.Deaf {
		t.Errorf("listener stats %+v, want no missed heartbeat, one connect, not deaf", st)
	}
	if err := d.Ready(context.Background()); err != nil {
		t.Errorf("Ready() = %v", err)
	}
}
