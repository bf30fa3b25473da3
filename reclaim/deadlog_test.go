package reclaim_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/reclaim"
)

const deadLine = "message dead-lettered by the reclaim: its lease expired on the last attempt"

// logLines returns the JSON log lines written so far.
func logLines(t *testing.T, logs *syncbuf.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(logs.String(), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, m)
	}
	return out
}

// expire backdates every lease by an hour: past any visibility timeout.
func expire(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for _, table := range []string{"queue_messages", "outbox"} {
		if _, err := pool.Exec(context.Background(), `UPDATE `+table+` SET claimed_at = now() - interval '1 hour'
			WHERE claim_token IS NOT NULL`); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReclaimLogsItsDeadLetters: a message, and an invoke delivery, whose
// lease expired on its last attempt (a consumer that crashed or hung) is
// dead-lettered by the reclaim and logged at warn with its fields, as a
// handler's dead letter is. The reclaim logged only its counts, at info,
// so that no log line named the message.
func TestReclaimLogsItsDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	app, err := c.CreateApp(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "hooks"})
	if err != nil {
		t.Fatal(err)
	}
	qid, err := c.Enqueue(ctx, "app", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	iid, err := c.InvokeAsync(ctx, cons.ID, []byte(`{"n":2}`), bellhop.EnqueueOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, target := range []claim.Target{
		{Source: claim.Queue, AppID: app.ID, Queue: "orders"},
		{Source: claim.Invoke, AppID: app.ID, TriggerID: cons.ID},
	} {
		if msgs, _, err := claim.Claim(ctx, pool, target, 10); err != nil || len(msgs) != 1 {
			t.Fatalf("claim %+v: %d messages, %v; want 1", target, len(msgs), err)
		}
	}
	expire(t, pool)

	logs := &syncbuf.Buffer{}
	r := reclaim.New(pool, zerolog.New(logs), reclaim.Options{DefaultVT: 30 * time.Second})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[uuid.UUID]map[string]any{
		qid: {"level": "warn", "source": "queue", "app_id": app.ID.String(), "queue": "orders",
			"message_id": qid.String(), "attempt": 1.0, "max_attempts": 1.0},
		iid: {"level": "warn", "source": "invoke", "app_id": app.ID.String(), "queue": "hooks",
			"consumer_id": cons.ID.String(), "message_id": iid.String(), "attempt": 1.0, "max_attempts": 1.0},
	}
	seen := map[string]int{}
	for _, l := range logLines(t, logs) {
		if l["message"] != deadLine {
			continue
		}
		id, _ := l["message_id"].(string)
		seen[id]++
		w, ok := want[uuid.MustParse(id)]
		if !ok {
			t.Errorf("a dead letter logged that the pass did not make: %v", l)
			continue
		}
		for k, v := range w {
			if l[k] != v {
				t.Errorf("dead letter %s logged with %s = %v, want %v (%v)", id, k, l[k], v, l)
			}
		}
	}
	for id := range want {
		if seen[id.String()] != 1 {
			t.Errorf("dead letter %s logged %d times, want once; logs:\n%s", id, seen[id.String()], logs.String())
		}
	}
}

// TestReclaimDeadLetterLogIsBounded: a pass that dead-letters many
// messages logs 10 of them one by one and one line for the rest, not a
// line each; after the burst, lines go to debug until a second has passed,
// and the next warning counts the dead letters held back.
func TestReclaimDeadLetterLogIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	app, err := c.CreateApp(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	// n messages on their last attempt, leased an hour ago.
	dying := func(n int) {
		t.Helper()
		if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt, max_attempts)
			SELECT $1, 'orders', '{}', gen_random_uuid(), now() - interval '1 hour', 1, 1 FROM generate_series(1, $2)`,
			app.ID, n); err != nil {
			t.Fatal(err)
		}
	}
	logs := &syncbuf.Buffer{}
	r := reclaim.New(pool, zerolog.New(logs), reclaim.Options{DefaultVT: 30 * time.Second})
	pass := func() {
		t.Helper()
		if _, err := r.Pass(ctx); err != nil {
			t.Fatal(err)
		}
	}
	type counts struct{ warn, debug, summaries, heldBack, notListed int }
	count := func() counts {
		var c counts
		for _, l := range logLines(t, logs) {
			switch l["message"] {
			case deadLine:
				if l["level"] == "warn" {
					c.warn++
				} else {
					c.debug++
				}
				if h, ok := l["held_back"].(float64); ok {
					c.heldBack += int(h)
				}
			case "more messages dead-lettered by the reclaim than are logged one by one: their leases expired on the last attempt":
				c.summaries++
				if l["level"] != "warn" || l["dead_lettered"] != 25.0 {
					t.Errorf("the line for the rest: %v; want a warning counting all 25", l)
				}
				if n, ok := l["not_listed"].(float64); ok {
					c.notListed += int(n)
				}
			}
		}
		return c
	}

	dying(25)
	pass()
	if got := count(); got != (counts{warn: 10, summaries: 1, notListed: 15}) {
		t.Fatalf("25 dead letters in a pass: %+v; want 10 warnings, one line for the other 15", got)
	}

	// The burst is spent: the next go to debug, counted, until a warning
	// is let through (within a second), which says how many were held.
	dying(3)
	pass()
	if got := count(); got != (counts{warn: 10, debug: 3, summaries: 1, notListed: 15}) {
		t.Fatalf("3 more dead letters at once: %+v; want 3 debug lines", got)
	}
	held := 3
	deadline := time.Now().Add(10 * time.Second)
	for {
		dying(1)
		pass()
		got := count()
		if got.warn == 11 {
			if got.heldBack != held {
				t.Errorf("the warning after the held-back lines says %d held back, want %d", got.heldBack, held)
			}
			break
		}
		held++
		if time.Now().After(deadline) {
			t.Fatalf("no warning let through within 10s: %+v", got)
		}
		time.Sleep(50 * time.Millisecond) // poll: the throttle lets one line through a second
	}
}
