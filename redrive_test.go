package bellhop_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestRedriveLeavesWhatCannotMove: a redrive moves what it can and says why
// the rest stayed. An invoke dead letter whose consumer was removed was
// left silently (a redrive by its id reported "no such dead letter"), and
// one whose id a producer had reused for a live message failed the whole
// redrive with a bare unique violation, moving nothing. What moves is
// enqueued anew.
func TestRedriveLeavesWhatCannotMove(t *testing.T) {
	e := fxNew(t)
	shop, cons := e.appConsumer("shop", "orders")
	dead := func(source string, trigger *uuid.UUID) uuid.UUID {
		t.Helper()
		id := uuid.New()
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
			VALUES ($1, $2, $3, 'orders', $4, '{"n":1}', now() - interval '3 days', 3, 3, 'boom')`, id, source, shop.ID, trigger)
		return id
	}
	plain := dead("queue", nil)
	reused := dead("queue", nil)
	orphan := dead("invoke", &cons.ID)
	// A producer reuses a dead message's id; the consumer goes.
	e.exec(`INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES ($1, $2, 'orders', '{"second":"life"}')`, reused, shop.ID)
	if err := e.client.RemoveConsumer(e.ctx, "shop", cons.ID); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name               string
		id                 uuid.UUID
		gone, inUse, moved int64
	}{
		{"by id, consumer gone", orphan, 1, 0, 0},
		{"by id, id in use", reused, 0, 1, 0},
		{"the queue", uuid.Nil, 1, 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			n, err := e.client.Redrive(e.ctx, "shop", "orders", c.id)
			var nr *bellhop.NotRedrivenError
			if !errors.Is(err, bellhop.ErrNotRedriven) || !errors.As(err, &nr) {
				t.Fatalf("Redrive: %d, %v; want ErrNotRedriven", n, err)
			}
			if n != c.moved || nr.ConsumerGone != c.gone || nr.IDInUse != c.inUse {
				t.Errorf("moved %d, left %+v; want moved %d, %d consumer gone, %d id in use (%v)", n, *nr, c.moved, c.gone, c.inUse, err)
			}
		})
	}
	// What stayed is intact; the live message is the producer's, untouched.
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id IN ($1, $2)`, orphan, reused); got != 2 {
		t.Errorf("%d of the 2 dead letters that could not move are left", got)
	}
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1`, plain); got != 0 {
		t.Error("the movable dead letter was not redriven")
	}
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND payload = '{"second":"life"}'`, reused); got != 1 {
		t.Error("the live message with the reused id changed")
	}
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND attempt = 0 AND claim_token IS NULL`, plain); got != 1 {
		t.Error("the redriven message is not back in its queue, fresh")
	}
	// Enqueued anew, behind the backlog: not first in line, and not 3
	// days old in the queue's age and latency figures.
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND enqueued_at > now() - interval '1 minute'`, plain); got != 1 {
		t.Error("the redriven message kept its first enqueued_at")
	}
}

// TestRedriveBesideUncommittedChange: a redrive that meets a change not
// yet committed (a producer's insert reusing a dead letter's id, or the
// removal of an invoke dead letter's consumer) waits for it, then moves
// what it can and counts what stayed as if the change had been there
// before. It failed the whole redrive with a unique or foreign-key
// violation, moving nothing, and on a rollback it still moves everything.
func TestRedriveBesideUncommittedChange(t *testing.T) {
	t.Parallel()
	const (
		produce = iota
		removeConsumer
		redrive
	)
	for _, c := range []struct {
		name               string
		change             int
		commit             bool
		moved, gone, inUse int64
		left, live         int64 // dead letters; messages and deliveries
	}{
		{"producer commits", produce, true, 1, 0, 1, 1, 2},
		{"producer rolls back", produce, false, 2, 0, 0, 0, 2},
		{"consumer removal commits", removeConsumer, true, 0, 2, 0, 2, 0},
		{"consumer removal rolls back", removeConsumer, false, 2, 0, 0, 0, 2},
		// Nothing doubled: the second redrive finds nothing left to move.
		{"another redrive commits", redrive, true, 0, 0, 0, 0, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			shop, cons := e.appConsumer("shop", "orders")
			source, trigger := "queue", (*uuid.UUID)(nil)
			if c.change == removeConsumer {
				source, trigger = "invoke", &cons.ID
			}
			ids := []uuid.UUID{uuid.New(), uuid.New()}
			for _, id := range ids {
				e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
					VALUES ($1, $2, $3, 'orders', $4, '{"n":1}', now(), 3, 3, 'boom')`, id, source, shop.ID, trigger)
			}
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			change := `INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES ($1, $2, 'orders', '{"second":"life"}')`
			args := []any{ids[0], shop.ID}
			switch c.change {
			case removeConsumer:
				change, args = `DELETE FROM triggers WHERE id = $1`, []any{cons.ID}
			case redrive:
				change, args = queries.DeadRedrive, []any{pgx.NamedArgs{"app_name": "shop", "queue_name": "orders", "id": nil}}
			}
			if _, err := tx.Exec(e.ctx, change, args...); err != nil {
				t.Fatal(err)
			}
			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := e.client.Redrive(e.ctx, "shop", "orders", uuid.Nil)
				done <- result{n, err}
			}()
			waitUntil(t, 30*time.Second, "the redrive to wait for the change", func() bool {
				return e.int64(`SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%dead_letters%'`) > 0
			})
			if c.commit {
				err = tx.Commit(e.ctx)
			} else {
				err = tx.Rollback(e.ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			r := <-done
			var nr *bellhop.NotRedrivenError
			switch {
			case c.gone+c.inUse == 0 && r.err != nil:
				t.Fatalf("Redrive: %d, %v; want every dead letter moved", r.n, r.err)
			case c.gone+c.inUse > 0 && !errors.As(r.err, &nr):
				t.Fatalf("Redrive: %d, %v; want a NotRedrivenError", r.n, r.err)
			}
			if nr == nil {
				nr = &bellhop.NotRedrivenError{}
			}
			if r.n != c.moved || nr.ConsumerGone != c.gone || nr.IDInUse != c.inUse {
				t.Errorf("moved %d, left %+v; want moved %d, %d consumer gone, %d id in use", r.n, *nr, c.moved, c.gone, c.inUse)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters`); got != c.left {
				t.Errorf("%d dead letters left, want %d", got, c.left)
			}
			if got := e.int64(`SELECT count(*) FROM queue_messages`) + e.int64(`SELECT count(*) FROM outbox`); got != c.live {
				t.Errorf("%d messages and deliveries, want %d", got, c.live)
			}
		})
	}
}

// TestRedriveBesideDyingReusedID: a redrive that meets a dead letter whose
// id is live, and whose live message is being dead-lettered at that
// moment (its delete done, its dead letter not yet written), leaves the
// dead letter without waiting, and the dead-lettering goes through. The
// redrive locked the dead letter and then waited for the delete, while the
// dead-lettering waited for the lock: a deadlock, which could fail a
// reclaim pass for every app.
func TestRedriveBesideDyingReusedID(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	id := uuid.New()
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		VALUES ($1, 'queue', $2, 'orders', '{"first":1}', now(), 3, 3, 'boom')`, id, shop.ID)
	e.exec(`INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES ($1, $2, 'orders', '{"second":2}')`, id, shop.ID)

	// The dying message, as dead_letter.sql treats it: deleted, then its
	// dead letter written, in one transaction.
	dying, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer dying.Rollback(e.ctx)
	if _, err := dying.Exec(e.ctx, `DELETE FROM queue_messages WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.client.Redrive(e.ctx, "shop", "", id)
		done <- err
	}()
	select {
	case err := <-done:
		var nr *bellhop.NotRedrivenError
		if !errors.As(err, &nr) || nr.IDInUse != 1 {
			t.Errorf("Redrive: %v; want the dead letter left as id in use", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the redrive waited for the dying message's transaction")
	}
	if _, err := dying.Exec(e.ctx, `INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		VALUES ($1, 'queue', $2, 'orders', '{"second":2}', now(), 3, 3, 'boom again')
		ON CONFLICT (id, app_id, source) DO UPDATE SET payload = EXCLUDED.payload, last_error = EXCLUDED.last_error`, id, shop.ID); err != nil {
		t.Fatalf("the dead-lettering after the redrive: %v", err)
	}
	if err := dying.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}
}

// TestRedriveSharedIDMovesOnlyItsOwn: a queue dead letter and an invoke
// dead letter may share an id (dead letters are keyed by id, app and
// source); a redrive by that id whose invoke one cannot move, its consumer
// removed, moves the queue one and leaves the invoke one. Were the delete
// of what moved to match on id and app alone, the queue message's insert
// would delete both dead letters, losing the invoke one from both tables,
// and report 2 moved with no error.
func TestRedriveSharedIDMovesOnlyItsOwn(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, cons := e.appConsumer("shop", "orders")
	id := uuid.New()
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
		VALUES ($1, 'queue', $2, 'orders', NULL, '{"q":1}', now(), 3, 3, 'boom'),
		       ($1, 'invoke', $2, 'orders', $3, '{"i":1}', now(), 3, 3, 'boom')`, id, shop.ID, cons.ID)
	if err := e.client.RemoveConsumer(e.ctx, "shop", cons.ID); err != nil {
		t.Fatal(err)
	}

	n, err := e.client.Redrive(e.ctx, "shop", "", id)
	var nr *bellhop.NotRedrivenError
	if !errors.Is(err, bellhop.ErrNotRedriven) || !errors.As(err, &nr) {
		t.Errorf("Redrive: %d, %v; want ErrNotRedriven", n, err)
		nr = &bellhop.NotRedrivenError{}
	}
	if n != 1 || nr.ConsumerGone != 1 || nr.IDInUse != 0 {
		t.Errorf("moved %d, left %+v; want 1 moved, 1 consumer gone, 0 id in use", n, *nr)
	}
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1 AND source = 'invoke' AND payload = '{"i":1}'`, id); got != 1 {
		t.Error("the invoke dead letter that could not move is gone: lost from both tables")
	}
	if got := e.int64(`SELECT count(*) FROM outbox WHERE id = $1`, id); got != 0 {
		t.Error("the invoke dead letter whose consumer is gone was moved to the outbox")
	}
	if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1 AND source = 'queue'`, id); got != 0 {
		t.Error("the queue dead letter was not redriven")
	}
	if got := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND payload = '{"q":1}' AND attempt = 0`, id); got != 1 {
		t.Error("the queue dead letter is not back in its queue, fresh")
	}
}

// TestRedriveMovesOnlyItsApp: a redrive of one app's dead letters, by
// queue or by id, leaves another app's alone, also when that app has a
// queue of the same name and a dead letter of the same id (dead letters
// are keyed by id, app and source). No other test had two apps' dead
// letters in reach of one redrive, so one that selected every app's went
// unnoticed.
func TestRedriveMovesOnlyItsApp(t *testing.T) {
	t.Parallel()
	for _, byID := range []bool{false, true} {
		name := map[bool]string{false: "by queue", true: "by id"}[byID]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			alpha, beta := e.app("alpha"), e.app("beta")
			alphaID, betaID := uuid.New(), uuid.New()
			if byID {
				betaID = alphaID
			}
			for _, d := range []struct {
				id  uuid.UUID
				app uuid.UUID
			}{{alphaID, alpha.ID}, {betaID, beta.ID}} {
				e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
					VALUES ($1, 'queue', $2, 'orders', '{"n":1}', now(), 3, 3, 'boom')`, d.id, d.app)
			}
			queue, id := "orders", uuid.Nil
			if byID {
				queue, id = "", alphaID
			}
			n, err := e.client.Redrive(e.ctx, "alpha", queue, id)
			if err != nil || n != 1 {
				t.Errorf("Redrive(alpha, %q, %s): %d, %v; want 1 moved, no error", queue, id, n, err)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters WHERE app_id = $1`, alpha.ID); got != 0 {
				t.Errorf("%d of alpha's dead letters left, want 0", got)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters WHERE app_id = $1 AND id = $2`, beta.ID, betaID); got != 1 {
				t.Error("beta's dead letter was moved by alpha's redrive")
			}
			if got := e.int64(`SELECT count(*) FROM queue_messages WHERE app_id = $1`, beta.ID); got != 0 {
				t.Errorf("beta's queue holds %d messages, want 0", got)
			}
			if got := e.int64(`SELECT count(*) FROM queue_messages WHERE app_id = $1 AND id = $2`, alpha.ID, alphaID); got != 1 {
				t.Error("alpha's dead letter is not back in alpha's queue")
			}
		})
	}
}

// TestMaxAttemptsIsTheMessages: the attempt limit that counts is each
// message's own max_attempts, fixed when it is enqueued: the producer's,
// else the queue consumer's MaxAttempts of that moment, else 3 (no
// consumer, or a plain INSERT). Registering a consumer or changing its
// MaxAttempts leaves queued messages' limits alone, and a redrive counts
// attempts from 0 again against the dead letter's own limit, not the
// consumer's MaxAttempts of now.
func TestMaxAttemptsIsTheMessages(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	enqueue := func(opts bellhop.EnqueueOptions) uuid.UUID {
		t.Helper()
		id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), opts)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	setMax := func(id uuid.UUID, n int) {
		t.Helper()
		if err := e.client.UpdateConsumer(e.ctx, "shop", id, bellhop.ConsumerUpdate{MaxAttempts: &n}); err != nil {
			t.Fatal(err)
		}
	}
	beforeConsumer := enqueue(bellhop.EnqueueOptions{})
	cons, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxAttempts: 2,
		BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	underFirst := enqueue(bellhop.EnqueueOptions{})
	own := enqueue(bellhop.EnqueueOptions{MaxAttempts: 4})
	setMax(cons.ID, 5)
	plain := uuid.New()
	e.exec(`INSERT INTO queue_messages (id, app_id, queue_name, payload) VALUES ($1, $2, 'orders', '1')`, plain, shop.ID)
	afterUpdate := enqueue(bellhop.EnqueueOptions{})
	cases := []struct {
		name string
		id   uuid.UUID
		max  int
	}{
		{"enqueued before the consumer", beforeConsumer, 3},
		{"enqueued under MaxAttempts 2, then updated to 5", underFirst, 2},
		{"its own MaxAttempts 4", own, 4},
		{"plain INSERT", plain, 3},
		{"enqueued after the update to 5", afterUpdate, 5},
	}

	var mu sync.Mutex
	seen := map[uuid.UUID][]string{}
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen[m.ID] = append(seen[m.ID], fmt.Sprintf("%d/%d", m.Attempt, m.MaxAttempts))
		return errors.New("fail")
	}))
	d, err := bellhop.NewDispatcher(e.pool.Config().Copy(), bellhop.DispatcherConfig{Resolver: mux,
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.ErrorLevel)})
	if err != nil {
		t.Fatal(err)
	}
	stoppable(t, e.ctx, d)

	// round waits for every message to be dead, then checks that each was
	// delivered up to its own limit, rounds times over.
	round := func(rounds int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for e.int64(`SELECT count(*) FROM dead_letters`) < int64(len(cases)) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %d of %d messages dead-lettered after 30s", rounds, e.int64(`SELECT count(*) FROM dead_letters`), len(cases))
			}
			time.Sleep(10 * time.Millisecond)
		}
		mu.Lock()
		defer mu.Unlock()
		for _, c := range cases {
			var want []string
			for range rounds {
				for n := 1; n <= c.max; n++ {
					want = append(want, fmt.Sprintf("%d/%d", n, c.max))
				}
			}
			if !slices.Equal(seen[c.id], want) {
				t.Errorf("round %d, %s: deliveries %v, want %v", rounds, c.name, seen[c.id], want)
			}
			dead := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1 AND attempt = $2 AND max_attempts = $2`, c.id, c.max)
			if dead != 1 {
				t.Errorf("round %d, %s: no dead letter at attempt %d/%d", rounds, c.name, c.max, c.max)
			}
		}
	}
	round(1)
	setMax(cons.ID, 7)
	if n, err := e.client.Redrive(e.ctx, "shop", "orders", uuid.Nil); err != nil || n != int64(len(cases)) {
		t.Fatalf("Redrive: %d, %v; want %d moved", n, err, len(cases))
	}
	round(2)
}

// TestOverlappingRedrivesAndPurgesDoNotDeadlock: bulk redrives and purges
// of one app's dead letters, by queue and app-wide, run at once over the
// same rows. Each locked the dead letters it selected in the order its
// plan read them: a by-queue one in died_at order (idx_dead_letters_queue),
// an app-wide one in the table's order, here the reverse. Two of them met
// in the middle and PostgreSQL failed one with 40P01 ("redrive dead
// letters of shop: ERROR: deadlock detected"), in most rounds. They now
// lock in key order, whatever the plan: none fails, and every dead letter
// is moved or purged once.
func TestOverlappingRedrivesAndPurgesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	// No statistics: a by-queue statement reads idx_dead_letters_queue, an
	// app-wide one idx_dead_letters_died by bitmap, in the table's order.
	// Autovacuum analysing the table halfway would change the plans.
	e.exec(`ALTER TABLE dead_letters SET (autovacuum_enabled = off)`)

	const rows, rounds = 3000, 5
	type op struct {
		name  string
		purge bool
		queue string
	}
	ops := []op{
		{"redrive orders", false, "orders"}, {"redrive orders", false, "orders"},
		{"redrive all", false, ""}, {"redrive all", false, ""},
		{"purge orders", true, "orders"}, {"purge all", true, ""},
	}
	for round := range rounds {
		// Inserted newest first: the table's order is the reverse of
		// died_at's. Two of three are in orders, the rest in refunds.
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
			SELECT gen_random_uuid(), 'queue', $1, CASE WHEN g % 3 = 0 THEN 'refunds' ELSE 'orders' END,
			       jsonb_build_object('round', $2::int, 'n', g), now(), 3, 3, 'boom', now() - g * interval '1 millisecond'
			FROM generate_series(1, $3::int) g ORDER BY g`, shop.ID, round, rows)

		start := make(chan struct{})
		counts := make([]int64, len(ops))
		errs := make([]error, len(ops))
		var wg sync.WaitGroup
		for i, o := range ops {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if o.purge {
					counts[i], errs[i] = e.client.PurgeDead(e.ctx, "shop", o.queue, uuid.Nil)
				} else {
					counts[i], errs[i] = e.client.Redrive(e.ctx, "shop", o.queue, uuid.Nil)
				}
			}()
		}
		close(start)
		wg.Wait()

		var moved, purged int64
		for i, o := range ops {
			if errs[i] != nil {
				t.Errorf("round %d: %s: %v", round, o.name, errs[i])
			}
			if o.purge {
				purged += counts[i]
			} else {
				moved += counts[i]
			}
		}
		if moved+purged != rows {
			t.Errorf("round %d: %d moved and %d purged, want %d in all", round, moved, purged, rows)
		}
		if got := e.int64(`SELECT count(*) FROM dead_letters`); got != 0 {
			t.Errorf("round %d: %d dead letters left, want 0", round, got)
		}
		if got := e.int64(`SELECT count(*) FROM queue_messages WHERE (payload->>'round')::int = $1`, round); got != moved {
			t.Errorf("round %d: %d messages back in their queues, want the %d moved", round, got, moved)
		}
		// A failed round's leftovers stay out of the next one's totals.
		e.exec(`DELETE FROM dead_letters`)
	}
}

// TestDeadOpConflictSaysRetry: a redrive or purge that PostgreSQL ends for
// a concurrent change of the same dead letters says that nothing changed
// and that it may be retried, the server's error still wrapped. Here the
// session defaults to repeatable read, and another transaction deletes a
// dead letter the call waits for: 40001. Its error was the server's
// alone.
func TestDeadOpConflictSaysRetry(t *testing.T) {
	t.Parallel()
	for _, purge := range []bool{false, true} {
		name := map[bool]string{false: "redrive", true: "purge"}[purge]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			shop := e.app("shop")
			ids := []uuid.UUID{uuid.New(), uuid.New()}
			for _, id := range ids {
				e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
					VALUES ($1, 'queue', $2, 'orders', '{"n":1}', now(), 3, 3, 'boom')`, id, shop.ID)
			}
			cfg := e.pool.Config().Copy()
			cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
			pool, err := pgxpool.NewWithConfig(e.ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			client := bellhop.NewClient(pool)

			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			if _, err := tx.Exec(e.ctx, `DELETE FROM dead_letters WHERE id = $1`, ids[0]); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				var err error
				if purge {
					_, err = client.PurgeDead(e.ctx, "shop", "orders", uuid.Nil)
				} else {
					_, err = client.Redrive(e.ctx, "shop", "orders", uuid.Nil)
				}
				done <- err
			}()
			waitUntil(t, 30*time.Second, "the "+name+" to wait for the delete", func() bool {
				return e.int64(`SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%dead_letters%'`) > 0
			})
			if err := tx.Commit(e.ctx); err != nil {
				t.Fatal(err)
			}
			err = <-done
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "40001" {
				t.Fatalf("%s: %v; want a serialization failure (40001)", name, err)
			}
			if !strings.Contains(err.Error(), "nothing changed; retry") {
				t.Errorf("%s: %q does not say that nothing changed and to retry", name, err)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1`, ids[1]); got != 1 {
				t.Errorf("the other dead letter is gone, want it left: the %s failed", name)
			}
		})
	}
}

// TestDeadLettersInBatches: a redrive or a purge moves or deletes at
// most DeadBatch dead letters a statement, by app or by queue, and takes
// only those that died before it began. One statement did it all: a
// redrive of 200,000 held its locks for 14 s, and any timeout lost all of
// its work; and, as the insert trigger holds a lock on each queue it
// inserts into until the statement's transaction ends, a redrive of an app
// with 150,000 queues of dead letters filled the server's lock table ("out
// of shared memory"). A statement-level trigger records the advisory
// locks the redriving session holds as each insert ends.
func TestDeadLettersInBatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		queue       string // "" for the whole app
		queues, per int    // dead letters in q1, q2, ... : per each
		statements  int64
	}{
		{"app", "", 1201, 2, 5},        // 2,402 dead letters
		{"queue", "q1", 3, 2, 1},       // the other queues' stay
		{"big queue", "q1", 2, 700, 2}, // the other queue's stays
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			shop := e.app("shop")
			e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
				SELECT gen_random_uuid(), 'queue', $1, 'q' || i, '{"n":1}', now(), 3, 3, 'boom', now() - interval '1 hour'
				FROM generate_series(1, $2::int) i, generate_series(1, $3::int)`, shop.ID, tc.queues, tc.per)
			// Died after the redrive began (a redriven message failing
			// again): left for the next.
			later := uuid.New()
			e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
				VALUES ($1, 'queue', $2, 'q1', '{}', now(), 3, 3, 'boom', now() + interval '1 hour')`, later, shop.ID)
			e.exec(`CREATE TABLE locks_seen (n bigint)`)
			e.exec(`CREATE FUNCTION count_locks() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					INSERT INTO locks_seen SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory';
					RETURN NULL;
				END $$`)
			e.exec(`CREATE TRIGGER count_locks AFTER INSERT ON queue_messages FOR EACH STATEMENT EXECUTE FUNCTION count_locks()`)
			want := int64(tc.queues * tc.per)
			if tc.queue != "" {
				want = int64(tc.per)
			}
			left := e.int64(`SELECT count(*) FROM dead_letters`) - want
			n, err := e.client.Redrive(e.ctx, "shop", tc.queue, uuid.Nil)
			if err != nil || n != want {
				t.Fatalf("Redrive(shop, %q): %d, %v; want %d moved", tc.queue, n, err, want)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters`); got != left {
				t.Errorf("%d dead letters left, want %d", got, left)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1`, later); got != 1 {
				t.Error("the dead letter that died after the redrive began was moved")
			}
			if got := e.int64(`SELECT count(*) FROM queue_messages`); got != want {
				t.Errorf("%d messages back, want %d", got, want)
			}
			most, stmts := e.int64(`SELECT coalesce(max(n), 0) FROM locks_seen`), e.int64(`SELECT count(*) FROM locks_seen`)
			if most > bellhop.DeadBatch || stmts != tc.statements {
				t.Errorf("the redrive's statements held up to %d advisory locks, in %d statements; want at most %d, in %d", most, stmts, bellhop.DeadBatch, tc.statements)
			}
			// The purge, in batches too, takes what is left but the later
			// one.
			gone, err := e.client.PurgeDead(e.ctx, "shop", "", uuid.Nil)
			if err != nil || gone != left-1 {
				t.Errorf("PurgeDead(shop): %d, %v; want %d deleted", gone, err, left-1)
			}
			if got := e.int64(`SELECT count(*) FROM dead_letters`); got != 1 {
				t.Errorf("%d dead letters after the purge, want 1, the later one", got)
			}
		})
	}
}

// TestRedriveBatchesPassWhatStays: dead letters that cannot move (their
// ids taken again by live messages) stay where they are, and the next
// batch starts after them, also within one died_at, which all of these
// share: a batch that began again at the same dead letters would never
// end. Every one is counted once.
func TestRedriveBatchesPassWhatStays(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	stuck := bellhop.DeadBatch + 100
	e.exec(`WITH d AS (
			INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
			SELECT gen_random_uuid(), 'queue', $1, 'orders', '{}', now(), 3, 3, 'boom' FROM generate_series(1, $2::int)
			RETURNING id)
		INSERT INTO queue_messages (id, app_id, queue_name, payload) SELECT id, $1, 'orders', '{}' FROM d`, shop.ID, stuck)
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT gen_random_uuid(), 'queue', $1, 'orders', '{}', now(), 3, 3, 'boom' FROM generate_series(1, 3)`, shop.ID)
	n, err := e.client.Redrive(e.ctx, "shop", "orders", uuid.Nil)
	var nr *bellhop.NotRedrivenError
	if !errors.As(err, &nr) || n != 3 || nr.IDInUse != int64(stuck) || nr.ConsumerGone != 0 {
		t.Fatalf("Redrive: %d, %v; want 3 moved and %d left with their ids in use", n, err, stuck)
	}
	if got := e.int64(`SELECT count(*) FROM dead_letters`); got != int64(stuck) {
		t.Errorf("%d dead letters left, want %d", got, stuck)
	}
}
