package integration

import (
	"context"
	"encoding/json"
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

// offers counts the live offers of queue "orders".
func (e *env) offers(t *testing.T) int {
	return e.count(t, `SELECT count(*) FROM bellhop_offers WHERE queue_name = 'orders' AND expires_at > now()`)
}

// holdLeaseKey takes the lease key (migrations/0045_lease_key.sql) on a
// connection of its own until the test ends, as another leasing
// dispatcher's listener would: producers then look for offers whatever
// the dispatchers under test do. It returns the connection, on which
// pg_advisory_unlock_shared lets the key go early.
func (e *env) holdLeaseKey(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock_shared(1650814063, 0)`); err != nil {
		t.Fatal(err)
	}
	return conn
}

// holdOwnerKey takes, on conn, the owner key of owner's offers
// (migrations/0055_lease_owner_key.sql), as that dispatcher's listener
// does: producers use an offer only while its owner's key is held.
func holdOwnerKey(t *testing.T, conn *pgx.Conn, owner uuid.UUID) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), `SELECT pg_advisory_lock_shared(hashtextextended($1::text, 1650814064))`, owner); err != nil {
		t.Fatal(err)
	}
}

// firstAttemptDelivered waits until rec has handled message id, as its
// first attempt, and fails if it was dead-lettered instead: an attempt
// spent on a lease nobody heard.
func firstAttemptDelivered(t *testing.T, e *env, rec *recorder, id uuid.UUID) {
	t.Helper()
	waitFor(t, 10*time.Second, "the message delivered or dead-lettered", func() bool {
		_, dead := e.deadLetterOf(t, id)
		return rec.n.Load() == 1 || dead
	})
	if dl, dead := e.deadLetterOf(t, id); dead {
		t.Fatalf("dead-lettered without ever being delivered: attempt %d of %d, %q", dl.Attempt, dl.Max, dl.LastError)
	}
	if got := rec.deliveries()[0]; got.ID != id || got.Attempt != 1 {
		t.Errorf("delivered %s as attempt %d; want %s as attempt 1", got.ID, got.Attempt, id)
	}
}

// leaseKeyHolders counts the sessions holding the lease key in the
// test's database, by their application_name. Advisory locks are per
// database, and other tests' dispatchers may hold the key in theirs on a
// shared server (DATABASE_URL).
func (e *env) leaseKeyHolders(t *testing.T, app string) int {
	return e.count(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
	    WHERE l.locktype = 'advisory' AND l.classid = 1650814063 AND l.objid = 0 AND l.objsubid = 2
	      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	      AND l.granted AND l.mode = 'ShareLock' AND a.application_name = $1`, app)
}

// startLeasing starts a dispatcher with LeaseAtInsert serving "orders"
// with h, and waits until its lane has an offer out: the first message
// goes the usual way (notification, claim), and the lane offers once it is
// idle again.
func startLeasing(t *testing.T, e *env, spec bellhop.ConsumerSpec, h bellhop.Handler, cfg bellhop.DispatcherConfig) (*running, *claimCounter) {
	t.Helper()
	spec.Queue = "orders"
	e.consumer(t, spec)
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", h)
	claims := &claimCounter{}
	cfg.Resolver, cfg.LeaseAtInsert = mux, true
	if cfg.PollInterval == 0 {
		cfg.PollInterval = time.Hour
	}
	d := startDispatcher(t, e.dsn, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	e.enqueue(t, "orders", map[string]string{"first": "claimed"}, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "an offer after the first delivery", func() bool { return e.offers(t) == 1 })
	return d, claims
}

// TestLeaseAtInsert: once a queue is idle, each message is leased by its
// producer's trigger and handed to the handler from its notification, with
// its payload, attempt and principal, and no claim statement; the leases
// are acked like claims; a clean stop withdraws the offer.
func TestLeaseAtInsert(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	d, claims := startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{})
	waitFor(t, 5*time.Second, "the first message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "the first pass done")
	passes := claims.queue.Load()

	principal, err := e.client.CreatePrincipal(context.Background(), "app", "writer")
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	sent := map[uuid.UUID]string{}
	for i := range n {
		body := map[string]any{"i": i, "colons": "a:b:c", "text": strings.Repeat("x", i*100)}
		id := e.enqueue(t, "orders", body, bellhop.EnqueueOptions{Principal: principal})
		b, _ := json.Marshal(body)
		sent[id] = string(b)
		waitFor(t, 5*time.Second, "the lease delivered and a new offer out", func() bool {
			return int(rec.n.Load()) == i+2 && e.offers(t) == 1
		})
	}
	waitFor(t, 5*time.Second, "every lease acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	if got := claims.queue.Load(); got != passes {
		t.Errorf("%d claim statements for %d messages leased at INSERT; want none", got-passes, n)
	}
	// The last offer's row is visible once its INSERT commits, a moment
	// before the dispatcher, which counts it once the reply is back, does.
	waitFor(t, 5*time.Second, "every offer counted", func() bool { return d.LeaseStats().Offers >= n+1 })
	if st := d.LeaseStats(); st.Leased != n || st.Recovered != 0 || st.Offers < n+1 {
		t.Errorf("LeaseStats = %+v; want %d leased, none recovered, at least %d offers", st, n, n+1)
	}
	for _, got := range rec.deliveries()[1:] {
		want, ok := sent[got.ID]
		if !ok {
			t.Fatalf("delivered %s, which was not sent", got.ID)
		}
		var a, b any
		_ = json.Unmarshal(got.Payload, &a)
		_ = json.Unmarshal([]byte(want), &b)
		if ja, _ := json.Marshal(a); string(ja) != mustJSON(b) || got.Attempt != 1 {
			t.Errorf("message %s delivered as attempt %d with %s; want attempt 1 with %s", got.ID, got.Attempt, got.Payload, want)
		}
	}
	d.stop()
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers`); n != 0 {
		t.Errorf("%d offers left after a clean stop; want none", n)
	}
}

// TestLeaseAtInsertFallsBack: a message that must not or cannot be leased
// at INSERT (a future deliver_after, a payload too large for a
// notification) leaves the offer alone and goes the usual way.
func TestLeaseAtInsertFallsBack(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	d, claims := startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{})
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "the first pass done")
	passes := claims.queue.Load()

	e.enqueue(t, "orders", map[string]string{"big": strings.Repeat("y", 8000)}, bellhop.EnqueueOptions{})
	due := time.Now().Add(700 * time.Millisecond)
	e.enqueue(t, "orders", map[string]string{"later": "yes"}, bellhop.EnqueueOptions{DeliverAfter: due})
	waitFor(t, 5*time.Second, "both delivered", func() bool { return rec.n.Load() == 3 })
	if st := d.LeaseStats(); st.Leased != 0 {
		t.Errorf("%d messages leased at INSERT; want none (too large, not yet due)", st.Leased)
	}
	if claims.queue.Load() == passes {
		t.Error("no claim pass delivered the messages that were not leased")
	}
	if n := e.offers(t); n != 1 {
		t.Errorf("%d offers; want the one the lane made, still there", n)
	}
	for _, got := range rec.deliveries() {
		if strings.Contains(string(got.Payload), "later") && got.Start.Before(due) {
			t.Errorf("delayed message delivered at %s, before it was due at %s", got.Start, due)
		}
	}
}

// TestLeaseAtInsertFarEnqueuedAt: a message whose enqueued_at is too far
// ahead for a lease notification's microseconds (the year 294250, which
// PostgreSQL takes and a producer may write) is inserted while a leasing
// dispatcher has an offer out: the producer commits, and the message is
// claimed and delivered on its first attempt with its enqueued_at, which
// the claim reads whole; the offer is left, and the next message takes
// it. Before migration 0063, the producer's COMMIT failed "bigint out of
// range" and its transaction rolled back.
func TestLeaseAtInsertFarEnqueuedAt(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	enqueuedAt := map[uuid.UUID]time.Time{}
	rec := &recorder{result: func(_ context.Context, m *bellhop.Message) error {
		mu.Lock()
		defer mu.Unlock()
		enqueuedAt[m.ID] = m.EnqueuedAt
		return nil
	}}
	d, claims := startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{})
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "the first pass done")
	passes := claims.queue.Load()

	var id uuid.UUID
	if err := e.pool.QueryRow(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at)
		SELECT id, 'orders', '{"far":true}', '294250-01-01 00:00:00+00' FROM apps WHERE name = 'app'
		RETURNING id`).Scan(&id); err != nil {
		t.Fatalf("the producer's INSERT: %v", err)
	}
	waitFor(t, 5*time.Second, "the far message delivered", func() bool { return rec.n.Load() == 2 })
	if got := rec.deliveries()[1]; got.ID != id || got.Attempt != 1 {
		t.Errorf("delivered %s as attempt %d; want %s as attempt 1", got.ID, got.Attempt, id)
	}
	mu.Lock()
	got := enqueuedAt[id]
	mu.Unlock()
	if want := time.Date(294250, 1, 1, 0, 0, 0, 0, time.UTC); !got.Equal(want) {
		t.Errorf("the handler saw EnqueuedAt %s; want %s", got.UTC(), want)
	}
	if st := d.LeaseStats(); st.Leased != 0 {
		t.Errorf("%d messages leased at INSERT; want none", st.Leased)
	}
	if claims.queue.Load() == passes {
		t.Error("no claim pass delivered the message that was not leased")
	}
	if n := e.offers(t); n != 1 {
		t.Errorf("%d offers; want the one the lane made, still there", n)
	}

	e.enqueue(t, "orders", map[string]string{"next": "leased"}, bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "the next message leased and delivered", func() bool {
		return rec.n.Load() == 3 && d.LeaseStats().Leased == 1
	})
}

// TestLeaseAtInsertLostNotification: a lease whose notification the
// dispatcher's listener missed (made as the listener went away: here a
// test session holds the dispatcher's owner key in its place, and another
// the lease key) reaches nobody; the dispatcher finds it by its token
// when the listener is back, long before the lease or the poll would.
func TestLeaseAtInsertLostNotification(t *testing.T) {
	e := newEnv(t)
	holder := e.holdLeaseKey(t)
	rec := &recorder{}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{VisibilityTimeout: time.Minute}, rec,
		bellhop.DispatcherConfig{ReconnectDelay: 500 * time.Millisecond})
	waitFor(t, 5*time.Second, "the first message delivered", func() bool { return rec.n.Load() == 1 })

	if n := e.count(t, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
	                    WHERE application_name = 'bellhop-listener' AND datname = current_database()) AS k`); n != 1 {
		t.Fatalf("terminated %d listeners; want 1", n)
	}
	waitFor(t, 5*time.Second, "the listener gone", func() bool { return d.Ready(context.Background()) != nil })
	var owner uuid.UUID
	if err := e.pool.QueryRow(context.Background(), `SELECT owner FROM bellhop_offers LIMIT 1`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	holdOwnerKey(t, holder, owner)
	id := e.enqueue(t, "orders", map[string]string{"while": "away"}, bellhop.EnqueueOptions{})
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id); n != 1 {
		t.Fatalf("the message was not leased at INSERT (%d rows leased); the test needs it to be", n)
	}
	start := time.Now()
	waitFor(t, 10*time.Second, "the lost lease delivered", func() bool { return rec.n.Load() == 2 })
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the lost lease took %s to be delivered; want about the reconnect delay", took)
	}
	if st := d.LeaseStats(); st.Recovered != 1 {
		t.Errorf("LeaseStats = %+v; want 1 recovered", st)
	}
	waitFor(t, 5*time.Second, "an offer again", func() bool { return e.offers(t) == 1 })
}

// TestRemovedConsumerWithdrawsOffer: removing a consumer while its
// dispatcher runs withdraws its lane's offer at once, not when the
// offer's TTL (three poll intervals: three hours here) runs out, so no
// producer leases a message to a lane that is gone.
func TestRemovedConsumerWithdrawsOffer(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	e.holdLeaseKey(t)
	startLeasing(t, e, bellhop.ConsumerSpec{}, &recorder{}, bellhop.DispatcherConfig{})
	c, err := e.client.ConsumerOf(ctx, "app", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.client.RemoveConsumer(ctx, "app", c.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the offer withdrawn", func() bool {
		return e.count(t, `SELECT count(*) FROM bellhop_offers`) == 0
	})
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{})
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id); n != 1 {
		t.Error("a message enqueued after its consumer was removed was leased")
	}
}

// TestLeaseAtInsertDeadOffer: an offer left by a dispatcher that died
// (kill -9: its row stays until it expires) is not used, although another
// leasing dispatcher holds the lease key: its owner key went with its
// listener's session. A live dispatcher delivers the message at once, on
// its first attempt. The dead offer used to take it, so its attempt was
// spent on a lease nobody heard: on a last attempt, the reclaim
// dead-lettered it undelivered.
func TestLeaseAtInsertDeadOffer(t *testing.T) {
	e := newEnv(t)
	e.holdLeaseKey(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: 2 * time.Second})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: 500 * time.Millisecond}, nil)
	var dead uuid.UUID
	if err := e.pool.QueryRow(context.Background(), `INSERT INTO bellhop_offers
	    (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
	    SELECT gen_random_uuid(), c.app_id, 'orders', gen_random_uuid(), 'bellhop_l_dead', now() + interval '1 hour', c.id
	    FROM queue_consumers AS c WHERE c.app_name = 'app' AND c.queue_name = 'orders'
	    RETURNING token`).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	id := e.enqueue(t, "orders", 1, bellhop.EnqueueOptions{MaxAttempts: 1})
	// By the dead offer's token: the live dispatcher may already have
	// claimed the message, under a token of its own.
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token = $2`, id, dead); n != 0 {
		t.Fatal("the message was leased to the dead dispatcher's offer")
	}
	firstAttemptDelivered(t, e, rec, id)
	if n := e.offers(t); n != 1 {
		t.Errorf("%d offers; want the dead one, unused", n)
	}
}

// TestLeaseAtInsertMaxInFlight: a lease that arrives while the consumer's
// only slot is busy waits for it, and a lane whose slot is busy makes no
// offer; the handler never runs twice at once.
func TestLeaseAtInsertMaxInFlight(t *testing.T) {
	e := newEnv(t)
	var running, most atomic.Int32
	release := make(chan struct{})
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		n := running.Add(1)
		defer running.Add(-1)
		for {
			old := most.Load()
			if n <= old || most.CompareAndSwap(old, n) {
				break
			}
		}
		if string(m.Payload) == `"blocker"` {
			<-release
		}
		return nil
	}}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{MaxInFlight: 1}, rec, bellhop.DispatcherConfig{})
	waitFor(t, 5*time.Second, "the first message delivered", func() bool { return rec.n.Load() == 1 })
	// Not due yet, so not leased: the lane's timer claims it, and it
	// holds the only slot while the offer stays out.
	e.enqueue(t, "orders", "blocker", bellhop.EnqueueOptions{Delay: 300 * time.Millisecond})
	waitFor(t, 5*time.Second, "the blocker running", func() bool { return running.Load() == 1 })
	if n := e.offers(t); n != 1 {
		t.Fatalf("%d offers while the slot is busy; want the one made while idle", n)
	}
	id := e.enqueue(t, "orders", "leased", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "the lease made", func() bool { return d.LeaseStats().Leased == 1 })
	holdsFor(t, 200*time.Millisecond, "the lease waiting for the slot", func() bool {
		return rec.n.Load() == 1 && running.Load() == 1
	})
	if n := e.offers(t); n != 0 {
		t.Errorf("%d offers while the slot is busy and a lease waits; want none", n)
	}
	close(release)
	waitFor(t, 5*time.Second, "both delivered", func() bool { return rec.n.Load() == 3 })
	if got := rec.deliveries()[2]; got.ID != id || got.Attempt != 1 {
		t.Errorf("third delivery %s attempt %d; want the leased %s, attempt 1", got.ID, got.Attempt, id)
	}
	if m := most.Load(); m != 1 {
		t.Errorf("%d handlers ran at once with MaxInFlight 1", m)
	}
	waitFor(t, 5*time.Second, "an offer once the slot is free", func() bool { return e.offers(t) == 1 })
}

// leaseWaitingForSlot starts a leasing dispatcher whose consumer
// (MaxInFlight 1, visibility timeout vt) runs a claimed "blocker" until
// release is closed, renewing its lease meanwhile, and then has a message
// leased at INSERT to the offer left out while the blocker holds the slot.
// It returns the dispatcher, the handler's recorder and the leased
// message's id.
func leaseWaitingForSlot(t *testing.T, e *env, vt time.Duration, opts bellhop.EnqueueOptions, release chan struct{}) (*running, *recorder, uuid.UUID) {
	t.Helper()
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		if string(m.Payload) != `"blocker"` {
			return nil
		}
		for {
			select {
			case <-release:
				return nil
			case <-time.After(vt / 5):
				if err := m.ExtendLease(ctx); err != nil {
					return err
				}
			}
		}
	}}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{MaxInFlight: 1, VisibilityTimeout: vt}, rec, bellhop.DispatcherConfig{})
	waitFor(t, 5*time.Second, "the first message delivered", func() bool { return rec.n.Load() == 1 })
	// Not due yet, so not leased: the lane's timer claims it, and it
	// holds the only slot while the offer stays out.
	e.enqueue(t, "orders", "blocker", bellhop.EnqueueOptions{Delay: 300 * time.Millisecond})
	waitFor(t, 5*time.Second, "the blocker claimed", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`) == 1
	})
	id := e.enqueue(t, "orders", "leased", opts)
	waitFor(t, 5*time.Second, "the lease made", func() bool { return d.LeaseStats().Leased == 1 })
	return d, rec, id
}

// TestLeaseWaitingForSlotIsReleased: a lease waiting for a busy slot is
// given back, its attempt refunded, once a delivery could no longer start
// in time; the message is delivered later on its first attempt. It used
// to wait until the reclaimer took the lease, spending the attempt
// undelivered: on a last attempt, a dead letter never delivered.
func TestLeaseWaitingForSlotIsReleased(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	_, rec, id := leaseWaitingForSlot(t, e, 2*time.Second, bellhop.EnqueueOptions{MaxAttempts: 1}, release)
	waitFor(t, 5*time.Second, "the waiting lease released, its attempt refunded", func() bool {
		if _, dead := e.deadLetterOf(t, id); dead {
			t.Fatalf("the leased message was dead-lettered without ever being delivered")
		}
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL AND attempt = 0`, id) == 1
	})
	close(release)
	waitFor(t, 10*time.Second, "the message delivered", func() bool { return rec.n.Load() == 3 })
	if got := rec.deliveries()[2]; got.ID != id || got.Attempt != 1 {
		t.Errorf("third delivery %s attempt %d; want %s, attempt 1", got.ID, got.Attempt, id)
	}
}

// TestLeaseWaitingForSlotPaused: pausing a consumer releases the leases
// waiting for its slot; none starts once the slot frees. They used to
// start on the paused consumer when the slot freed.
func TestLeaseWaitingForSlotPaused(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	_, rec, id := leaseWaitingForSlot(t, e, time.Minute, bellhop.EnqueueOptions{}, release)
	c, err := e.client.ConsumerOf(context.Background(), "app", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the waiting lease released", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL AND attempt = 0`, id) == 1
	})
	close(release)
	waitFor(t, 5*time.Second, "the blocker acked", func() bool { return rec.n.Load() == 2 })
	holdsFor(t, 300*time.Millisecond, "the leased message undelivered while paused", func() bool {
		return rec.n.Load() == 2
	})
}

// TestLeaseOfferLockedThroughPolls: an offer a producer holds locked
// (taking it, uncommitted) stays the lane's only offer however many polls
// pass, and after the producer rolls back, the offer is still the only
// one: one INSERT of two messages leases one of them. The poll used to
// count a locked offer taken, and the lane offered again: two offers out,
// two leases for a lane with one slot, and one waiting for it.
func TestLeaseOfferLockedThroughPolls(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{MaxInFlight: 1}, rec, bellhop.DispatcherConfig{PollInterval: time.Second})
	waitFor(t, 5*time.Second, "the first message delivered", func() bool { return rec.n.Load() == 1 })
	waitFor(t, 5*time.Second, "the offer", func() bool { return e.offers(t) == 1 })
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"rolled back"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	// The lease runs now, taking the offer, not at COMMIT.
	if _, err := tx.Exec(ctx, `SET CONSTRAINTS queue_messages_notify IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	// Polls come every 0.9 – 1.1 s, and an offer not extended (this one
	// is locked) lives three intervals from the last poll before.
	holdsFor(t, 2*time.Second, "one offer while a producer holds it, through a poll or two", func() bool { return e.offers(t) == 1 })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	holdsFor(t, 300*time.Millisecond, "one offer after the rollback", func() bool { return e.offers(t) == 1 })
	if _, err := e.client.EnqueueMany(ctx, "app", []bellhop.NewMessage{
		{Queue: "orders", Payload: []byte(`"a"`)}, {Queue: "orders", Payload: []byte(`"b"`)},
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "both delivered", func() bool { return rec.n.Load() == 3 })
	if n := d.LeaseStats().Leased; n != 1 {
		t.Errorf("%d messages leased at INSERT, want 1: the lane had one offer", n)
	}
}

// TestLeaseAtInsertPaused: pausing a consumer withdraws its offer, so no
// message is leased to a paused consumer; resuming delivers them.
func TestLeaseAtInsertPaused(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{})
	c, err := e.client.ConsumerOf(context.Background(), "app", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the offer withdrawn", func() bool { return e.offers(t) == 0 })
	id := e.enqueue(t, "orders", 2, bellhop.EnqueueOptions{})
	holdsFor(t, 300*time.Millisecond, "the message unleased and undelivered", func() bool {
		return rec.n.Load() == 1 && e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id) == 1
	})
	if err := e.client.SetConsumerEnabled(context.Background(), "app", c.ID, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "delivered after the resume", func() bool { return rec.n.Load() == 2 })
}

// TestLeaseAtInsertIsolation: only READ COMMITTED producers lease. A
// REPEATABLE READ or SERIALIZABLE producer whose snapshot predates the
// offer's last extension commits normally, and its message goes the
// usual way, leaving the offer.
func TestLeaseAtInsertIsolation(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{})
	ctx := context.Background()
	for i, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		tx, err := e.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM apps`).Scan(&n); err != nil { // takes the snapshot
			t.Fatal(err)
		}
		// As the dispatcher's poll does, after the producer's snapshot.
		if _, err := e.pool.Exec(ctx, `UPDATE bellhop_offers SET expires_at = expires_at + interval '1 second'`); err != nil {
			t.Fatal(err)
		}
		if _, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`{"iso":"`+string(iso)+`"}`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatalf("%s: %v", iso, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("%s producer's commit: %v", iso, err)
		}
		waitFor(t, 5*time.Second, "delivered", func() bool { return int(rec.n.Load()) == i+2 })
	}
	if st := d.LeaseStats(); st.Leased != 0 {
		t.Errorf("%d messages leased at INSERT by REPEATABLE READ or SERIALIZABLE producers; want none", st.Leased)
	}
	if n := e.offers(t); n != 1 {
		t.Errorf("%d offers; want the one, left alone", n)
	}
}

// TestLeaseAtInsertStartsAtCommit: the lease starts when the producer
// commits, not when it inserted, so a transaction that stays open for
// longer than the visibility timeout still hands its message over by the
// notification, on its first attempt. A row the transaction deleted before
// committing leaves the offer alone.
func TestLeaseAtInsertStartsAtCommit(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	d, claims := startLeasing(t, e, bellhop.ConsumerSpec{VisibilityTimeout: time.Second}, rec, bellhop.DispatcherConfig{})
	waitFor(t, 5*time.Second, "the first message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	ctx := context.Background()

	// A row deleted by its own transaction: nothing to lease, and the
	// offer stays.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gone, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"deleted"`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM queue_messages WHERE id = $1`, gone); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.offers(t); n != 1 {
		t.Errorf("%d offers after a transaction deleted its row; want the one, left alone", n)
	}
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "passes done")
	passes := claims.queue.Load()

	tx, err = e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"slow"`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the producer's slow transaction, longer than the lease
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "delivered", func() bool { return rec.n.Load() == 2 })
	if got := rec.deliveries()[1]; got.ID != id || got.Attempt != 1 {
		t.Errorf("delivered %s as attempt %d; want %s as attempt 1", got.ID, got.Attempt, id)
	}
	if st := d.LeaseStats(); st.Leased != 1 {
		t.Errorf("LeaseStats = %+v; want the slow transaction's message leased", st)
	}
	if got := claims.queue.Load(); got != passes {
		t.Errorf("%d claim statements; want none (a lease that had run out would be released and claimed)", got-passes)
	}
	waitFor(t, 5*time.Second, "a new offer", func() bool { return e.offers(t) == 1 })
}

// TestLeaseAtInsertPollKeepsBook: the fallback poll extends the live
// offer, deletes offers of this dispatcher that it no longer holds and
// those of dispatchers long gone, and notices an offer that vanished (the
// UNLOGGED table emptied by a crash), after which the lane offers anew.
func TestLeaseAtInsertPollKeepsBook(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	startLeasing(t, e, bellhop.ConsumerSpec{}, rec, bellhop.DispatcherConfig{PollInterval: 300 * time.Millisecond})
	ctx := context.Background()
	var token, owner uuid.UUID
	var until time.Time
	if err := e.pool.QueryRow(ctx, `SELECT token, owner, expires_at FROM bellhop_offers`).Scan(&token, &owner, &until); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the offer extended by a poll", func() bool {
		var now time.Time
		_ = e.pool.QueryRow(ctx, `SELECT expires_at FROM bellhop_offers WHERE token = $1`, token).Scan(&now)
		return now.After(until)
	})
	// One of ours that we do not hold (made ten seconds ago), one of a
	// dispatcher gone for two hours, and one of a live stranger.
	if _, err := e.pool.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
	    SELECT gen_random_uuid(), id, 'orders', $1, 'bellhop_l_x', now() + interval '0.9 seconds' - interval '10 seconds' FROM apps
	    UNION ALL SELECT gen_random_uuid(), id, 'orders', gen_random_uuid(), 'bellhop_l_y', now() - interval '2 hours' FROM apps
	    UNION ALL SELECT gen_random_uuid(), id, 'other', gen_random_uuid(), 'bellhop_l_z', now() + interval '1 hour' FROM apps`, owner); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the poll to delete the two", func() bool {
		return e.count(t, `SELECT count(*) FROM bellhop_offers`) == 2
	})
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers WHERE token = $1 OR queue_name = 'other'`, token); n != 2 {
		t.Fatalf("the poll deleted the live offer or the stranger's (%d of 2 left)", n)
	}
	// The table loses our offer behind our back.
	if _, err := e.pool.Exec(ctx, `DELETE FROM bellhop_offers WHERE token = $1`, token); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "a new offer after the poll found ours gone", func() bool {
		return e.count(t, `SELECT count(*) FROM bellhop_offers WHERE queue_name = 'orders' AND token <> $1`, token) == 1
	})
	id := e.enqueue(t, "orders", "after", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "delivered", func() bool { return rec.n.Load() == 2 })
	if got := rec.deliveries()[1]; got.ID != id {
		t.Errorf("delivered %s, want %s", got.ID, id)
	}
}

// TestPollSkipsOffersProducersHold: a producer taking one of the
// dispatcher's offers holds its row locked until it commits, which may be
// long; the fallback poll goes on meanwhile (its extension and its
// deletion skip locked offers) rather than wait for it, keeping the
// heartbeat and the missed-work scan to schedule. It still counts the
// locked offer as out (no second offer is made), and once the lock goes it
// extends the offer, and deletes the offers it had left, as before: ours
// that we no longer hold, made ten seconds ago, and a dispatcher's gone
// for two hours.
func TestPollSkipsOffersProducersHold(t *testing.T) {
	e := newEnv(t)
	obs := &pollObserver{}
	startLeasing(t, e, bellhop.ConsumerSpec{}, &recorder{}, bellhop.DispatcherConfig{Observer: obs, PollInterval: 200 * time.Millisecond})
	ctx := context.Background()
	var token, owner uuid.UUID
	if err := e.pool.QueryRow(ctx, `SELECT token, owner FROM bellhop_offers`).Scan(&token, &owner); err != nil {
		t.Fatal(err)
	}
	// hold locks the offers named as a producer does, once all of them are
	// there to lock; insert, if not nil, (re)makes them first: a poll may
	// delete them before the lock.
	hold := func(what string, tokens []uuid.UUID, insert func()) pgx.Tx {
		t.Helper()
		var tx pgx.Tx
		waitFor(t, 10*time.Second, "a lock on "+what, func() bool {
			if insert != nil {
				insert()
			}
			var err error
			if tx, err = e.pool.Begin(ctx); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM bellhop_offers WHERE token = ANY($1) FOR UPDATE) l`, tokens).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != len(tokens) {
				_ = tx.Rollback(ctx)
			}
			return n == len(tokens)
		})
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx
	}
	expiry := func() time.Time {
		t.Helper()
		var at time.Time
		if err := e.pool.QueryRow(ctx, `SELECT expires_at FROM bellhop_offers WHERE token = $1`, token).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}

	// The offer the poll extends (CTE refreshed).
	tx := hold("our live offer", []uuid.UUID{token}, nil)
	polls := obs.polls.Load()
	waitFor(t, 5*time.Second, "two polls while a producer holds our live offer", func() bool { return obs.polls.Load() >= polls+2 })
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers WHERE owner = $1`, owner); n != 1 {
		t.Errorf("%d offers of ours while a producer holds the one out; want 1 (the held one still counts as out)", n)
	}
	held := expiry()
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the offer extended once free", func() bool { return expiry().After(held) })

	// Offers the poll deletes (CTE forgotten).
	ours, gone := uuid.New(), uuid.New()
	stale := []uuid.UUID{ours, gone}
	tx = hold("offers the poll deletes", stale, func() {
		if _, err := e.pool.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
		    SELECT $1::uuid, id, 'orders', $2::uuid, 'bellhop_l_x', now() + interval '0.6 seconds' - interval '10 seconds' FROM apps
		    UNION ALL SELECT $3::uuid, id, 'orders', gen_random_uuid(), 'bellhop_l_y', now() - interval '2 hours' FROM apps
		    ON CONFLICT DO NOTHING`, ours, owner, gone); err != nil {
			t.Fatal(err)
		}
	})
	polls = obs.polls.Load()
	waitFor(t, 5*time.Second, "two polls while a producer holds offers the poll deletes", func() bool { return obs.polls.Load() >= polls+2 })
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers WHERE token = ANY($1)`, stale); n != 2 {
		t.Errorf("%d of the 2 held offers left; want both, the poll skipping them", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the offers deleted once free", func() bool {
		return e.count(t, `SELECT count(*) FROM bellhop_offers WHERE token = ANY($1)`, stale) == 0
	})
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers WHERE token = $1`, token); n != 1 {
		t.Error("the live offer went with the others")
	}
}

// TestLeaseKey: producers lease only while a session holds the lease key,
// which a leasing dispatcher holds on its listener connection, exactly
// while that connection lives; without it, an offer in the table is left
// alone and the message goes the q: way. The lease function refuses to
// run outside a trigger.
func TestLeaseKey(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "spare"}) // a queue without one leases nothing
	if n := e.count(t, `SELECT count(*) FROM pg_proc WHERE proname = 'bellhop_notify_queue_message'
	                    AND NOT prosecdef AND proconfig IS NULL`); n != 1 {
		t.Errorf("the notify trigger's function is SECURITY DEFINER or sets a search_path; want neither")
	}
	owner := uuid.New()
	offer := func() uuid.UUID {
		t.Helper()
		var token uuid.UUID
		if err := e.pool.QueryRow(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
		    SELECT gen_random_uuid(), c.app_id, 'spare', $1, 'bellhop_l_test', now() + interval '1 hour', c.id
		    FROM queue_consumers AS c WHERE c.app_name = 'app' AND c.queue_name = 'spare' RETURNING token`, owner).Scan(&token); err != nil {
			t.Fatal(err)
		}
		return token
	}
	leased := func(id uuid.UUID) bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NOT NULL`, id) == 1
	}

	token := offer()
	id := e.enqueue(t, "spare", 1, bellhop.EnqueueOptions{})
	if leased(id) || e.count(t, `SELECT count(*) FROM bellhop_offers WHERE token = $1`, token) != 1 {
		t.Fatal("leased with nobody holding the lease key")
	}
	var ok bool
	if err := e.pool.QueryRow(ctx, `SELECT bellhop_lease_message(id, app_id, queue_name) FROM queue_messages WHERE id = $1`, id).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	if ok || leased(id) {
		t.Fatal("bellhop_lease_message leased a message when called outside a trigger")
	}

	holder := e.holdLeaseKey(t)
	if id = e.enqueue(t, "spare", 2, bellhop.EnqueueOptions{}); leased(id) {
		t.Fatal("leased to an offer whose owner key nobody holds (its dispatcher's listener gone)")
	}
	holdOwnerKey(t, holder, owner)
	id = e.enqueue(t, "spare", 3, bellhop.EnqueueOptions{})
	if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token = $2`, id, token); n != 1 {
		t.Fatal("not leased to the offer while the lease key and its owner key were held")
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock_shared(1650814063, 0)`); err != nil {
		t.Fatal(err)
	}
	offer()
	if id = e.enqueue(t, "spare", 4, bellhop.EnqueueOptions{}); leased(id) {
		t.Fatal("leased after the lease key was let go")
	}

	rec := &recorder{}
	d, claims := startLeasing(t, e, bellhop.ConsumerSpec{}, rec,
		bellhop.DispatcherConfig{ReconnectDelay: 300 * time.Millisecond})
	if n := e.leaseKeyHolders(t, "bellhop-listener"); n != 1 {
		t.Fatalf("%d listeners hold the lease key; want the leasing dispatcher's", n)
	}
	claims.waitQuiet(t, 5*time.Second, 200*time.Millisecond, "the first pass done")
	passes := claims.queue.Load()
	if n := e.count(t, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
	                    WHERE application_name = 'bellhop-listener' AND datname = current_database()) AS k`); n != 1 {
		t.Fatalf("terminated %d listeners; want 1", n)
	}
	waitFor(t, 5*time.Second, "the key let go with the listener", func() bool {
		return e.leaseKeyHolders(t, "bellhop-listener") == 0
	})
	id = e.enqueue(t, "orders", "while away", bellhop.EnqueueOptions{})
	if leased(id) {
		t.Fatal("leased to an offer whose dispatcher had no listener")
	}
	waitFor(t, 10*time.Second, "delivered by a claim after the reconnect", func() bool { return rec.n.Load() == 2 })
	if claims.queue.Load() == passes {
		t.Error("no claim pass after the reconnect; the message came another way")
	}
	if n := e.leaseKeyHolders(t, "bellhop-listener"); n != 1 {
		t.Errorf("%d listeners hold the lease key after the reconnect; want 1", n)
	}
	d.stop()
	waitFor(t, 5*time.Second, "the key let go at a clean stop", func() bool {
		return e.leaseKeyHolders(t, "bellhop-listener") == 0
	})
}

// TestLeasePlans: the lease reaches its rows by index even where the
// planner would rather scan, as it would with a table full of offers of
// one queue, or of its dead ones, and it reaches the message by primary key,
// not through the queue's unclaimed messages. A transaction that made its
// row unleasable before committing leaves the offer alone. The lease runs
// early here (SET CONSTRAINTS ... IMMEDIATE) so that the transaction's own
// scan counters show what it read.
func TestLeasePlans(t *testing.T) {
	e := newEnv(t)
	e.holdLeaseKey(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "plans"}) // a queue without one leases nothing
	// Messages of the queue, claimed since: their unclaimed versions are
	// dead entries that a scan of the queue's unclaimed messages reads.
	for i := 0; i < 200; i++ {
		e.enqueue(t, "plans", i, bellhop.EnqueueOptions{})
	}
	if _, err := e.pool.Exec(ctx, `UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(),
	    attempt = 1 WHERE queue_name = 'plans'`); err != nil {
		t.Fatal(err)
	}
	owner := uuid.New()
	holdOwnerKey(t, e.holdLeaseKey(t), owner)
	if _, err := e.pool.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
	    SELECT gen_random_uuid(), c.app_id, 'plans', $1, 'bellhop_l_test', now() + interval '1 hour', c.id
	    FROM queue_consumers AS c, generate_series(1, 2000) WHERE c.app_name = 'app' AND c.queue_name = 'plans'`, owner); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `ANALYZE bellhop_offers, queue_messages`); err != nil {
		t.Fatal(err)
	}

	scans := `SELECT pg_stat_get_xact_numscans('bellhop_offers'::regclass),
	                 pg_stat_get_xact_numscans('bellhop_offers_queue'::regclass),
	                 pg_stat_get_xact_numscans('idx_queue_messages_dispatch'::regclass)
	                   + pg_stat_get_xact_numscans('idx_queue_messages_ready'::regclass),
	                 pg_stat_get_xact_numscans('queue_messages_pkey'::regclass)`
	// lease enqueues in a transaction, runs change on it, fires the
	// deferred trigger and returns the transaction's scan counts.
	lease := func(change string) (id uuid.UUID, seq, byQueue, dispatch, pkey int) {
		t.Helper()
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if id, err = e.client.EnqueueTx(ctx, tx, "app", "plans", []byte(`"now"`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
		if change != "" {
			if _, err := tx.Exec(ctx, change, id); err != nil {
				t.Fatal(err)
			}
		}
		var before [4]int
		if err := tx.QueryRow(ctx, scans).Scan(&before[0], &before[1], &before[2], &before[3]); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SET CONSTRAINTS queue_messages_notify IMMEDIATE`); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, scans).Scan(&seq, &byQueue, &dispatch, &pkey); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return id, seq - before[0], byQueue - before[1], dispatch - before[2], pkey - before[3]
	}

	id, seq, byQueue, dispatch, pkey := lease("")
	if n := e.count(t, `SELECT count(*) FROM queue_messages m JOIN apps a ON a.id = m.app_id
	                    WHERE m.id = $1 AND m.attempt = 1 AND m.claim_token IS NOT NULL
	                      AND m.claim_token NOT IN (SELECT token FROM bellhop_offers)`, id); n != 1 {
		t.Fatal("not leased, or leased under an offer that is still there")
	}
	if seq != 0 || byQueue != 1 {
		t.Errorf("the offer lookup made %d sequential and %d index scans; want 0 and 1", seq, byQueue)
	}
	if dispatch != 0 || pkey == 0 {
		t.Errorf("the lease read the queue's unclaimed messages %d times and the primary key %d times; want 0 and at least 1",
			dispatch, pkey)
	}

	for _, change := range []string{
		`UPDATE queue_messages SET deliver_after = now() + interval '1 hour' WHERE id = $1`,
		`UPDATE queue_messages SET payload = to_jsonb(repeat('x', 8000)) WHERE id = $1`,
	} {
		id, _, _, _, _ := lease(change)
		if n := e.count(t, `SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL AND attempt = 0`, id); n != 1 {
			t.Errorf("after %q: leased a message its transaction made unleasable", change)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM bellhop_offers`); n != 1999 {
		t.Errorf("%d offers left; want 1,999: one leased, none taken by the unleasable messages", n)
	}
}

// TestStopWaitsForLockedOffer: a producer has taken the stopping
// dispatcher's offer (its lease function locked the offer row) and has not
// committed when the stop withdraws its offers. A stop is not the
// message's fault (docs/guarantees.md): the stop's drop waits for the
// producer (offer_drop_all.sql), so that the recover after it sees the
// lease and releases it with its attempt refunded, and a dispatcher still
// running delivers the message on its first attempt. The drop used to skip
// the locked offer, and the lease ran out with its attempt spent: on a
// last attempt, dead-lettered undelivered. SET CONSTRAINTS ... IMMEDIATE
// only widens the window that a plain COMMIT has between the lease
// function's lock and the commit's end.
func TestStopWaitsForLockedOffer(t *testing.T) {
	e := newEnv(t)
	e.holdLeaseKey(t) // another leasing dispatcher is connected
	ctx := context.Background()
	rec := &recorder{}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{VisibilityTimeout: 2 * time.Second}, rec, bellhop.DispatcherConfig{})
	waitFor(t, 5*time.Second, "the first message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})

	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	id, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"last"`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SET CONSTRAINTS queue_messages_notify IMMEDIATE`); err != nil {
		t.Fatal(err)
	}
	var leased bool
	if err := tx.QueryRow(ctx, `SELECT claim_token IS NOT NULL FROM queue_messages WHERE id = $1`, id).Scan(&leased); err != nil || !leased {
		t.Fatalf("the producer did not lease its message (%v, %v); the test needs it to", leased, err)
	}

	stopped := make(chan struct{})
	go func() { d.stop(); close(stopped) }()
	// Commit once the stop has either finished with the offers or waits
	// for the producer's lock on one (a drop without SKIP LOCKED).
	waitFor(t, 20*time.Second, "the stop past its offers, or waiting for the producer", func() bool {
		select {
		case <-stopped:
			return true
		default:
		}
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
		                    AND datname = current_database() AND query LIKE '%bellhop_offers%'`) > 0
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-stopped

	var token *uuid.UUID
	var attempt int
	if err := e.pool.QueryRow(ctx, `SELECT claim_token, attempt FROM queue_messages WHERE id = $1`, id).Scan(&token, &attempt); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the stop: claim_token %v, attempt %d", token, attempt)

	// A dispatcher still running (not leasing) delivers what is left.
	rec2 := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec2)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: 500 * time.Millisecond}, nil)
	firstAttemptDelivered(t, e, rec2, id)
}

// TestStopWithdrawsOffersFirst: a stopping dispatcher whose handler is
// still running withdraws its idle lane's offer at once, not when its
// grace ends: with another leasing dispatcher connected, a producer would
// lease the next message to that offer, and a running dispatcher that
// could take it at once would wait for the stop's grace. The test's
// session holds the lease key, standing in for that other dispatcher, and
// the stopping dispatcher's owner key, standing in for its listener's
// session while the server still keeps it (a partition, or the instant
// before the listener closes): without it, producers leave the offer alone
// once the listener is gone (migration 0055) whether or not the stop
// withdrew it, and the test passed with the early withdrawal removed.
func TestStopWithdrawsOffersFirst(t *testing.T) {
	e := newEnv(t)
	holder := e.holdLeaseKey(t)
	const grace = 3 * time.Second
	block := make(chan struct{})
	defer close(block)
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		if string(m.Payload) == `"blocker"` {
			select {
			case <-block:
			case <-ctx.Done():
			}
		}
		return nil
	}}
	d, _ := startLeasing(t, e, bellhop.ConsumerSpec{MaxInFlight: 2, VisibilityTimeout: time.Minute}, rec,
		bellhop.DispatcherConfig{ShutdownGrace: grace})
	waitFor(t, 5*time.Second, "the first message acked", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	e.enqueue(t, "orders", "blocker", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "the blocker running and an offer out", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`) == 1 && e.offers(t) == 1
	})
	var owner uuid.UUID
	if err := e.pool.QueryRow(context.Background(), `SELECT owner FROM bellhop_offers`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	holdOwnerKey(t, holder, owner)
	go d.stop()
	waitFor(t, 5*time.Second, "the stopping dispatcher's listener gone", func() bool {
		return e.leaseKeyHolders(t, "bellhop-listener") == 0
	})
	// Another dispatcher, running and idle.
	rec2 := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec2)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux}, nil)
	start := time.Now()
	id := e.enqueue(t, "orders", "next", bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "the next message delivered", func() bool {
		for _, d := range rec2.deliveries() {
			if d.ID == id {
				return true
			}
		}
		return false
	})
	if took := time.Since(start); took > grace/2 {
		t.Errorf("a running dispatcher took %s to get a message enqueued during another's stop (grace %s)", took, grace)
	}
}
