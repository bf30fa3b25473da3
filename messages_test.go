package bellhop_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestDeleteMessage: DeleteMessage deletes a message that waits for
// delivery, ready, delayed or waiting for a retry, and nothing else: a
// message under a running handler is left to it, whose ack then counts;
// another app's message, an unknown app and another app's principal are
// refused with nothing deleted.
func TestDeleteMessage(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	e.app("shop")
	e.app("other")
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", BackoffBase: time.Hour, BackoffCap: time.Hour}); err != nil {
		t.Fatal(err)
	}
	otherPrincipal, err := c.CreatePrincipal(ctx, "other", "ops")
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(app, payload string, opts bellhop.EnqueueOptions) uuid.UUID {
		t.Helper()
		id, err := c.Enqueue(ctx, app, "orders", []byte(payload), opts)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	exists := func(id uuid.UUID) bool {
		return e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1`, id) == 1
	}

	// Without a dispatcher: ready and delayed messages, and refusals.
	ready := enqueue("shop", `"ready"`, bellhop.EnqueueOptions{})
	delayed := enqueue("shop", `"delayed"`, bellhop.EnqueueOptions{Delay: time.Hour})
	kept := enqueue("shop", `"kept"`, bellhop.EnqueueOptions{})
	foreign := enqueue("other", `"foreign"`, bellhop.EnqueueOptions{})
	for _, id := range []uuid.UUID{ready, delayed} {
		if err := c.DeleteMessage(ctx, "shop", id); err != nil || exists(id) {
			t.Errorf("DeleteMessage(%s): %v, still there: %v", id, err, exists(id))
		}
	}
	for _, tc := range []struct {
		name   string
		client *bellhop.Client
		app    string
		id     uuid.UUID
		want   error
	}{
		{"deleted already", c, "shop", ready, bellhop.ErrUnknownMessage},
		{"never enqueued", c, "shop", uuid.New(), bellhop.ErrUnknownMessage},
		{"another app's message", c, "shop", foreign, bellhop.ErrUnknownMessage},
		{"an unknown app", c, "nope", kept, bellhop.ErrUnknownApp},
		{"another app's principal", c.As(otherPrincipal), "shop", kept, bellhop.ErrForbidden},
	} {
		before := e.tableState("queue_messages")
		err := tc.client.DeleteMessage(ctx, tc.app, tc.id)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.id.String()) {
			t.Errorf("%s: %v; want %v naming the message", tc.name, err, tc.want)
		}
		if after := e.tableState("queue_messages"); after != before {
			t.Errorf("%s: the messages changed: %s, then %s", tc.name, before, after)
		}
	}
	if err := c.DeleteMessage(ctx, "shop", kept); err != nil {
		t.Fatal(err)
	}

	// With a dispatcher: a message in flight, and one waiting for its
	// retry (BackoffBase an hour).
	started := make(chan uuid.UUID, 4)
	release := make(chan struct{})
	var acked atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		started <- m.ID
		if string(m.Payload) == `"fail"` {
			return errors.New("failed on purpose")
		}
		<-release
		acked.Add(1)
		return nil
	}))
	runDispatcher(t, e.pool.Config().ConnString(), mux)
	busy := enqueue("shop", `"busy"`, bellhop.EnqueueOptions{})
	waitStarted := func(id uuid.UUID) {
		t.Helper()
		select {
		case got := <-started:
			if got != id {
				t.Fatalf("handler started %s, want %s", got, id)
			}
		case <-time.After(fxTimeout):
			t.Fatalf("message %s was not delivered within %s", id, fxTimeout)
		}
	}
	waitStarted(busy)
	before := e.tableState("queue_messages")
	err = c.DeleteMessage(ctx, "shop", busy)
	if !errors.Is(err, bellhop.ErrMessageInFlight) || !strings.Contains(err.Error(), "being delivered, under a lease taken or renewed at") {
		t.Errorf("DeleteMessage of a message under its handler: %v; want ErrMessageInFlight saying since when", err)
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Errorf("a message in flight changed: %s, then %s", before, after)
	}
	close(release)
	fxPoll(t, "the handler's ack", func() bool { return acked.Load() == 1 && !exists(busy) })

	failing := enqueue("shop", `"fail"`, bellhop.EnqueueOptions{})
	waitStarted(failing)
	fxPoll(t, "the failed delivery's nack", func() bool {
		return e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL AND attempt = 1 AND deliver_after > now()`, failing) == 1
	})
	if err := c.DeleteMessage(ctx, "shop", failing); err != nil || exists(failing) {
		t.Errorf("DeleteMessage of a message waiting for its retry: %v, still there: %v", err, exists(failing))
	}
	if n := e.int64(`SELECT count(*) FROM dead_letters`); n != 0 {
		t.Errorf("%d dead letters; a deleted message leaves none", n)
	}
}

// fxPoll polls cond every 5 ms until it holds, failing t after fxTimeout.
func fxPoll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(fxTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within %s", what, fxTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPurgeQueue: PurgeQueue deletes every message of the queue that
// waits for delivery, over several batches, and leaves the messages in
// flight, those enqueued after it began, other queues and other apps'
// queues of the same name; its refusals delete nothing.
func TestPurgeQueue(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	e.app("shop")
	e.app("other")
	otherPrincipal, err := c.CreatePrincipal(ctx, "other", "ops")
	if err != nil {
		t.Fatal(err)
	}
	const n = 2*bellhop.PurgeBatch + 345
	msgs := make([]bellhop.NewMessage, n)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: []byte(fmt.Sprint(i))}
		if i%3 == 0 {
			msgs[i].Options.Delay = time.Hour
		}
	}
	if _, err := c.EnqueueMany(ctx, "shop", msgs); err != nil {
		t.Fatal(err)
	}
	if _, err := c.EnqueueMany(ctx, "shop", []bellhop.NewMessage{{Queue: "emails", Payload: []byte(`1`)}, {Queue: "emails", Payload: []byte(`2`)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, "other", "orders", []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	// Two in flight, and one whose enqueued_at (a plain INSERT may set
	// it) is after the purge begins.
	e.exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1
		WHERE id IN (SELECT id FROM queue_messages WHERE queue_name = 'orders' AND app_id = (SELECT id FROM apps WHERE name = 'shop') LIMIT 2)`)
	e.exec(`INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at)
		SELECT id, 'orders', '"later"', now() + interval '1 hour' FROM apps WHERE name = 'shop'`)

	for _, tc := range []struct {
		name   string
		client *bellhop.Client
		app    string
		queue  string
		want   error
	}{
		{"a bad queue name", c, "shop", "or ders", bellhop.ErrInvalidQueueName},
		{"no queue name", c, "shop", "", bellhop.ErrInvalidQueueName},
		{"an unknown app", c, "nope", "orders", bellhop.ErrUnknownApp},
		{"another app's principal", c.As(otherPrincipal), "shop", "orders", bellhop.ErrForbidden},
	} {
		before := e.tableState("queue_messages")
		if n, err := tc.client.PurgeQueue(ctx, tc.app, tc.queue); n != 0 || !errors.Is(err, tc.want) {
			t.Errorf("%s: %d, %v; want 0, %v", tc.name, n, err, tc.want)
		}
		if after := e.tableState("queue_messages"); after != before {
			t.Errorf("%s: the messages changed: %s, then %s", tc.name, before, after)
		}
	}

	deleted, err := c.PurgeQueue(ctx, "shop", "orders")
	if err != nil || deleted != n-2 {
		t.Fatalf("PurgeQueue: %d, %v; want %d deleted", deleted, err, n-2)
	}
	left := e.int64(`SELECT count(*) FROM queue_messages m JOIN apps a ON a.id = m.app_id
		WHERE a.name = 'shop' AND m.queue_name = 'orders' AND (m.claim_token IS NOT NULL OR m.payload = '"later"')`)
	all := e.int64(`SELECT count(*) FROM queue_messages`)
	if left != 3 || all != 3+2+1 {
		t.Errorf("after the purge: %d of shop/orders in flight or later (want 3), %d messages in all (want 6)", left, all)
	}
	if deleted, err := c.PurgeQueue(ctx, "shop", "orders"); err != nil || deleted != 0 {
		t.Errorf("PurgeQueue again: %d, %v; want 0", deleted, err)
	}
}

// TestPurgeQueueBesideDispatcher: a purge while a dispatcher drains the
// same queue deletes no message that the dispatcher delivers: every
// message is delivered once or deleted, never both, and every handler's
// ack counts.
func TestPurgeQueueBesideDispatcher(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	e.app("shop")
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxInFlight: 50}); err != nil {
		t.Fatal(err)
	}
	const n = 3 * bellhop.PurgeBatch
	msgs := make([]bellhop.NewMessage, n)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: []byte(fmt.Sprint(i))}
	}
	if _, err := c.EnqueueMany(ctx, "shop", msgs); err != nil {
		t.Fatal(err)
	}
	// The first handlers wait for the purge's first batch to end, so that
	// the purge begins with messages in flight and its later batches run
	// while the dispatcher claims.
	var mu sync.Mutex
	delivered := map[uuid.UUID]int{}
	first, purging := make(chan struct{}), make(chan struct{})
	var once sync.Once
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		mu.Lock()
		delivered[m.ID]++
		mu.Unlock()
		once.Do(func() { close(first) })
		<-purging
		return nil
	}))
	runDispatcher(t, e.pool.Config().ConnString(), mux)
	select {
	case <-first:
	case <-time.After(fxTimeout):
		t.Fatal("no delivery")
	}
	cfg := e.pool.Config().Copy()
	cfg.ConnConfig.Tracer = &afterStatement{sql: queries.QueuePurge, then: func() { close(purging) }}
	purger, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer purger.Close()
	deleted, err := bellhop.NewClient(purger).PurgeQueue(ctx, "shop", "orders")
	if err != nil {
		t.Fatal(err)
	}
	fxPoll(t, "an empty queue", func() bool { return e.int64(`SELECT count(*) FROM queue_messages`) == 0 })
	mu.Lock()
	defer mu.Unlock()
	for id, k := range delivered {
		if k != 1 {
			t.Errorf("message %s delivered %d times", id, k)
		}
	}
	if int64(len(delivered))+deleted != n || deleted < bellhop.PurgeBatch {
		t.Errorf("%d delivered and %d deleted, want %d in all, the first batch's %d deleted at least", len(delivered), deleted, n, bellhop.PurgeBatch)
	}
	if dead := e.int64(`SELECT count(*) FROM dead_letters`); dead != 0 {
		t.Errorf("%d dead letters", dead)
	}
}

// afterStatement is a pgx tracer that runs then once, after the first
// statement whose text is sql has ended.
type afterStatement struct {
	sql  string
	then func()
	once sync.Once
}

type afterStatementKey struct{}

func (a *afterStatement) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == a.sql {
		return context.WithValue(ctx, afterStatementKey{}, true)
	}
	return ctx
}

func (a *afterStatement) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(afterStatementKey{}) != nil {
		a.once.Do(a.then)
	}
}

// TestPurgeQueueWaitsForLockedRows: a purge waits for a transaction that
// holds one of its messages' rows locked, as a claim holds more rows than
// it leases for its statement, and deletes that message once the lock is
// free. Skipping it, the purge said it was done with the message still
// there, to be delivered.
func TestPurgeQueueWaitsForLockedRows(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	e.app("shop")
	const n = 10
	msgs := make([]bellhop.NewMessage, n)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: []byte(fmt.Sprint(i))}
	}
	ids, err := c.EnqueueMany(ctx, "shop", msgs)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE`, ids[n/2]); err != nil {
		t.Fatal(err)
	}
	type result struct {
		n   int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := c.PurgeQueue(ctx, "shop", "orders")
		done <- result{n, err}
	}()
	fxPoll(t, "the purge waiting for the row lock", func() bool {
		select {
		case r := <-done:
			t.Fatalf("the purge ended without waiting for the locked row: %d, %v", r.n, r.err)
		default:
		}
		// The statement's text starts with queue_purge.sql's comment.
		return e.int64(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '-- Deletes a batch%'`) == 1
	})
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || r.n != n {
		t.Errorf("PurgeQueue: %d, %v; want all %d deleted", r.n, r.err, n)
	}
	if left := e.int64(`SELECT count(*) FROM queue_messages`); left != 0 {
		t.Errorf("%d messages left", left)
	}
}

// TestDeleteMessageBackInTheQueue: a message found leased by the delete
// and waiting for delivery by the lookup after it (its delivery failed
// in between) is deleted by the second try, not refused as in flight.
func TestDeleteMessageBackInTheQueue(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx := e.ctx
	e.app("shop")
	id, err := e.client.Enqueue(ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1 WHERE id = $1`, id)
	cfg := e.pool.Config().Copy()
	var nacked atomic.Bool
	cfg.ConnConfig.Tracer = &afterStatement{sql: queries.MessageDelete, then: func() {
		// As a nack: back in the queue for a retry.
		e.exec(`UPDATE queue_messages SET claim_token = NULL, claimed_at = NULL, deliver_after = now() + interval '1 hour' WHERE id = $1`, id)
		nacked.Store(true)
	}}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := bellhop.NewClient(pool).DeleteMessage(ctx, "shop", id); err != nil || !nacked.Load() {
		t.Errorf("DeleteMessage of a message nacked after the delete read it: %v (nacked in between: %v)", err, nacked.Load())
	}
	if e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1`, id) != 0 {
		t.Error("the message is still there")
	}
}

// TestQueuedMessage: QueuedMessage shows a message as it stands, waiting
// or in flight, and refuses another app's message, an unknown one, an
// unknown app and another app's principal.
func TestQueuedMessage(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	ctx, c := e.ctx, e.client
	shop := e.app("shop")
	e.app("other")
	otherPrincipal, err := c.CreatePrincipal(ctx, "other", "ops")
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	id, err := c.As(shop.DefaultPrincipal).Enqueue(ctx, "shop", "orders", []byte(`{"n": 1}`), bellhop.EnqueueOptions{Delay: time.Hour, MaxAttempts: 7})
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := c.Enqueue(ctx, "other", "orders", []byte(`2`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := c.QueuedMessage(ctx, "shop", id)
	if err != nil {
		t.Fatal(err)
	}
	near := func(at time.Time, to time.Time) bool { return at.Sub(to).Abs() < time.Minute }
	if m.ID != id || m.App != "shop" || m.Queue != "orders" || string(m.Payload) != `{"n": 1}` || !near(m.EnqueuedAt, before) ||
		m.DeliverAfter == nil || !near(*m.DeliverAfter, before.Add(time.Hour)) || m.Attempt != 0 || m.MaxAttempts != 7 ||
		m.EnqueuedBy == nil || *m.EnqueuedBy != shop.DefaultPrincipal || m.ClaimedAt != nil {
		t.Errorf("a delayed message waiting: %+v", m)
	}
	e.exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1 WHERE id = $1`, id)
	if m, err := c.QueuedMessage(ctx, "shop", id); err != nil || m.ClaimedAt == nil || !near(*m.ClaimedAt, time.Now()) || m.Attempt != 1 {
		t.Errorf("a message in flight: %+v, %v; want ClaimedAt now and attempt 1", m, err)
	}
	// A payload nested deeper than encoding/json reads, which plain SQL
	// can store, is read as it is; and DeleteMessage, which looks such a
	// message up to say why it deleted nothing, still says it is in flight.
	e.exec(`UPDATE queue_messages SET payload = (repeat('[', 10001) || repeat(']', 10001))::jsonb WHERE id = $1`, id)
	if m, err := c.QueuedMessage(ctx, "shop", id); err != nil || len(m.Payload) != 2*10001 {
		t.Errorf("a payload nested 10,001 deep: %d bytes, %v", len(m.Payload), err)
	}
	if err := c.DeleteMessage(ctx, "shop", id); !errors.Is(err, bellhop.ErrMessageInFlight) {
		t.Errorf("DeleteMessage of a message in flight with a deep payload: %v; want ErrMessageInFlight", err)
	}
	for _, tc := range []struct {
		name   string
		client *bellhop.Client
		app    string
		id     uuid.UUID
		want   error
	}{
		{"another app's message", c, "shop", foreign, bellhop.ErrUnknownMessage},
		{"an unknown message", c, "shop", uuid.New(), bellhop.ErrUnknownMessage},
		{"an unknown app", c, "nope", id, bellhop.ErrUnknownApp},
		{"another app's principal", c.As(otherPrincipal), "shop", id, bellhop.ErrForbidden},
	} {
		if m, err := tc.client.QueuedMessage(ctx, tc.app, tc.id); !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.id.String()) || m.ID != uuid.Nil {
			t.Errorf("%s: %+v, %v; want %v naming the message", tc.name, m, err, tc.want)
		}
	}
}
