package claim_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/reclaim"
)

// sharedID makes an invoke delivery and a queue message of app that share
// one id, each on its last attempt, both claimed, and an unrelated queue
// message, claimed too. Ids are unique within each table only, and a
// producer may choose a queue message's id (docs/roles.sql grants INSERT
// (id, ...)), for example to forward a delivery's id as its own.
func sharedID(t *testing.T, pool *pgxpool.Pool, c *bellhop.Client, appID uuid.UUID) (inv, q, other claim.Message) {
	t.Helper()
	ctx := context.Background()
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "inv"})
	if err != nil {
		t.Fatal(err)
	}
	id, err := c.InvokeAsync(ctx, cons.ID, []byte(`{"from":"invoke"}`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (id, app_id, queue_name, payload, max_attempts)
		VALUES ($1, $2, 'q', '{"from":"queue"}', 1)`, id, appID); err != nil {
		t.Fatal(err)
	}
	otherID, err := c.Enqueue(ctx, "app", "unrelated", []byte(`{}`), bellhop.EnqueueOptions{MaxAttempts: 5})
	if err != nil {
		t.Fatal(err)
	}
	inv = claimOne(t, pool, claim.Target{Source: claim.Invoke, AppID: appID, TriggerID: cons.ID}, id)
	q = claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, id)
	other = claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "unrelated"}, otherID)
	return inv, q, other
}

// deadPayloads returns the payloads of id's dead letters, by source.
func deadPayloads(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) map[string]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT source, payload::text FROM dead_letters WHERE id = $1`, id)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var source, payload string
		if err := rows.Scan(&source, &payload); err != nil {
			t.Fatal(err)
		}
		out[source] = payload
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func wantBothDead(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	got := deadPayloads(t, pool, id)
	if got["queue"] != `{"from": "queue"}` || got["invoke"] != `{"from": "invoke"}` || len(got) != 2 {
		t.Errorf("dead letters of %s: %v; want the queue message's and the invoke delivery's", id, got)
	}
}

// TestReclaimSharedID: a queue message and an invoke delivery sharing an
// id, whose last leases expire in one reclaim pass, both become dead
// letters. With dead letters keyed by id alone the pass inserted two rows
// with one key and failed ("ON CONFLICT DO UPDATE command cannot affect row
// a second time"), every time; since a pass is one statement for the
// whole database, no expired lease of any app came back.
func TestReclaimSharedID(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	inv, _, other := sharedID(t, pool, c, appID)
	for _, table := range []string{"queue_messages", "outbox"} {
		if _, err := pool.Exec(ctx, `UPDATE `+table+` SET claimed_at = now() - interval '1 hour' WHERE claim_token IS NOT NULL`); err != nil {
			t.Fatal(err)
		}
	}
	var got reclaim.Result
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second, OnPass: func(res reclaim.Result) { got = res }})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatalf("reclaim pass: %v", err)
	}
	if got.Released != 1 || got.DeadLettered != 2 {
		t.Errorf("reclaim pass released %d and dead-lettered %d, want 1 and 2", got.Released, got.DeadLettered)
	}
	if s := snapshot(t, pool, "queue_messages", other.ID); s == "" || claimedIn(s) {
		t.Errorf("the unrelated message after the pass: %s; want it back, unclaimed", s)
	}
	wantBothDead(t, pool, inv.ID)
}

// TestDeadLetterSharedID: the same pair dead-lettered in one settlement
// batch moves both, and the batch's other outcomes apply: one outcome
// cannot sink the others (docs/guarantees.md).
func TestDeadLetterSharedID(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	inv, q, other := sharedID(t, pool, c, appID)
	applied, err := claim.Write(ctx, pool, []claim.Outcome{
		{Message: &inv, Verdict: claim.DeadLetter, Error: "x", Queue: "inv"},
		{Message: &q, Verdict: claim.DeadLetter, Error: "y"},
		{Message: &other, Verdict: claim.Ack},
	})
	if err != nil {
		t.Fatalf("the batch failed, the unrelated ack included: %v", err)
	}
	if !applied.Has(&inv) || !applied.Has(&q) || !applied.Has(&other) {
		t.Errorf("applied %v; want all three", applied)
	}
	wantBothDead(t, pool, inv.ID)
}

// TestDeadLetterKeepsOtherAppsDeadLetter: a message of one app that dies
// under the id of another app's dead letter (a producer may choose ids)
// gets its own dead letter; the other app's stays as it was. Keyed by id
// alone, it was overwritten, app_id included, and that app's dead message
// was in neither table.
func TestDeadLetterKeepsOtherAppsDeadLetter(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	other, err := c.CreateApp(ctx, "other")
	if err != nil {
		t.Fatal(err)
	}
	id, err := c.Enqueue(ctx, "app", "q", []byte(`{"app":"first"}`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	m := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, id)
	if _, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &m, Verdict: claim.DeadLetter, Error: "first"}}); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, pool, "dead_letters", id)
	if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (id, app_id, queue_name, payload, max_attempts)
		VALUES ($1, $2, 'q', '{"app":"other"}', 1)`, id, other.ID); err != nil {
		t.Fatal(err)
	}
	m2 := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: other.ID, Queue: "q"}, id)
	if _, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &m2, Verdict: claim.DeadLetter, Error: "other"}}); err != nil {
		t.Fatal(err)
	}
	var first, second string
	err = pool.QueryRow(ctx, `SELECT (SELECT to_jsonb(d)::text FROM dead_letters d WHERE id = $1 AND app_id = $2),
		(SELECT payload::text FROM dead_letters WHERE id = $1 AND app_id = $3)`, id, appID, other.ID).Scan(&first, &second)
	if err != nil {
		t.Fatal(err)
	}
	if first != before {
		t.Errorf("the first app's dead letter changed:\n%s\nwas\n%s", first, before)
	}
	if second != `{"app": "other"}` {
		t.Errorf("the other app's dead letter has payload %s", second)
	}
}

func claimedIn(rowJSON string) bool {
	return !strings.Contains(rowJSON, `"claim_token": null`)
}

// TestDeadLetterReusedIDKeepsLatest: a producer that reuses a dead
// message's id in the same app, and sees that message die too, finds one
// dead letter for the id, the latest, whichever way each died (an outcome
// written by a dispatcher, or a reclaim pass after its last lease ran
// out): its payload, its error, and its lease's end for a redrive, which
// a later death without one clears.
func TestDeadLetterReusedIDKeepsLatest(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	target := claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}
	reclaimer := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	id, err := c.Enqueue(ctx, "app", "q", []byte(`{"life":1}`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	type letter struct {
		n            int64
		payload, err string
		redriveAfter bool
	}
	read := func() letter {
		t.Helper()
		var l letter
		err := pool.QueryRow(ctx, `SELECT count(*), coalesce(max(payload::text), ''), coalesce(max(last_error), ''), bool_or(redrive_after IS NOT NULL)
			FROM dead_letters WHERE id = $1`, id).Scan(&l.n, &l.payload, &l.err, &l.redriveAfter)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	reuse := func(life int) {
		t.Helper()
		if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (id, app_id, queue_name, payload, max_attempts)
			VALUES ($1, $2, 'q', jsonb_build_object('life', $3::int), 1)`, id, appID, life); err != nil {
			t.Fatal(err)
		}
	}

	// Life 1: its handler was abandoned on its last attempt.
	m := claimOne(t, pool, target, id)
	if _, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &m, Verdict: claim.DeadLetter, Error: "first death", HoldLease: time.Minute}}); err != nil {
		t.Fatal(err)
	}
	if l := read(); l.n != 1 || l.payload != `{"life": 1}` || l.err != "first death" || !l.redriveAfter {
		t.Fatalf("after the first death: %+v", l)
	}
	// Life 2: its last lease ran out, and a reclaim pass dead-lettered it.
	reuse(2)
	claimOne(t, pool, target, id)
	if _, err := pool.Exec(ctx, `UPDATE queue_messages SET claimed_at = now() - interval '1 hour' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := reclaimer.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if l := read(); l.n != 1 || l.payload != `{"life": 2}` || l.err == "first death" || l.err == "" || l.redriveAfter {
		t.Fatalf("after the second death, by reclaim: %+v; want life 2, the reclaim's error and no redrive_after", l)
	}
	// Life 3: dead-lettered by its handler.
	reuse(3)
	m = claimOne(t, pool, target, id)
	if _, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &m, Verdict: claim.DeadLetter, Error: "third death"}}); err != nil {
		t.Fatal(err)
	}
	if l := read(); l.n != 1 || l.payload != `{"life": 3}` || l.err != "third death" || l.redriveAfter {
		t.Fatalf("after the third death: %+v", l)
	}
	var live int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE id = $1`, id).Scan(&live); err != nil || live != 0 {
		t.Errorf("%d live messages with the id after its third death (%v)", live, err)
	}
}
