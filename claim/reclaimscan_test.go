package claim_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestReclaimReadsOnlyOldLeases: a reclaim pass reads the leases older
// than the shortest timeout, not every lease in flight nor the ready
// messages beside them, and stops once its batch is full; so does the
// next lease expiry (the reclaimer's round trip; the fallback poll reads
// the same expiry) when every consumer has the default timeout; both with
// custom and generic plans. Fresh leases carry claim times 20s apart at
// most, in no order in the table, as leases taken by many lanes do. Both
// statements used to read all 20,000 fresh leases of each table, and the
// pass hashed the whole table to find again the rows it had locked; a
// reclaim that took its bound only from a value computed as it ran
// scanned the table in a generic plan.
func TestReclaimReadsOnlyOldLeases(t *testing.T) {
	const fresh = 20000
	tests := []struct {
		name string
		// Consumers' timeouts (the long queue's is 10 minutes) and the
		// default; the expired leases are the first queue's: expired of
		// them, claimed expiredAgo.
		queues     []string
		vts        []time.Duration
		defaultVT  int
		expired    int
		expiredAgo string
		batch      int
		// Whether the next lease expiry reads only old leases too: with
		// two timeouts, it reads those claimed within their difference
		// after the oldest live lease, here all of them.
		expiryReadsOld bool
	}{
		{"one timeout", []string{"long"}, []time.Duration{10 * time.Minute}, 600, 3, "11 minutes", 10000, true},
		{"two timeouts", []string{"short", "long"}, []time.Duration{time.Minute, 10 * time.Minute}, 300, 3, "2 minutes", 10000, false},
		// A pass that sorted the old leases, or read them all, would
		// read 5,000 rows: 3,000, then the 1,000 it takes twice.
		{"more expired than a batch", []string{"long"}, []time.Duration{10 * time.Minute}, 600, 3000, "11 minutes", 1000, true},
	}
	for _, tc := range tests {
		for _, ready := range []int{0, fresh} {
			t.Run(fmt.Sprintf("%s, %d ready", tc.name, ready), func(t *testing.T) {
				ctx := context.Background()
				pool, c, appID := setup(t)
				ids := map[string]string{}
				for i, q := range tc.queues {
					cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: q, VisibilityTimeout: tc.vts[i]})
					if err != nil {
						t.Fatal(err)
					}
					ids[q] = cons.ID.String()
				}
				expired := tc.queues[0]
				for _, q := range []string{
					// Fresh leases, ready messages, the expired leases
					// and two live ones, the oldest that are (they end in
					// 5 minutes), of the long queue, in random order.
					fmt.Sprintf(`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
						SELECT '%s', q, '{}', CASE WHEN at IS NOT NULL THEN gen_random_uuid() END, at,
						       CASE WHEN at IS NOT NULL THEN 1 ELSE 0 END
						FROM (SELECT 'long' AS q, CASE WHEN i <= %d THEN now() - random() * interval '20 seconds' END AS at
						      FROM generate_series(1, %d) i
						      UNION ALL
						      SELECT '%s', now() - interval '%s' - i * interval '1 ms' FROM generate_series(1, %d) i
						      UNION ALL
						      SELECT 'long', now() - interval '5 minutes' FROM generate_series(1, 2)) AS m
						ORDER BY random()`, appID, fresh, fresh+ready, expired, tc.expiredAgo, tc.expired),
					fmt.Sprintf(`INSERT INTO outbox (app_id, source_kind, trigger_id, payload, claim_token, claimed_at, attempt)
						SELECT '%s', 'invoke', CASE WHEN i = 0 THEN '%s'::uuid ELSE '%s'::uuid END, '{}', gen_random_uuid(),
						       CASE WHEN i = 0 THEN now() - interval '%s' ELSE now() - random() * interval '20 seconds' END, 1
						FROM generate_series(0, %d) i ORDER BY random()`, appID, ids[expired], ids["long"], tc.expiredAgo, fresh),
					"ANALYZE queue_messages",
					"ANALYZE outbox",
				} {
					if _, err := pool.Exec(ctx, q); err != nil {
						t.Fatal(err)
					}
				}
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Release()
				args := queries.Args{"default_vt_secs": tc.defaultVT, "batch": tc.batch}
				for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
					tx, err := conn.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					// Rows that parallel workers read would not count.
					if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode+"; SET LOCAL max_parallel_workers_per_gather = 0"); err != nil {
						t.Fatal(err)
					}
					// The old leases it takes, found again to release
					// them and to dead-letter those on their last
					// attempt, the two live old ones, a few index
					// entries not yet pruned.
					most := map[string]int64{
						"queue_messages": 3*int64(min(tc.expired, tc.batch)) + 50,
						"outbox":         50,
					}
					before := rowsRead(t, tx)
					var released, dead, woken, started int64
					var more bool
					if err := tx.QueryRow(ctx, queries.Reclaim, args).Scan(&released, &dead, &woken, &started, &more, nil); err != nil {
						t.Fatal(err)
					}
					wantReleased := int64(min(tc.expired, tc.batch)) + 1
					if released != wantReleased || dead != 0 || more != (tc.expired >= tc.batch) {
						t.Errorf("%s: released %d, dead-lettered %d, more %t; want %d, 0, %t",
							mode, released, dead, more, wantReleased, tc.expired >= tc.batch)
					}
					after := rowsRead(t, tx)
					for rel, n := range after {
						if n-before[rel] > most[rel] {
							t.Errorf("%s: the reclaim read %d rows of %s", mode, n-before[rel], rel)
						}
					}
					before = after
					var next *time.Time
					var now time.Time
					if err := tx.QueryRow(ctx, queries.NextLeaseExpiry, args).Scan(&next, &now); err != nil {
						t.Fatal(err)
					}
					// With expired leases left, the earliest end is past.
					if tc.expired < tc.batch && (next == nil || next.Sub(now) < 4*time.Minute || next.Sub(now) > 5*time.Minute) {
						t.Errorf("%s: next lease expiry %v at %v, want the oldest live leases' end, in 5 minutes", mode, next, now)
					}
					if tc.expired >= tc.batch && (next == nil || !next.Before(now)) {
						t.Errorf("%s: next lease expiry %v at %v, want an expired lease's end", mode, next, now)
					}
					after = rowsRead(t, tx)
					for rel, n := range after {
						if tc.expiryReadsOld && n-before[rel] > 50 {
							t.Errorf("%s: the next lease expiry read %d rows of %s", mode, n-before[rel], rel)
						}
					}
					if err := tx.Rollback(ctx); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
	}
}

// TestNextLeaseExpiryIsTheEarliestEnd: the next lease expiry, which reads
// only the leases that can end before the oldest one, is the earliest end
// of any lease in flight (bellhop_lease_end over every lease, as 0059's
// function worked it out), and a reclaim pass, which reads only leases
// older than the shortest timeout, takes exactly the leases that have
// ended. Queues with timeouts from 5s to 300s, one with two consumers,
// one with none; live, pending and ended floors; defaults below and above
// every consumer's timeout. Random leases, and three cases at the edges:
// a lease that ends first claimed just inside the window the expiry
// reads, leases of the consumer-less queue that only the default's 1s
// has ended, and the oldest lease on the queue with two consumers.
func TestNextLeaseExpiryIsTheEarliestEnd(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	var consumers []string
	for i, vt := range []int{5, 8, 30, 300, 7, 20} {
		cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: fmt.Sprintf("q%d", i), VisibilityTimeout: time.Duration(vt) * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		consumers = append(consumers, cons.ID.String())
	}
	// Two consumers for q4 (7s and 20s), which only a direct UPDATE makes.
	if _, err := pool.Exec(ctx, `UPDATE queue_trigger_details SET queue_name = 'q4' WHERE trigger_id = $1`, consumers[5]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO bellhop_vt_floors (app_id, queue_name, vt_secs, until) VALUES
		($1, 'q1', 100, now() + interval '50 seconds'),
		($1, 'q2', 200, 'infinity'),
		($1, 'q3', 10, now() + interval '60 seconds'),
		($1, 'none', 400, now() - interval '1 second'),
		($1, 'q4', 250, now() + interval '20 seconds')`, appID); err != nil {
		t.Fatal(err)
	}
	lease := func(queue, ago string) string {
		return fmt.Sprintf(`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
			VALUES ('%s', '%s', '{}', gen_random_uuid(), now() - interval '%s', 1)`, appID, queue, ago)
	}
	type testCase struct {
		name      string
		defaultVT int
		inserts   []string
		wantEnds  string // if set, the earliest end, before the reclaim
	}
	tests := []testCase{
		// q3's lease ends at -100s (its floor is shorter than its
		// timeout), q0's at -101s: claimed 1s before the window's end.
		{"a lease just inside the window", 30, []string{lease("q3", "400 seconds"), lease("q0", "106 seconds")}, "101 seconds"},
		{"the default below every timeout", 1, []string{lease("none", "0.5 seconds"), lease("none", "3 seconds"), lease("none", "10 seconds")}, "9 seconds"},
		// q4's floor (250s) makes its lease end at -200s.
		{"the oldest lease on a queue with two consumers", 30, []string{lease("q4", "450 seconds"), lease("q0", "1 second")}, "200 seconds"},
	}
	for seed := range 24 {
		tests = append(tests, testCase{
			name:      fmt.Sprintf("seed %d", seed),
			defaultVT: []int{1, 30, 600}[seed%3],
			inserts: []string{
				fmt.Sprintf(`SELECT setseed(%g)`, float64(seed)/24),
				fmt.Sprintf(`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
					SELECT '%s', (ARRAY['q0','q1','q2','q3','q4','none'])[1 + floor(random() * 6)::int], '{}',
					       gen_random_uuid(), now() - random() * interval '500 seconds', 1
					FROM generate_series(1, 1 + floor(random() * 60)::int)`, appID),
				fmt.Sprintf(`INSERT INTO outbox (app_id, source_kind, trigger_id, payload, claim_token, claimed_at, attempt)
					SELECT '%s', 'invoke', ('{%s}'::uuid[])[1 + floor(random() * %d)::int], '{}',
					       gen_random_uuid(), now() - random() * interval '500 seconds', 1
					FROM generate_series(1, floor(random() * 20)::int)`, appID, strings.Join(consumers, ","), len(consumers)),
			},
		})
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s, default %ds", tc.name, tc.defaultVT), func(t *testing.T) {
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			for _, q := range tc.inserts {
				if _, err := tx.Exec(ctx, q); err != nil {
					t.Fatal(err)
				}
			}
			// ends is the earliest end of any lease in flight, and
			// stale the number of leases that have ended, worked out
			// lease by lease.
			ends := func() (ends *time.Time, stale int64) {
				t.Helper()
				err := tx.QueryRow(ctx, `SELECT least(
						(SELECT min(bellhop_lease_end(m.app_id, m.queue_name, coalesce(c.visibility_timeout_secs, $1), m.claimed_at))
						 FROM queue_messages m LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
						 WHERE m.claim_token IS NOT NULL),
						(SELECT min(bellhop_lease_end(m.app_id, c.queue_name, coalesce(c.visibility_timeout_secs, $1), m.claimed_at))
						 FROM outbox m LEFT JOIN queue_consumers c ON c.id = m.trigger_id
						 WHERE m.claim_token IS NOT NULL AND m.source_kind = 'invoke')),
					(SELECT count(DISTINCT m.id) FROM queue_messages m LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
					 WHERE m.claim_token IS NOT NULL AND m.claimed_at < now() - make_interval(secs =>
					       bellhop_reclaim_vt(m.app_id, m.queue_name, coalesce(c.visibility_timeout_secs, $1))))
					+ (SELECT count(DISTINCT m.id) FROM outbox m LEFT JOIN queue_consumers c ON c.id = m.trigger_id
					 WHERE m.claim_token IS NOT NULL AND m.source_kind = 'invoke' AND m.claimed_at < now() - make_interval(secs =>
					       bellhop_reclaim_vt(m.app_id, c.queue_name, coalesce(c.visibility_timeout_secs, $1))))`,
					tc.defaultVT).Scan(&ends, &stale)
				if err != nil {
					t.Fatal(err)
				}
				return ends, stale
			}
			checkExpiry := func(when string) (*time.Time, int64) {
				t.Helper()
				want, stale := ends()
				var got *time.Time
				if err := tx.QueryRow(ctx, `SELECT bellhop_next_lease_expiry($1)`, tc.defaultVT).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if (got == nil) != (want == nil) || (got != nil && !got.Equal(*want)) {
					t.Errorf("%s: next lease expiry %v, want %v", when, got, want)
				}
				return want, stale
			}
			want, stale := checkExpiry("before the reclaim")
			if tc.wantEnds != "" {
				var edge time.Time
				if err := tx.QueryRow(ctx, `SELECT now() - $1::interval`, tc.wantEnds).Scan(&edge); err != nil {
					t.Fatal(err)
				}
				if want == nil || !want.Equal(edge) {
					t.Fatalf("the case's earliest end is %v, want now() - %s, %v", want, tc.wantEnds, edge)
				}
			}
			var released, dead, woken, started int64
			var more bool
			if err := tx.QueryRow(ctx, queries.Reclaim, queries.Args{"default_vt_secs": tc.defaultVT, "batch": 10000}).
				Scan(&released, &dead, &woken, &started, &more, nil); err != nil {
				t.Fatal(err)
			}
			if released+dead != stale {
				t.Errorf("reclaimed %d leases, want the %d that have ended", released+dead, stale)
			}
			if _, left := checkExpiry("after the reclaim"); left != 0 {
				t.Errorf("%d ended leases left after the reclaim", left)
			}
		})
	}
}

// rowsRead returns how many rows of queue_messages and of outbox this
// session has read, by sequential and by index scans, in statistics not
// yet flushed (a difference of two calls in one transaction is exact).
func rowsRead(t *testing.T, tx pgx.Tx) map[string]int64 {
	t.Helper()
	rows, err := tx.Query(context.Background(), `SELECT relname, seq_tup_read + coalesce(idx_tup_fetch, 0)
		FROM pg_stat_xact_user_tables WHERE relname IN ('queue_messages', 'outbox')`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	var rel string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&rel, &n}, func() error { out[rel] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(out) != 2 {
		t.Fatalf("statistics for %v, want queue_messages and outbox", out)
	}
	return out
}
