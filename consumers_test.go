package bellhop_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
)

// TestPushTimeoutMustFitLease: a push timeout longer than the lease allows
// (the visibility timeout less its margin) would be cut short by the
// lease without a word, so registering one, or an update that leaves one
// (changing either timeout), is refused with ErrInvalidOptions, naming the
// limit, and changes nothing.
func TestPushTimeoutMustFitLease(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	const url = "http://consumer.test/hook"
	d := func(s string) *time.Duration {
		v, err := time.ParseDuration(s)
		if err != nil {
			t.Fatal(err)
		}
		return &v
	}

	register := []struct {
		vt, timeout string
		ok          bool
	}{
		{vt: "30s", timeout: "25s", ok: true},
		{vt: "30s", timeout: "25.001s"},
		{vt: "30s", timeout: "2m"},
		{vt: "10s", timeout: "8s", ok: true},
		{vt: "10s", timeout: "9s"},
		{vt: "1s", timeout: "800ms", ok: true},
		{vt: "1s", timeout: "801ms"},
		{vt: "30s", timeout: "0s", ok: true}, // the default, which fits
	}
	for i, tc := range register {
		spec := bellhop.ConsumerSpec{App: "shop", Queue: "r" + string(rune('a'+i)), URL: url,
			VisibilityTimeout: *d(tc.vt), Timeout: *d(tc.timeout)}
		before := e.tableState("queue_trigger_details")
		_, err := e.client.RegisterConsumer(e.ctx, spec)
		if tc.ok {
			if err != nil {
				t.Errorf("register with visibility timeout %s, push timeout %s: %v", tc.vt, tc.timeout, err)
			}
			continue
		}
		fxCheckTyped(t, err, bellhop.ErrInvalidOptions)
		if err != nil && !strings.Contains(err.Error(), "at most") {
			t.Errorf("register with visibility timeout %s, push timeout %s: error %q does not name the limit", tc.vt, tc.timeout, err)
		}
		if after := e.tableState("queue_trigger_details"); after != before {
			t.Errorf("refused registration changed queue_trigger_details: %s, was %s", after, before)
		}
	}

	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", URL: url,
		VisibilityTimeout: 30 * time.Second, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	updates := []struct {
		name string
		u    bellhop.ConsumerUpdate
		ok   bool
	}{
		{name: "timeout past the stored lease", u: bellhop.ConsumerUpdate{Timeout: d("26s")}},
		{name: "lease below the stored timeout", u: bellhop.ConsumerUpdate{VisibilityTimeout: d("20s")}},
		{name: "both, not fitting", u: bellhop.ConsumerUpdate{VisibilityTimeout: d("10s"), Timeout: d("9s")}},
		{name: "lease below the stored timeout, with a pause", u: bellhop.ConsumerUpdate{VisibilityTimeout: d("5s"), Enabled: new(bool)}},
		{name: "both, fitting", u: bellhop.ConsumerUpdate{VisibilityTimeout: d("10s"), Timeout: d("8s")}, ok: true},
		{name: "lease raised", u: bellhop.ConsumerUpdate{VisibilityTimeout: d("1m")}, ok: true},
		{name: "timeout up to the new lease", u: bellhop.ConsumerUpdate{Timeout: d("55s")}, ok: true},
		{name: "timeout reset, then the lease lowered", u: bellhop.ConsumerUpdate{Timeout: d("0s"), VisibilityTimeout: d("2s")}, ok: true},
	}
	for _, tc := range updates {
		before := e.tableState("queue_trigger_details") + e.tableState("triggers")
		err := e.client.UpdateConsumer(e.ctx, "shop", c.ID, tc.u)
		if tc.ok {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		fxCheckTyped(t, err, bellhop.ErrInvalidOptions)
		if after := e.tableState("queue_trigger_details") + e.tableState("triggers"); after != before {
			t.Errorf("%s: refused update changed the consumer: %s, was %s", tc.name, after, before)
		}
	}
	got, err := e.client.ConsumerOf(e.ctx, "shop", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if got.VisibilityTimeout != 2*time.Second || got.Timeout != 0 || !got.Enabled {
		t.Errorf("after the updates: visibility timeout %s, push timeout %s, enabled %t; want 2s, 0 (the default), true",
			got.VisibilityTimeout, got.Timeout, got.Enabled)
	}

	if err := e.client.UpdateConsumer(e.ctx, "shop", [16]byte{1}, bellhop.ConsumerUpdate{Timeout: d("1s")}); err == nil {
		t.Error("updating the timeout of an unknown consumer succeeded")
	} else {
		fxCheckTyped(t, err, bellhop.ErrUnknownConsumer)
	}
}

// TestConsumerSettingsStoredAsGiven: what the table cannot keep as given
// is refused, not stored changed. A 1.5ms backoff base was stored as 1ms
// while RegisterConsumer returned 1.5ms, and a Go handler's consumer took
// a push timeout that nothing would ever apply.
func TestConsumerSettingsStoredAsGiven(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	const url = "http://consumer.test/hook"
	goHandler, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "go"})
	if err != nil {
		t.Fatal(err)
	}
	push, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "push", URL: url})
	if err != nil {
		t.Fatal(err)
	}
	dur := func(d time.Duration) *time.Duration { return &d }
	for _, tc := range []struct {
		name string
		do   func() error
		want string
	}{
		{"register, backoff base 1.5ms", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "a", BackoffBase: 1500 * time.Microsecond})
			return err
		}, "backoff base 1.5ms is not a whole number of milliseconds"},
		{"register, backoff cap 2.9ms", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "a", BackoffBase: time.Millisecond, BackoffCap: 2900 * time.Microsecond})
			return err
		}, "backoff cap 2.9ms is not a whole number of milliseconds"},
		{"register, push timeout 150.5ms", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "a", URL: url, Timeout: 150500 * time.Microsecond})
			return err
		}, "push timeout 150.5ms is not a whole number of milliseconds"},
		{"register a Go handler's consumer with a push timeout", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "a", Timeout: time.Second})
			return err
		}, "a push timeout applies only to an HTTP push consumer"},
		{"update, backoff base 1.5ms", func() error {
			return e.client.UpdateConsumer(e.ctx, "shop", push.ID, bellhop.ConsumerUpdate{BackoffBase: dur(1500 * time.Microsecond)})
		}, "backoff base 1.5ms is not a whole number of milliseconds"},
		{"update, push timeout 150.5ms", func() error {
			return e.client.UpdateConsumer(e.ctx, "shop", push.ID, bellhop.ConsumerUpdate{Timeout: dur(150500 * time.Microsecond)})
		}, "push timeout 150.5ms is not a whole number of milliseconds"},
		{"update a Go handler's consumer with a push timeout", func() error {
			return e.client.UpdateConsumer(e.ctx, "shop", goHandler.ID, bellhop.ConsumerUpdate{Timeout: dur(time.Second)})
		}, "a push timeout applies only to an HTTP push consumer"},
		{"update a Go handler's consumer with an empty URL", func() error {
			empty := ""
			return e.client.UpdateConsumer(e.ctx, "shop", goHandler.ID, bellhop.ConsumerUpdate{URL: &empty})
		}, "one served by a Go handler has none"},
		{"update a push consumer with an empty URL", func() error {
			empty := ""
			return e.client.UpdateConsumer(e.ctx, "shop", push.ID, bellhop.ConsumerUpdate{URL: &empty})
		}, "a push consumer's URL cannot be removed (remove the consumer instead)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := e.tableState("queue_trigger_details") + e.tableState("triggers")
			err := tc.do()
			fxCheckTyped(t, err, bellhop.ErrInvalidOptions)
			if err != nil && !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not say %q", err, tc.want)
			}
			if after := e.tableState("queue_trigger_details") + e.tableState("triggers"); after != before {
				t.Errorf("refused call changed the consumers: %s, was %s", after, before)
			}
		})
	}
	// Resetting a Go handler's push timeout to the default does nothing,
	// and is allowed; whole milliseconds are kept as given.
	if err := e.client.UpdateConsumer(e.ctx, "shop", goHandler.ID, bellhop.ConsumerUpdate{Timeout: dur(0)}); err != nil {
		t.Errorf("reset a Go handler's push timeout: %v", err)
	}
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "ms", URL: url,
		BackoffBase: 3 * time.Millisecond, BackoffCap: 7 * time.Millisecond, Timeout: 151 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	got, err := e.client.ConsumerOf(e.ctx, "shop", "ms")
	if err != nil {
		t.Fatal(err)
	}
	if got.BackoffBase != c.BackoffBase || got.BackoffCap != c.BackoffCap || got.Timeout != c.Timeout || got.Timeout != 151*time.Millisecond {
		t.Errorf("stored base %s, cap %s, timeout %s; RegisterConsumer returned %s, %s, %s",
			got.BackoffBase, got.BackoffCap, got.Timeout, c.BackoffBase, c.BackoffCap, c.Timeout)
	}
}

// TestUpdateBackoffCapBelowBase: an update that would leave the backoff
// cap below the base is refused with ErrInvalidOptions naming both values,
// as RegisterConsumer's refusal does, also when it gives only one of the
// two and the consumer's other is in the way; it changes nothing. That
// case failed on the table's check, with the bare constraint violation.
func TestUpdateBackoffCapBelowBase(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders",
		BackoffBase: 2 * time.Second, BackoffCap: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	d := func(v time.Duration) *time.Duration { return &v }
	tests := []struct {
		name string
		u    bellhop.ConsumerUpdate
		want string // in the error; "" for none
	}{
		{"cap below the stored base", bellhop.ConsumerUpdate{BackoffCap: d(time.Second)},
			"backoff cap 1s is below backoff base 2s (the consumer's current base: lower it in the same update)"},
		{"base above the stored cap", bellhop.ConsumerUpdate{BackoffBase: d(2 * time.Minute)},
			"backoff cap 1m0s is below backoff base 2m0s (the consumer's current cap: raise it in the same update)"},
		{"both, cap below base", bellhop.ConsumerUpdate{BackoffBase: d(3 * time.Second), BackoffCap: d(time.Second)},
			"backoff cap 1s is below backoff base 3s"},
		{"cap down to the stored base", bellhop.ConsumerUpdate{BackoffCap: d(2 * time.Second)}, ""},
		{"both lowered", bellhop.ConsumerUpdate{BackoffBase: d(500 * time.Millisecond), BackoffCap: d(time.Second)}, ""},
		{"base up to the stored cap", bellhop.ConsumerUpdate{BackoffBase: d(time.Second)}, ""},
	}
	for _, tc := range tests {
		before := e.tableState("triggers")
		err := e.client.UpdateConsumer(e.ctx, "shop", c.ID, tc.u)
		if tc.want == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		fxCheckTyped(t, err, bellhop.ErrInvalidOptions)
		if err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %q, want it to contain %q", tc.name, err, tc.want)
		}
		if after := e.tableState("triggers"); after != before {
			t.Errorf("%s: refused update changed the consumer: %s, was %s", tc.name, after, before)
		}
	}
	got, err := e.client.ConsumerOf(e.ctx, "shop", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if got.BackoffBase != time.Second || got.BackoffCap != time.Second {
		t.Errorf("after the updates: backoff base %s, cap %s; want 1s, 1s", got.BackoffBase, got.BackoffCap)
	}
}

// TestUpdateTimeoutBesidePause: an update of a timeout, which reads and
// locks the consumer's rows to check the pair it leaves, and a pause of
// the same consumer, queued behind one lock, both go through. The check
// locked the details row before the triggers row, the reverse of every
// other change's order, and one of the two failed with a deadlock.
func TestUpdateTimeoutBesidePause(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	waiting := func(n int64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for e.int64(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) < n {
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d sessions waiting for a lock after 30s", n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	blocker, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(e.ctx)
	if _, err := blocker.Exec(e.ctx, `SELECT 1 FROM queue_trigger_details WHERE trigger_id = $1 FOR UPDATE`, c.ID); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	vt := time.Minute
	go func() {
		errs <- e.client.UpdateConsumer(e.ctx, "shop", c.ID, bellhop.ConsumerUpdate{VisibilityTimeout: &vt})
	}()
	waiting(1)
	go func() { errs <- e.client.SetConsumerEnabled(e.ctx, "shop", c.ID, false) }()
	waiting(2)
	if err := blocker.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Errorf("concurrent consumer change: %v", err)
		}
	}
	got, err := e.client.ConsumerOf(e.ctx, "shop", "orders")
	if err != nil {
		t.Fatal(err)
	}
	if got.VisibilityTimeout != time.Minute || got.Enabled {
		t.Errorf("after both: visibility timeout %s, enabled %t; want 1m0s, false", got.VisibilityTimeout, got.Enabled)
	}
}

// TestRegisterRaceUnderRepeatableRead: racing registrations of one queue
// make one consumer, and the others get ErrConsumerExists, also on a
// database whose default isolation is REPEATABLE READ. The registration's
// snapshot was taken before its lock there, and eight racers made up to
// five consumers of one queue.
func TestRegisterRaceUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	e.exec(`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = ''repeatable read''', current_database()); END $$`)
	pool, err := pgxpool.New(e.ctx, e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var iso string
	if err := pool.QueryRow(e.ctx, `SHOW default_transaction_isolation`).Scan(&iso); err != nil || iso != "repeatable read" {
		t.Fatalf("default_transaction_isolation %q (%v), want repeatable read", iso, err)
	}
	c := bellhop.NewClient(pool)
	for round := range 5 {
		queue := fmt.Sprintf("q%d", round)
		errs := make(chan error, 8)
		for range 8 {
			go func() {
				_, err := c.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: queue})
				errs <- err
			}()
		}
		ok := 0
		for range 8 {
			switch err := <-errs; {
			case err == nil:
				ok++
			case !errors.Is(err, bellhop.ErrConsumerExists):
				t.Errorf("%s: %v, want nil or ErrConsumerExists", queue, err)
			}
		}
		if n := e.int64(`SELECT count(*) FROM queue_trigger_details WHERE queue_name = $1`, queue); ok != 1 || n != 1 {
			t.Errorf("%s: %d registrations succeeded, %d consumers; want 1 and 1", queue, ok, n)
		}
	}
}

// TestInvokeRacingRemoval: an InvokeAsync that meets a RemoveConsumer in
// progress waits for it, and reports the consumer unknown once the
// removal commits, or invokes it if the removal rolls back. It checked
// the consumer in its own snapshot, and the outbox's foreign key, which
// waited for the delete, then failed with a raw SQLSTATE 23503.
func TestInvokeRacingRemoval(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		t.Run(fmt.Sprintf("commit=%t", commit), func(t *testing.T) {
			e := fxNew(t)
			e.app("shop")
			c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			if _, err := tx.Exec(e.ctx, `DELETE FROM triggers WHERE id = $1`, c.ID); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				_, err := e.client.InvokeAsync(e.ctx, c.ID, []byte(`1`), bellhop.EnqueueOptions{})
				done <- err
			}()
			waitUntil(t, 30*time.Second, "the invoke to wait for the removal", func() bool {
				return e.int64(`SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO outbox%'`) > 0
			})
			if commit {
				err = tx.Commit(e.ctx)
			} else {
				err = tx.Rollback(e.ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			err = <-done
			outbox := e.int64(`SELECT count(*) FROM outbox`)
			if !commit {
				if err != nil || outbox != 1 {
					t.Fatalf("InvokeAsync after a rolled-back removal: %v, %d outbox rows; want nil, 1", err, outbox)
				}
				return
			}
			if !errors.Is(err, bellhop.ErrUnknownConsumer) {
				t.Fatalf("InvokeAsync racing a removal: %v, want ErrUnknownConsumer", err)
			}
			if !strings.Contains(err.Error(), c.ID.String()) {
				t.Errorf("error %q does not name the consumer", err)
			}
			if outbox != 0 {
				t.Errorf("%d outbox rows, want 0", outbox)
			}
		})
	}
}

// fxPool is a pool on e's database whose sessions start with params
// (deadlock_timeout, default_transaction_isolation...).
func (e *fxEnv) fxPool(params map[string]string) *pgxpool.Pool {
	e.t.Helper()
	cfg := e.pool.Config().Copy()
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(e.ctx, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(pool.Close)
	return pool
}

// blockedBy waits until a session of e's database waits for a lock held
// by one of pids, and returns which one holds it. The wait fails at once
// if the call that should wait has returned instead (on done).
func (e *fxEnv) blockedBy(what string, done <-chan error, pids ...uint32) uint32 {
	e.t.Helper()
	var holder uint32
	waitUntil(e.t, 30*time.Second, what, func() bool {
		select {
		case err := <-done:
			e.t.Fatalf("waiting for %s: the call returned instead: %v", what, err)
		default:
		}
		holder = uint32(e.int64(`SELECT coalesce(min(b), 0) FROM pg_stat_activity AS a, unnest(pg_blocking_pids(a.pid)) AS b
			WHERE a.datname = current_database() AND b = ANY($1::int[])`, pids))
		return holder != 0
	})
	return holder
}

// TestRemoveConsumerBesideOutcomes: a removal whose cascade meets a
// dispatcher's outcomes for the consumer's invoke deliveries, settled in
// another order than the cascade's, deadlocks (40P01); PostgreSQL ends the
// removal, which waited first. RemoveConsumer tries it again once the
// outcomes are written, and succeeds: it returned the bare server error.
// The batch [ack p2, nack q, nack p1] stops between its ack and its nack
// on a lock held on the queue message q; the removal then deletes p1, the
// row its scan reaches first, and waits for p2; q's lock goes, and the
// nack waits for p1.
func TestRemoveConsumerBesideOutcomes(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, c := e.appConsumer("shop", "orders")
	for i := range 2 {
		if _, err := e.client.InvokeAsync(e.ctx, c.ID, []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatalf("invoke %d: %v", i, err)
		}
	}
	if _, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	invokes, _, err := claim.Claim(e.ctx, e.pool, claim.Target{Source: claim.Invoke, AppID: shop.ID, TriggerID: c.ID}, 10)
	if err != nil || len(invokes) != 2 {
		t.Fatalf("claimed %d invoke deliveries, want 2: %v", len(invokes), err)
	}
	queued, _, err := claim.Claim(e.ctx, e.pool, claim.Target{Source: claim.Queue, AppID: shop.ID, Queue: "orders", TriggerID: c.ID}, 10)
	if err != nil || len(queued) != 1 {
		t.Fatalf("claimed %d queue messages, want 1: %v", len(queued), err)
	}
	// p1: the row that the cascade (outbox's foreign key, by trigger_id
	// and app_id) reaches first.
	var first uuid.UUID
	if err := e.pool.QueryRow(e.ctx, `SELECT id FROM outbox WHERE trigger_id = $1 AND app_id = $2 LIMIT 1`,
		c.ID, shop.ID).Scan(&first); err != nil {
		t.Fatal(err)
	}
	p1, p2, q := &invokes[0], &invokes[1], &queued[0]
	if p2.ID == first {
		p1, p2 = p2, p1
	}

	// The batch's and the removal's sessions: the removal's deadlock check
	// runs first, 2s after it begins to wait, by when the batch waits too.
	batchPool := e.fxPool(map[string]string{"deadlock_timeout": "60s"})
	removePool := e.fxPool(map[string]string{"deadlock_timeout": "2s"})
	remover := bellhop.NewClient(removePool)
	deadlocks := func() int64 {
		return e.int64(`SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`)
	}
	before := deadlocks()

	locker, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback(e.ctx)
	var lockerPID uint32
	if err := locker.QueryRow(e.ctx, `SELECT pg_backend_pid() FROM queue_messages WHERE id = $1 FOR UPDATE`, q.ID).Scan(&lockerPID); err != nil {
		t.Fatal(err)
	}
	type written struct {
		applied claim.Applied
		err     error
	}
	batch := make(chan written, 1)
	go func() {
		applied, err := claim.Write(e.ctx, batchPool, []claim.Outcome{
			{Message: p2, Verdict: claim.Ack},
			{Message: q, Verdict: claim.Nack},
			{Message: p1, Verdict: claim.Nack},
		})
		batch <- written{applied, err}
	}()
	var batchPID uint32
	waitUntil(t, 30*time.Second, "the batch to wait for the queue message's lock", func() bool {
		batchPID = uint32(e.int64(`SELECT coalesce(min(pid), 0) FROM pg_stat_activity
			WHERE datname = current_database() AND $1 = ANY(pg_blocking_pids(pid))`, lockerPID))
		return batchPID != 0
	})
	removed := make(chan error, 1)
	go func() { removed <- remover.RemoveConsumer(e.ctx, "shop", c.ID) }()
	e.blockedBy("the removal to wait for the batch's ack", removed, batchPID)
	if err := locker.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}

	if err := <-removed; err != nil {
		t.Fatalf("RemoveConsumer beside a batch of outcomes: %v", err)
	}
	w := <-batch
	if w.err != nil {
		t.Fatalf("the batch of outcomes: %v", w.err)
	}
	for _, m := range []*claim.Message{p2, q, p1} {
		if !w.applied.Has(m) {
			t.Errorf("the outcome for %s was not applied", m.ID)
		}
	}
	if n := e.int64(`SELECT count(*) FROM triggers WHERE id = $1`, c.ID) + e.int64(`SELECT count(*) FROM outbox`); n != 0 {
		t.Errorf("%d rows of the consumer and its invoke deliveries left, want 0", n)
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE claim_token IS NULL`); n != 1 {
		t.Errorf("%d unclaimed queue messages, want the nacked one", n)
	}
	// The removal did meet the deadlock (its first try was ended), or this
	// test shows nothing: the batch's locks did not meet the cascade's.
	waitUntil(t, 30*time.Second, "the deadlock to be counted", func() bool { return deadlocks() > before })
}

// TestRemoveConsumerConflictSaysRetry: a removal that PostgreSQL ends for a
// concurrent change of the consumer's invoke deliveries on every try, here
// a serialization failure (40001) in a session that defaults to repeatable
// read, is tried RemoveTries times, then fails saying that nothing changed
// and to retry, the server's error wrapped; the consumer and its
// deliveries stay.
func TestRemoveConsumerConflictSaysRetry(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, c := e.appConsumer("shop", "orders")
	// One delivery, changed by a transaction of its own, per try.
	holders := map[uint32]pgx.Tx{}
	for i := range bellhop.RemoveTries {
		id, err := e.client.InvokeAsync(e.ctx, c.ID, []byte(`1`), bellhop.EnqueueOptions{})
		if err != nil {
			t.Fatalf("invoke %d: %v", i, err)
		}
		tx, err := e.pool.Begin(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(e.ctx)
		var pid uint32
		if err := tx.QueryRow(e.ctx, `UPDATE outbox SET attempt = attempt WHERE id = $1 RETURNING pg_backend_pid()`, id).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		holders[pid] = tx
	}
	remover := bellhop.NewClient(e.fxPool(map[string]string{"default_transaction_isolation": "repeatable read"}))
	removed := make(chan error, 1)
	go func() { removed <- remover.RemoveConsumer(e.ctx, "shop", c.ID) }()
	for try := 1; try <= bellhop.RemoveTries; try++ {
		pids := make([]uint32, 0, len(holders))
		for pid := range holders {
			pids = append(pids, pid)
		}
		holder := e.blockedBy(fmt.Sprintf("try %d of the removal to wait for a changed delivery", try), removed, pids...)
		if err := holders[holder].Commit(e.ctx); err != nil {
			t.Fatal(err)
		}
		delete(holders, holder)
	}
	err := <-removed
	if code := pgCodeOf(err); code != "40001" {
		t.Fatalf("RemoveConsumer: %v; want a serialization failure (40001)", err)
	}
	if !strings.Contains(err.Error(), "nothing changed; retry") || !strings.Contains(err.Error(), c.ID.String()) {
		t.Errorf("%q does not name the consumer and say that nothing changed and to retry", err)
	}
	if n := e.int64(`SELECT count(*) FROM triggers WHERE id = $1`, c.ID); n != 1 {
		t.Error("the consumer is gone, want it left")
	}
	if n := e.int64(`SELECT count(*) FROM outbox WHERE app_id = $1`, shop.ID); n != bellhop.RemoveTries {
		t.Errorf("%d invoke deliveries, want all %d left", n, bellhop.RemoveTries)
	}
}

// TestOperatorWithoutDefaultPrincipal: an operator's calls on an app as a
// whole work on an app that has no principal named "default" (made by
// SQL, or its default renamed), and a Client made with As of another
// app's principal is still refused. Found by review: they looked up the
// default principal too, and every one failed with ErrUnknownPrincipal.
func TestOperatorWithoutDefaultPrincipal(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	worker, err := e.client.CreatePrincipal(e.ctx, "shop", "worker")
	if err != nil {
		t.Fatal(err)
	}
	con, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", Principal: "worker"})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`UPDATE principals SET name = 'renamed' WHERE name = 'default' AND app_id = (SELECT id FROM apps WHERE name = 'shop')`)
	off := false
	c := e.client
	calls := []struct {
		name string
		do   func() error
	}{
		{"Consumers", func() error { _, err := c.Consumers(e.ctx, "shop"); return err }},
		{"ConsumerOf", func() error { _, err := c.ConsumerOf(e.ctx, "shop", "orders"); return err }},
		{"UpdateConsumer", func() error { return c.UpdateConsumer(e.ctx, "shop", con.ID, bellhop.ConsumerUpdate{Enabled: &off}) }},
		{"SetConsumerEnabled", func() error { return c.SetConsumerEnabled(e.ctx, "shop", con.ID, true) }},
		{"Queues", func() error { _, err := c.Queues(e.ctx, "shop"); return err }},
		{"DeadLetters", func() error { _, err := c.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop"}); return err }},
		{"Redrive", func() error { _, err := c.Redrive(e.ctx, "shop", "orders", uuid.Nil); return err }},
		{"PurgeDead", func() error { _, err := c.PurgeDead(e.ctx, "shop", "orders", uuid.Nil); return err }},
		{"EnqueueMany of none", func() error { _, err := c.EnqueueMany(e.ctx, "shop", nil); return err }},
		{"CreatePrincipal", func() error { _, err := c.CreatePrincipal(e.ctx, "shop", "another"); return err }},
		{"RemoveConsumer", func() error { return c.RemoveConsumer(e.ctx, "shop", con.ID) }},
	}
	for _, call := range calls {
		if err := call.do(); err != nil {
			t.Errorf("%s on an app without a default principal: %v", call.name, err)
		}
	}
	// Still unknown: an app that does not exist.
	if _, err := c.Consumers(e.ctx, "nowhere"); !errors.Is(err, bellhop.ErrUnknownApp) {
		t.Errorf("Consumers of an unknown app: %v, want ErrUnknownApp", err)
	}
	// Still refused: another app's principal acting on this one.
	e.app("other")
	stranger, err := e.client.CreatePrincipal(e.ctx, "other", "stranger")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.As(stranger).Consumers(e.ctx, "shop"); !errors.Is(err, bellhop.ErrForbidden) {
		t.Errorf("another app's principal listing shop's consumers: %v, want ErrForbidden", err)
	}
	if _, err := c.As(worker).Consumers(e.ctx, "shop"); err != nil {
		t.Errorf("shop's own principal listing its consumers: %v", err)
	}
}
