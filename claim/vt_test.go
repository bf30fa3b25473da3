package claim_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/reclaim"
)

// TestChangedTimeoutKeepsLeases: a lease is measured with the consumer's
// visibility timeout as its claim read it, and neither lowering the
// timeout nor removing or replacing the consumer lets the reclaimer cut
// short the leases taken under the old one (migration 0047). A renewal
// reads the timeout of the moment; once the old one has passed, the
// reclaimer uses the new one.
func TestChangedTimeoutKeepsLeases(t *testing.T) {
	const defaultVT = 5 * time.Second // the reclaim's, for a queue without a consumer
	changes := []struct {
		name    string
		change  func(t *testing.T, c *bellhop.Client, cons bellhop.Consumer)
		renewVT time.Duration // what a renewal reads afterwards
	}{
		{"lowered", func(t *testing.T, c *bellhop.Client, cons bellhop.Consumer) {
			vt := 2 * time.Second
			if err := c.UpdateConsumer(context.Background(), "app", cons.ID, bellhop.ConsumerUpdate{VisibilityTimeout: &vt}); err != nil {
				t.Fatal(err)
			}
		}, 2 * time.Second},
		{"removed", func(t *testing.T, c *bellhop.Client, cons bellhop.Consumer) {
			if err := c.RemoveConsumer(context.Background(), "app", cons.ID); err != nil {
				t.Fatal(err)
			}
		}, 0},
		{"replaced", func(t *testing.T, c *bellhop.Client, cons bellhop.Consumer) {
			if err := c.RemoveConsumer(context.Background(), "app", cons.ID); err != nil {
				t.Fatal(err)
			}
			if _, err := c.RegisterConsumer(context.Background(), bellhop.ConsumerSpec{App: "app", Queue: "q", VisibilityTimeout: 3 * time.Second}); err != nil {
				t.Fatal(err)
			}
		}, 3 * time.Second},
	}
	for _, src := range []claim.Source{claim.Queue, claim.Invoke} {
		for _, ch := range changes {
			if src == claim.Invoke && ch.name != "lowered" {
				continue // a removed consumer's invoke deliveries go with it
			}
			t.Run(src.String()+"/"+ch.name, func(t *testing.T) {
				ctx := context.Background()
				pool, c, appID := setup(t)
				cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", VisibilityTimeout: 20 * time.Second})
				if err != nil {
					t.Fatal(err)
				}
				target := claim.Target{Source: src, AppID: appID, Queue: "q", TriggerID: cons.ID}
				table := "queue_messages"
				var id uuid.UUID
				if src == claim.Invoke {
					table = "outbox"
					id, err = c.InvokeAsync(ctx, cons.ID, []byte(`1`), bellhop.EnqueueOptions{})
				} else {
					id, err = c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{})
				}
				if err != nil {
					t.Fatal(err)
				}
				m := claimOne(t, pool, target, id)
				if m.VisibilityTimeout != 20*time.Second {
					t.Fatalf("claim read a visibility timeout of %s, want 20s", m.VisibilityTimeout)
				}

				ch.change(t, c, cons)
				floor, until := vtFloor(t, pool, appID, "q")
				if floor != 20 || until < 20*time.Second || until > 26*time.Second {
					t.Fatalf("floor %ds, for %s from now; want 20s, for 25s", floor, until.Round(time.Second))
				}

				// Ten seconds into the lease: past the new timeout (and the
				// default), within the old one.
				backdate := `UPDATE ` + table + ` SET claimed_at = now() - interval '10 seconds' WHERE id = $1`
				if _, err := pool.Exec(ctx, backdate, id); err != nil {
					t.Fatal(err)
				}
				var released int64
				r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: defaultVT, OnPass: func(res reclaim.Result) { released += res.Released }})
				if _, err := r.Pass(ctx); err != nil {
					t.Fatal(err)
				}
				if released != 0 {
					t.Fatalf("the reclaim released %d lease(s) taken under the old 20s timeout after 10s", released)
				}

				ok, got, err := claim.Extend(ctx, pool, m.ID, m.Token)
				if err != nil || !ok {
					t.Fatalf("extend: ok %v, err %v", ok, err)
				}
				if got != ch.renewVT {
					t.Fatalf("the renewal read a visibility timeout of %s, want %s", got, ch.renewVT)
				}
				var age float64
				if err := pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - claimed_at)::float8 FROM `+table+` WHERE id = $1`, id).Scan(&age); err != nil {
					t.Fatal(err)
				}
				if renewed := age < 5; renewed != (ch.renewVT > 0) {
					t.Fatalf("lease %.1fs old after the renewal; renewed %v, want %v", age, renewed, ch.renewVT > 0)
				}

				// The floor over: the new timeout applies to every lease.
				if _, err := pool.Exec(ctx, `UPDATE bellhop_vt_floors SET until = now() - interval '1 second'`); err != nil {
					t.Fatal(err)
				}
				if _, err := pool.Exec(ctx, backdate, id); err != nil {
					t.Fatal(err)
				}
				if _, err := r.Pass(ctx); err != nil {
					t.Fatal(err)
				}
				if released != 1 {
					t.Fatalf("once the floor was over, the reclaim released %d lease(s) 10s old, want 1", released)
				}
			})
		}
	}
}

// vtFloor returns the live floor of app's queue and how long it has left
// (zero, zero: none), once a reclaim pass has seen it: a floor starts then
// (migration 0054), which bellhop_start_seen_vt_floors stands in for.
func vtFloor(t *testing.T, pool *pgxpool.Pool, appID uuid.UUID, queue string) (int, time.Duration) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `SELECT bellhop_start_seen_vt_floors()`); err != nil {
		t.Fatal(err)
	}
	var secs int
	var left float64
	err := pool.QueryRow(context.Background(), `SELECT coalesce(max(vt_secs), 0), coalesce(max(extract(epoch FROM until - now())), 0)::float8
		FROM bellhop_vt_floors WHERE app_id = $1 AND queue_name = $2 AND until > now()`, appID, queue).Scan(&secs, &left)
	if err != nil {
		t.Fatal(err)
	}
	return secs, time.Duration(left * float64(time.Second))
}

// TestTimeoutFloor: the floor keeps the longest timeout any live lease can
// have been taken under, for as long as such a lease can last; raising the
// timeout leaves it alone.
func TestTimeoutFloor(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", VisibilityTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		set   int // the new timeout, seconds
		floor int // the floor after it (0: none)
		left  int // the floor's time left, seconds, ±2
	}{
		{set: 30},                            // raised: no floor
		{set: 10, floor: 30, left: 35},       // lowered: the old timeout, for as long plus 5s
		{set: 40, floor: 30, left: 35},       // raised: the floor stays
		{set: 5, floor: 40, left: 45},        // lowered again: the longer of the two
		{set: 1, floor: 40, left: 45},        // lowered from 5: the live floor is longer
		{set: 3600, floor: 40, left: 45},     // raised above the floor: it stays, and no longer counts
		{set: 2, floor: 3600, left: 3605},    // lowered from an hour
		{set: 2, floor: 3600, left: 3605},    // unchanged
		{set: 4000, floor: 3600, left: 3605}, // raised
	}
	for i, s := range steps {
		vt := time.Duration(s.set) * time.Second
		if err := c.UpdateConsumer(ctx, "app", cons.ID, bellhop.ConsumerUpdate{VisibilityTimeout: &vt}); err != nil {
			t.Fatal(err)
		}
		floor, left := vtFloor(t, pool, appID, "q")
		var reclaimVT int
		if err := pool.QueryRow(ctx, `SELECT bellhop_reclaim_vt($1, 'q', $2)`, appID, s.set).Scan(&reclaimVT); err != nil {
			t.Fatal(err)
		}
		switch {
		case floor != s.floor:
			t.Fatalf("step %d (set %ds): floor %ds, want %ds", i, s.set, floor, s.floor)
		case s.floor != 0 && (left < time.Duration(s.left-2)*time.Second || left > time.Duration(s.left+2)*time.Second):
			t.Fatalf("step %d (set %ds): floor ends in %s, want about %ds", i, s.set, left.Round(100*time.Millisecond), s.left)
		case reclaimVT != max(s.set, s.floor):
			t.Fatalf("step %d (set %ds): the reclaim measures leases with %ds, want %ds", i, s.set, reclaimVT, max(s.set, s.floor))
		}
	}
}

// TestClaimWithoutConsumer: a claim for a consumer that no longer serves
// the queue reads no visibility timeout, which is how the dispatcher knows
// to give back what it claimed (lane.go; not exercised here): nothing
// would measure the lease.
func TestClaimWithoutConsumer(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q"})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	target := claim.Target{Source: claim.Queue, AppID: appID, Queue: "q", TriggerID: cons.ID}
	msgs, _, err := claim.Claim(ctx, pool, target, 1)
	if err != nil || len(msgs) != 1 || msgs[0].VisibilityTimeout != bellhop.DefaultVisibilityTimeout {
		t.Fatalf("claim with the consumer: %d messages, timeout %v, err %v", len(msgs), msgs, err)
	}
	if err := c.RemoveConsumer(ctx, "app", cons.ID); err != nil {
		t.Fatal(err)
	}
	msgs, _, err = claim.Claim(ctx, pool, target, 1)
	if err != nil || len(msgs) != 1 || msgs[0].VisibilityTimeout != 0 {
		t.Fatalf("claim after the consumer was removed: %d messages, %+v, err %v; want one with no timeout", len(msgs), msgs, err)
	}
}

// TestFloorStartsWhenSeen: a floor lasts the old timeout from when a
// reclaim pass first sees it, which can only be once the change's commit
// is visible: not from the change's statement, however long its
// transaction stays open, nor from its commit record, which may become
// visible much later (a synchronous standby that stalls). Until then it
// is pending and counts in full. A pass never waits for a change that is
// not yet committed.
func TestFloorStartsWhenSeen(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", VisibilityTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	pending := func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM bellhop_vt_floors WHERE app_id = $1 AND queue_name = 'q' AND until = 'infinity'`, appID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	lower := func(tx pgx.Tx, secs int) {
		if _, err := tx.Exec(ctx, `UPDATE queue_trigger_details SET visibility_timeout_secs = $2 WHERE trigger_id = $1`, cons.ID, secs); err != nil {
			t.Fatal(err)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	lower(tx, 10)
	if _, err := tx.Exec(ctx, `SELECT pg_sleep(1)`); err != nil { // the transaction held open
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_sleep(1)`); err != nil { // the commit seen late
		t.Fatal(err)
	}
	if !pending() {
		t.Fatal("the floor started before any reclaim pass saw it")
	}
	var reclaimVT int
	if err := pool.QueryRow(ctx, `SELECT bellhop_reclaim_vt($1, 'q', 10)`, appID).Scan(&reclaimVT); err != nil || reclaimVT != 20 {
		t.Fatalf("a pending floor measures leases with %ds (err %v), want the old 20s", reclaimVT, err)
	}
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	floor, left := vtFloor(t, pool, appID, "q")
	if floor != 20 || left < 24*time.Second || left > 25*time.Second+500*time.Millisecond {
		t.Fatalf("floor %ds for %s from the pass that saw it; want 20s for 25s", floor, left.Round(100*time.Millisecond))
	}

	// A change not yet committed holds the floor's row: the pass goes on
	// without it, and a later one starts it.
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	lower(tx, 5)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := r.Pass(pctx); err != nil {
		t.Fatalf("a reclaim pass beside an uncommitted change: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if !pending() {
		t.Fatal("the raised floor is not pending after its change committed")
	}
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if pending() {
		t.Fatal("a reclaim pass left a floor it could see pending")
	}
}

// TestInvokeFloorAfterRename: a consumer whose queue is renamed while it
// lowers its timeout (by SQL: 0047's trigger covers renames) keeps the old
// timeout for its leased invoke deliveries, which are measured under the
// consumer's current queue name. With the floor kept under the old name
// only, the reclaim cut a 20s lease short after 10s.
func TestInvokeFloorAfterRename(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "a", VisibilityTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	id, err := c.InvokeAsync(ctx, cons.ID, []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := claimOne(t, pool, claim.Target{Source: claim.Invoke, AppID: appID, TriggerID: cons.ID}, id)
	if m.VisibilityTimeout != 20*time.Second {
		t.Fatalf("the claim read a visibility timeout of %s, want 20s", m.VisibilityTimeout)
	}
	if _, err := pool.Exec(ctx, `UPDATE queue_trigger_details SET queue_name = 'b', visibility_timeout_secs = 2 WHERE trigger_id = $1`, cons.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox SET claimed_at = now() - interval '10 seconds' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	var released int64
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second, OnPass: func(res reclaim.Result) { released += res.Released }})
	for range 2 { // the first pass starts the floors, the second measures with them started
		if _, err := r.Pass(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if released != 0 {
		t.Fatal("the reclaim released an invoke delivery 10s into its 20s lease, after its consumer's queue was renamed")
	}
	for _, q := range []string{"a", "b"} {
		if floor, _ := vtFloor(t, pool, appID, q); floor != 20 {
			t.Errorf("floor of queue %q: %ds, want 20s", q, floor)
		}
	}
}

// TestLeaseEnd: bellhop_lease_end is the reclaim's rule (bellhop_reclaim_vt
// applied while the floor lasts) as a time: a lease ends once its own
// timeout has run and either the floor's has too or the floor is over.
func TestLeaseEnd(t *testing.T) {
	ctx := context.Background()
	pool, _, appID := setup(t)
	var t0 time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&t0); err != nil {
		t.Fatal(err)
	}
	const none = -1
	tests := []struct {
		name      string
		vt        int     // the consumer's timeout, seconds
		floorVT   int     // the queue's floor (none: no floor)
		floorEnds float64 // seconds from t0; 0: pending ('infinity')
		want      float64 // the lease's end, seconds after its claim at t0
	}{
		{"no floor", 1, none, 0, 1},
		{"floor lasts", 1, 20, 60, 20},
		{"floor ends first", 1, 20, 10, 10},
		{"floor ends before the timeout", 5, 20, 3, 5},
		{"floor pending", 1, 20, 0, 20},
		{"floor over", 1, 20, -1, 1},
		{"floor shorter than the timeout", 5, 1, 60, 5},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			queue := fmt.Sprintf("q%d", i)
			if tc.floorVT != none {
				until := "greatest($4::timestamptz, 'infinity')"
				if tc.floorEnds != 0 {
					until = fmt.Sprintf("$4::timestamptz + %g * interval '1 second'", tc.floorEnds)
				}
				_, err := pool.Exec(ctx, `INSERT INTO bellhop_vt_floors (app_id, queue_name, vt_secs, until)
					VALUES ($1, $2, $3, `+until+`)`, appID, queue, tc.floorVT, t0)
				if err != nil {
					t.Fatal(err)
				}
			}
			var got float64
			err := pool.QueryRow(ctx, `SELECT extract(epoch FROM bellhop_lease_end($1, $2, $3, $4) - $4)::float8`,
				appID, queue, tc.vt, t0).Scan(&got)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("lease ends %gs after its claim, want %gs", got, tc.want)
			}
		})
	}
}

// TestReclaimTimerAtFloorEnd: a lease taken under a lowered timeout (1s)
// while the old one's floor (20s) has 3s left is reclaimable when the
// floor ends, and the next lease expiry that arms every reclaimer's timer
// says so. It said the claim plus 20s: the timer slept past a dead
// consumer's lease by up to the old timeout.
func TestReclaimTimerAtFloorEnd(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", VisibilityTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	id, err := c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vt := time.Second
	if err := c.UpdateConsumer(ctx, "app", cons.ID, bellhop.ConsumerUpdate{VisibilityTimeout: &vt}); err != nil {
		t.Fatal(err)
	}
	if floor, _ := vtFloor(t, pool, appID, "q"); floor != 20 {
		t.Fatalf("floor %ds, want 20s", floor)
	}
	// As if the change were 23s old: the floor has 3s left.
	if _, err := pool.Exec(ctx, `UPDATE bellhop_vt_floors SET until = clock_timestamp() + interval '3 seconds'`); err != nil {
		t.Fatal(err)
	}
	floorEnd := time.Now().Add(3 * time.Second)
	m := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q", TriggerID: cons.ID}, id)
	if m.VisibilityTimeout != vt {
		t.Fatalf("claimed with a %s timeout, want %s", m.VisibilityTimeout, vt)
	}
	// The claim's dispatcher dies here.
	var released int64
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second, OnPass: func(res reclaim.Result) { released += res.Released }})
	next, err := r.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := next.Sub(floorEnd); d < -time.Second || d > time.Second {
		t.Fatalf("next lease expiry %s after the floor's end, want within 1s of it (the lease ends with the floor)", d.Round(time.Millisecond))
	}
	// And the reclaim takes the lease then.
	deadline := floorEnd.Add(5 * time.Second)
	for released == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("lease not reclaimed 5s after the floor ended")
		}
		time.Sleep(100 * time.Millisecond)
		if _, err := r.Pass(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if early := time.Until(floorEnd); early > time.Second {
		t.Fatalf("lease reclaimed %s before the floor ended", early.Round(time.Millisecond))
	}
}
