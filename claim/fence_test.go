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
	queries "github.com/bellhopq/bellhop/sql"
)

// TestFencing: an outcome written with a stale claim token (the lease
// expired and was reclaimed, or was reclaimed and claimed again) changes
// nothing and is absent from Write's result; the same outcome with the
// current token applies. Every verdict, both tables.
func TestFencing(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	reclaimer := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	verdicts := []claim.Verdict{claim.Ack, claim.Nack, claim.DeadLetter, claim.Release}
	n := 0
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		for _, claimedAgain := range []bool{false, true} {
			for _, v := range verdicts {
				staleness := "reclaimed"
				if claimedAgain {
					staleness = "reclaimed and claimed again"
				}
				t.Run(fmt.Sprintf("%s/%s/%s", source, staleness, v), func(t *testing.T) {
					n++
					queue := fmt.Sprintf("fence-%d", n)
					id, table, target := newMessage(t, client, appID, source, queue)
					old := claimOne(t, pool, target, id)

					// Expire the lease and let the reclaimer take it back.
					if _, err := pool.Exec(ctx, `UPDATE `+table+` SET claimed_at = now() - interval '1 hour' WHERE id = $1`, id); err != nil {
						t.Fatal(err)
					}
					if _, err := reclaimer.Pass(ctx); err != nil {
						t.Fatal(err)
					}
					var current *claim.Message
					if claimedAgain {
						m := claimOne(t, pool, target, id)
						if m.Token == old.Token {
							t.Fatal("claimed again with the same token")
						}
						current = &m
					}
					before := snapshot(t, pool, table, id)
					if before == "" {
						t.Fatal("message gone after the reclaim")
					}

					out := claim.Outcome{Message: &old, Verdict: v, Delay: time.Hour, HoldLease: time.Minute, Error: "stale outcome", Queue: queue}
					applied, err := claim.Write(ctx, pool, []claim.Outcome{out})
					if err != nil {
						t.Fatal(err)
					}
					if applied.Has(&old) || len(applied) != 0 {
						t.Errorf("a %s with a stale token was reported applied", v)
					}
					if after := snapshot(t, pool, table, id); after != before {
						t.Errorf("a %s with a stale token changed the row:\nbefore %s\nafter  %s", v, before, after)
					}
					if deadLetterCount(t, pool, id) != 0 {
						t.Errorf("a %s with a stale token made a dead letter", v)
					}

					// Control: the same outcome with the current token applies.
					if current == nil {
						m := claimOne(t, pool, target, id)
						current = &m
					}
					held := snapshot(t, pool, table, id)
					out.Message = current
					applied, err = claim.Write(ctx, pool, []claim.Outcome{out})
					if err != nil {
						t.Fatal(err)
					}
					if !applied.Has(current) {
						t.Errorf("a %s with the current token was not applied", v)
					}
					after := snapshot(t, pool, table, id)
					switch v {
					case claim.Ack, claim.DeadLetter:
						if after != "" {
							t.Errorf("a %s with the current token left the row: %s", v, after)
						}
					case claim.Nack, claim.Release:
						if after == held || after == "" {
							t.Errorf("a %s with the current token did not release the row: %s", v, after)
						}
					}
					if want := map[bool]int{true: 1, false: 0}[v == claim.DeadLetter]; deadLetterCount(t, pool, id) != want {
						t.Errorf("%s with the current token: %d dead letters, want %d", v, deadLetterCount(t, pool, id), want)
					}
				})
			}
		}
	}
}

// newMessage enqueues one message (5 attempts) to queue, or invokes a
// consumer of queue with one (source Invoke), and returns its id, its
// table and what claims it.
func newMessage(t *testing.T, client *bellhop.Client, appID uuid.UUID, source claim.Source, queue string) (uuid.UUID, string, claim.Target) {
	t.Helper()
	ctx := context.Background()
	opts := bellhop.EnqueueOptions{MaxAttempts: 5}
	if source == claim.Invoke {
		c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: queue})
		if err != nil {
			t.Fatal(err)
		}
		id, err := client.InvokeAsync(ctx, c.ID, []byte(`{"n":1}`), opts)
		if err != nil {
			t.Fatal(err)
		}
		return id, "outbox", claim.Target{Source: claim.Invoke, AppID: appID, TriggerID: c.ID}
	}
	id, err := client.Enqueue(ctx, "app", queue, []byte(`{"n":1}`), opts)
	if err != nil {
		t.Fatal(err)
	}
	return id, "queue_messages", claim.Target{Source: claim.Queue, AppID: appID, Queue: queue}
}

// renewableMessage is newMessage with a consumer for its queue: without
// one, a queue message's lease is not renewed (an invoke delivery's
// consumer is made by newMessage).
func renewableMessage(t *testing.T, client *bellhop.Client, appID uuid.UUID, source claim.Source, queue string) (uuid.UUID, string, claim.Target) {
	t.Helper()
	if source == claim.Queue {
		if _, err := client.RegisterConsumer(context.Background(), bellhop.ConsumerSpec{App: "app", Queue: queue}); err != nil {
			t.Fatal(err)
		}
	}
	return newMessage(t, client, appID, source, queue)
}

// claimOne claims target and checks that it got exactly message id.
func claimOne(t *testing.T, pool *pgxpool.Pool, target claim.Target, id uuid.UUID) claim.Message {
	t.Helper()
	msgs, _, err := claim.Claim(context.Background(), pool, target, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 1 || msgs[0].ID != id {
		t.Fatalf("claimed %d messages, want exactly %s", len(msgs), id)
	}
	return msgs[0]
}

// claimedTwice claims message id, lets its lease expire and the reclaimer
// take it back, and claims it again: the stale lease and the current one.
func claimedTwice(t *testing.T, pool *pgxpool.Pool, reclaimer *reclaim.Reclaimer, table string, target claim.Target, id uuid.UUID) (old, cur claim.Message) {
	t.Helper()
	ctx := context.Background()
	old = claimOne(t, pool, target, id)
	if _, err := pool.Exec(ctx, `UPDATE `+table+` SET claimed_at = now() - interval '1 hour' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := reclaimer.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	return old, claimOne(t, pool, target, id)
}

// snapshot returns message id's whole row as JSON text, or "" if there is
// no such row.
func snapshot(t *testing.T, pool *pgxpool.Pool, table string, id uuid.UUID) string {
	t.Helper()
	var s string
	err := pool.QueryRow(context.Background(), `SELECT coalesce((SELECT to_jsonb(m)::text FROM `+table+` m WHERE id = $1), '')`, id).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func deadLetterCount(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM dead_letters WHERE id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestHoldLease: a nack's deliver_after is now() plus its delay, or the
// end of the lease it holds (claimed_at + HoldLease) if that is later. A
// release refunds the attempt and leaves the message ready (deliver_after
// as enqueued: NULL), or holds it to the end of its lease likewise. Both
// tables.
func TestHoldLease(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	for i, c := range []struct {
		name        string
		verdict     claim.Verdict
		delay, hold time.Duration
		// want is deliver_after less claimed_at, give or take the time
		// between the claim and the outcome; ready: deliver_after NULL.
		want  time.Duration
		ready bool
	}{
		{name: "nack, no hold", verdict: claim.Nack, delay: time.Minute, want: time.Minute},
		{name: "nack, hold ends later", verdict: claim.Nack, delay: time.Millisecond, hold: time.Hour, want: time.Hour},
		{name: "nack, delay ends later", verdict: claim.Nack, delay: 2 * time.Hour, hold: time.Hour, want: 2 * time.Hour},
		{name: "release, no hold", verdict: claim.Release, ready: true},
		{name: "release, hold", verdict: claim.Release, hold: time.Hour, want: time.Hour},
	} {
		for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
			t.Run(fmt.Sprintf("%s/%s", source, c.name), func(t *testing.T) {
				queue := fmt.Sprintf("hold-%d-%s", i, source)
				id, table, target := newMessage(t, client, appID, source, queue)
				m := claimOne(t, pool, target, id)
				var claimedAt time.Time
				if err := pool.QueryRow(ctx, `SELECT claimed_at FROM `+table+` WHERE id = $1`, id).Scan(&claimedAt); err != nil {
					t.Fatal(err)
				}
				applied, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &m, Verdict: c.verdict, Delay: c.delay, HoldLease: c.hold}})
				if err != nil || !applied.Has(&m) {
					t.Fatalf("%s: applied %v, %v", c.verdict, applied.Has(&m), err)
				}
				var due *time.Time
				var token *uuid.UUID
				var attempt int
				if err := pool.QueryRow(ctx, `SELECT deliver_after, claim_token, attempt FROM `+table+` WHERE id = $1`, id).Scan(&due, &token, &attempt); err != nil {
					t.Fatal(err)
				}
				if token != nil {
					t.Errorf("claim_token %s after the %s, want NULL", token, c.verdict)
				}
				// A nack keeps the attempt counted; a release refunds it.
				if wantAttempt := map[claim.Verdict]int{claim.Nack: 1, claim.Release: 0}[c.verdict]; attempt != wantAttempt {
					t.Errorf("attempt %d after the %s, want %d", attempt, c.verdict, wantAttempt)
				}
				switch {
				case c.ready:
					if due != nil {
						t.Errorf("deliver_after %s after the %s, want NULL (ready at once)", due, c.verdict)
					}
				case due == nil:
					t.Errorf("deliver_after NULL after the %s, want claimed_at + %s", c.verdict, c.want)
				default:
					// The outcome was written within a few seconds of the claim.
					if got := due.Sub(claimedAt); got < c.want || got > c.want+5*time.Second {
						t.Errorf("deliver_after is claimed_at + %s, want %s (+ up to 5s)", got, c.want)
					}
				}
			})
		}
	}
}

// TestExtendWaitingForTheRow: a renewal that waits for the message's row
// while another transaction holds it reports what that transaction left:
// if it took the lease back (a reclaim), the lease is lost, not "held with
// no consumer"; if it left the token alone, the lease is renewed. Both
// tables.
func TestExtendWaitingForTheRow(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	n := 0
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		for _, tc := range []struct {
			name   string
			change string // run on the row by the transaction the renewal waits for
			held   bool
		}{
			{"reclaimed", `SET claim_token = NULL, claimed_at = NULL`, false},
			{"left alone", `SET claimed_at = claimed_at`, true},
		} {
			t.Run(source.String()+"/"+tc.name, func(t *testing.T) {
				n++
				queue := fmt.Sprintf("extend-%d", n)
				if source == claim.Queue {
					if _, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: queue, VisibilityTimeout: 30 * time.Second}); err != nil {
						t.Fatal(err)
					}
				}
				id, table, target := newMessage(t, client, appID, source, queue)
				m := claimOne(t, pool, target, id)

				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				var pid int
				if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(ctx, `UPDATE `+table+` `+tc.change+` WHERE id = $1`, id); err != nil {
					t.Fatal(err)
				}
				type result struct {
					held bool
					vt   time.Duration
					err  error
				}
				done := make(chan result, 1)
				go func() {
					held, vt, err := claim.Extend(ctx, pool, m.ID, m.Token)
					done <- result{held, vt, err}
				}()
				// Commit only once the renewal waits for the row lock.
				deadline := time.Now().Add(10 * time.Second)
				for {
					var waiting bool
					if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
						WHERE $1 = ANY(pg_blocking_pids(pid)))`, pid).Scan(&waiting); err != nil {
						t.Fatal(err)
					}
					if waiting {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the renewal never waited for the row")
					}
					time.Sleep(5 * time.Millisecond)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil {
					t.Fatal(r.err)
				}
				if r.held != tc.held {
					t.Errorf("held %v, want %v (vt %v)", r.held, tc.held, r.vt)
				}
				if tc.held && r.vt != 30*time.Second {
					t.Errorf("renewed for %v, want the consumer's 30s", r.vt)
				}
				if !tc.held && r.vt != 0 {
					t.Errorf("lost lease renewed for %v", r.vt)
				}
			})
		}
	}
}

// TestStaleBesideCurrentInOneBatch: a batch that carries a stale outcome
// and the current one for the same message (a handler that outlived its
// lease, and the redelivery's handler, settling together) reports only
// the current one applied, for every verdict of the stale one. Keyed by
// message id alone, both were reported applied: a false "dead-lettered"
// log line and metric for an outcome that changed nothing.
func TestStaleBesideCurrentInOneBatch(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	reclaimer := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	for i, v := range []claim.Verdict{claim.Ack, claim.Nack, claim.DeadLetter, claim.Release} {
		for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
			t.Run(fmt.Sprintf("stale %s, %s", v, source), func(t *testing.T) {
				queue := fmt.Sprintf("stale-beside-%d-%s", i, source)
				id, table, target := newMessage(t, client, appID, source, queue)
				old, cur := claimedTwice(t, pool, reclaimer, table, target, id)
				applied, err := claim.Write(ctx, pool, []claim.Outcome{
					{Message: &cur, Verdict: claim.Ack},
					{Message: &old, Verdict: v, Delay: time.Minute, Error: "stale", Queue: queue},
				})
				if err != nil {
					t.Fatal(err)
				}
				if !applied.Has(&cur) || applied.Has(&old) || len(applied) != 1 {
					t.Errorf("applied: current %v, stale %v (%d in all); want only the current", applied.Has(&cur), applied.Has(&old), len(applied))
				}
				if deadLetterCount(t, pool, id) != 0 {
					t.Error("the stale outcome made a dead letter")
				}
			})
		}
	}
}

// TestExtendIsDurable: a renewal's transaction commits with
// synchronous_commit local (flushed, not waiting for a standby), even in a
// session that has it off, as the
// dispatcher's do: a renewal a server crash lost would leave the handler
// running past a lease the reclaim measures from its old start. The
// setting is read at commit, so the test runs the statement inside a
// transaction and reads it there; outside one, the statement's own
// transaction is the one it sets.
func TestExtendIsDurable(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q"}); err != nil {
		t.Fatal(err)
	}
	id, err := c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, id)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
		t.Fatal(err)
	}
	var held bool
	var vt *int32
	if err := tx.QueryRow(ctx, queries.Extend, pgx.NamedArgs{"id": m.ID, "token": m.Token}).Scan(&held, &vt); err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if !held || vt == nil || setting != "local" {
		t.Errorf("renewal: held %t, timeout %v; its transaction commits with synchronous_commit %q, want local", held, vt, setting)
	}
}

// TestExtendNeverMovesTheLeaseBack: a renewal leaves a lease's start
// alone when it is later than the renewal's now(), as when another
// renewal of the same lease began after this one but got the row first.
// Setting the older now() moved the lease's end back, while the handler's
// deadline could follow the newer renewal's answer: the reclaim took the
// message from a handler still told it held it.
func TestExtendNeverMovesTheLeaseBack(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		t.Run(source.String(), func(t *testing.T) {
			id, table, target := renewableMessage(t, client, appID, source, "extend-forward-"+source.String())
			m := claimOne(t, pool, target, id)
			// The later renewal's start, committed first.
			var later time.Time
			if err := pool.QueryRow(ctx, `UPDATE `+table+` SET claimed_at = now() + interval '10 seconds' WHERE id = $1 RETURNING claimed_at`, id).Scan(&later); err != nil {
				t.Fatal(err)
			}
			held, vt, err := claim.Extend(ctx, pool, id, m.Token)
			if err != nil {
				t.Fatal(err)
			}
			var after time.Time
			if err := pool.QueryRow(ctx, `SELECT claimed_at FROM `+table+` WHERE id = $1`, id).Scan(&after); err != nil {
				t.Fatal(err)
			}
			if !held || vt != 30*time.Second || !after.Equal(later) {
				t.Errorf("renewal: held %t, vt %s, lease start %s; want true, 30s, still %s", held, vt, after, later)
			}
		})
	}
}

// TestExtendFencedByToken: a renewal with the token of a lease that was
// reclaimed and claimed again renews nothing and changes nothing; the
// current token's renewal moves the lease's start. TestFencing covers the
// outcomes; a stale renewal that matched would push back the reclaim of a
// lease whose new holder died.
func TestExtendFencedByToken(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	reclaimer := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		t.Run(source.String(), func(t *testing.T) {
			id, table, target := renewableMessage(t, client, appID, source, "extend-fence-"+source.String())
			old, current := claimedTwice(t, pool, reclaimer, table, target, id)
			// Back-date the current lease, so that a renewal would show.
			if _, err := pool.Exec(ctx, `UPDATE `+table+` SET claimed_at = claimed_at - interval '10 seconds' WHERE id = $1`, id); err != nil {
				t.Fatal(err)
			}
			before := snapshot(t, pool, table, id)
			held, vt, err := claim.Extend(ctx, pool, id, old.Token)
			if err != nil {
				t.Fatal(err)
			}
			if held || vt != 0 {
				t.Errorf("renewal with the stale token: held %t, vt %s; want false, 0", held, vt)
			}
			if after := snapshot(t, pool, table, id); after != before {
				t.Errorf("renewal with the stale token changed the row:\nbefore %s\nafter  %s", before, after)
			}
			// Control: the current token renews.
			held, vt, err = claim.Extend(ctx, pool, id, current.Token)
			if err != nil {
				t.Fatal(err)
			}
			var age time.Duration
			if err := pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - claimed_at) * interval '1 second' FROM `+table+` WHERE id = $1`, id).Scan(&age); err != nil {
				t.Fatal(err)
			}
			if !held || vt != 30*time.Second || age > 5*time.Second {
				t.Errorf("renewal with the current token: held %t, vt %s, lease started %s ago; want true, 30s, just now", held, vt, age)
			}
		})
	}
}
