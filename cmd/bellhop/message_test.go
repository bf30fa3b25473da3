package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// makeInFlight leases the messages of ids as a dispatcher's claim does,
// so that they are being delivered: message rm and purge must leave them.
const makeInFlight = `UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1 WHERE id = ANY ($1::uuid[])`

// queueRows is every row of queue_messages, whole, in id order: a
// command that must change nothing must leave it the same, its leases
// (claim_token, attempt) included, not only the count.
func queueRows(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(),
		`SELECT coalesce(string_agg(m::text, E'\n' ORDER BY m.id), '') FROM queue_messages m`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// addMessages inserts n messages into app's queue, the oldest first, and
// returns their ids in that order; every tenth is delayed by an hour.
func addMessages(t *testing.T, pool *pgxpool.Pool, app, queue string, n int) []string {
	t.Helper()
	rows, err := pool.Query(t.Context(), `
		INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after)
		SELECT a.id, $2, jsonb_build_object('n', g), now() - ($3::int - g) * interval '1 ms',
		       CASE WHEN g % 10 = 0 THEN now() + interval '1 hour' END
		FROM apps a, generate_series(1, $3::int) AS g WHERE a.name = $1
		RETURNING id::text`, app, queue, n)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(ids) != n {
		t.Fatalf("inserted %d messages into %s/%s, want %d (is there such an app?)", len(ids), app, queue, n)
	}
	return ids
}

// shopAndMall makes a database with apps shop and mall, and returns its
// connection string and a pool on it.
func shopAndMall(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	ok(t, dsn, "app", "create", "mall")
	return dsn, db(t, dsn)
}

// TestMessageRm: message rm deletes one message of the app that waits for
// delivery, ready or delayed, and says so; it refuses, with exit 2 and
// nothing deleted, an id of no message of the app (another app's too:
// --app is no formality) and a missing or bad MESSAGE_ID or --app; and it
// leaves a message being delivered to its delivery, exit 1, saying since
// when, as a retry may succeed once that delivery has failed.
func TestMessageRm(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	ready := enqueue(t, dsn, "shop", "orders", `{"n":"ready"}`)
	delayed := enqueue(t, dsn, "shop", "orders", `{"n":"delayed"}`, "--delay", "1h")
	fromEnv := enqueue(t, dsn, "shop", "orders", `{"n":"env"}`)
	busy := enqueue(t, dsn, "shop", "orders", `{"n":"busy"}`)
	mall := enqueue(t, dsn, "mall", "orders", `{"n":"mall"}`)
	if _, err := pool.Exec(t.Context(), makeInFlight, []string{busy}); err != nil {
		t.Fatal(err)
	}
	const unknown = "5a0c1e7e-7d4f-4b8e-9d3a-0e6f1c2b3a4d"
	tests := []struct {
		name   string
		env    []string // besides DATABASE_URL
		args   []string // after message rm
		code   int
		stdout string
		stderr string // in the one line, when the command fails
		gone   string // the message deleted, when it succeeds
	}{
		{name: "ready", args: []string{"--app", "shop", ready}, stdout: "deleted message " + ready + "\n", gone: ready},
		{name: "delayed", args: []string{delayed, "--app", "shop"}, stdout: "deleted message " + delayed + "\n", gone: delayed},
		{name: "app from BELLHOP_APP", env: []string{"BELLHOP_APP=shop"}, args: []string{fromEnv},
			stdout: "deleted message " + fromEnv + "\n", gone: fromEnv},
		{name: "in flight", args: []string{"--app", "shop", busy}, code: 1,
			stderr: "delete message " + busy + " of app shop: message in flight: being delivered, under a lease taken or renewed at "},
		{name: "unknown id", args: []string{"--app", "shop", unknown}, code: 2,
			stderr: "delete message " + unknown + " of app shop: unknown message"},
		{name: "another app's message", args: []string{"--app", "shop", mall}, code: 2,
			stderr: "delete message " + mall + " of app shop: unknown message"},
		{name: "deleted already", args: []string{"--app", "shop", ready}, code: 2, stderr: "unknown message"},
		{name: "unknown app", args: []string{"--app", "nope", ready}, code: 2, stderr: "unknown app"},
		{name: "not a UUID", args: []string{"--app", "shop", ready + "x"}, code: 2, stderr: `message id "` + ready + `x" is not a UUID`},
		{name: "empty id", args: []string{"--app", "shop", ""}, code: 2, stderr: `message id "" is not a UUID`},
		{name: "nil UUID", args: []string{"--app", "shop", "00000000-0000-0000-0000-000000000000"}, code: 2,
			stderr: "message id 00000000-0000-0000-0000-000000000000 is the nil UUID"},
		{name: "no id", args: []string{"--app", "shop"}, code: 2, stderr: "message rm takes exactly one argument, MESSAGE_ID"},
		{name: "two ids", args: []string{"--app", "shop", busy, mall}, code: 2, stderr: "message rm takes exactly one argument, MESSAGE_ID"},
		{name: "no --app", args: []string{mall}, code: 2, stderr: "--app is required"},
		{name: "empty BELLHOP_APP", env: []string{"BELLHOP_APP="}, args: []string{mall}, code: 2, stderr: "BELLHOP_APP is set but empty; unset it, or name the app"},
		{name: "empty --app", args: []string{"--app", "", mall}, code: 2, stderr: "--app: invalid name"},
		{name: "bad --app", args: []string{"--app", "x'; DELETE FROM queue_messages; --", mall}, code: 2, stderr: "--app: invalid name"},
	}
	// In order: "deleted already" follows "ready".
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before, count := queueRows(t, pool), queryInt(t, pool, "SELECT count(*) FROM queue_messages")
			r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), "", append([]string{"message", "rm"}, tc.args...)...)
			if tc.code == 0 {
				if r.code != 0 || r.stdout != tc.stdout || r.stderr != "" {
					t.Fatalf("want exit 0 and %q; got %s", tc.stdout, r)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE id = $1", tc.gone); n != 0 {
					t.Errorf("message %s is still there", tc.gone)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != count-1 {
					t.Errorf("%d messages left, want %d: only the one named goes", n, count-1)
				}
				return
			}
			if r.code != tc.code || r.stdout != "" || strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 ||
				!strings.Contains(r.stderr, tc.stderr) {
				t.Errorf("want exit %d and one line with %q; got %s", tc.code, tc.stderr, r)
			}
			if after := queueRows(t, pool); after != before {
				t.Errorf("the refused message rm changed queue_messages:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
	// The message in flight is deleted once its delivery has failed and
	// it waits for its retry, as the refusal said.
	if _, err := pool.Exec(t.Context(), `UPDATE queue_messages SET claim_token = NULL, claimed_at = NULL WHERE id = $1`, busy); err != nil {
		t.Fatal(err)
	}
	if out := ok(t, dsn, "message", "rm", "--app", "shop", busy); out != "deleted message "+busy+"\n" {
		t.Errorf("message rm of the message back in its queue printed %q", out)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE id = $1", mall); n != 1 {
		t.Errorf("mall's message is gone")
	}
}

// TestMessagePurge: message purge deletes every message of the app's
// queue that waits for delivery, ready or delayed, in more than one
// batch, and leaves those being delivered, another queue's, and those of
// another app's queue of the same name; it says how many it deleted and
// how many in flight it left.
func TestMessagePurge(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	const total = bellhop.PurgeBatch + 205
	ids := addMessages(t, pool, "shop", "orders", total)
	busy := []string{ids[0], ids[total/2]}
	if _, err := pool.Exec(t.Context(), makeInFlight, busy); err != nil {
		t.Fatal(err)
	}
	addMessages(t, pool, "shop", "returns", 7)
	addMessages(t, pool, "mall", "orders", 11)
	others := func() string {
		t.Helper()
		var s string
		if err := pool.QueryRow(t.Context(), `SELECT coalesce(string_agg(m::text, E'\n' ORDER BY m.id), '')
			FROM queue_messages m JOIN apps a ON a.id = m.app_id
			WHERE NOT (a.name = 'shop' AND m.queue_name = 'orders') OR m.id = ANY ($1::uuid[])`, busy).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := others()
	if n := strings.Count(before, "\n") + 1; n != 7+11+2 {
		t.Fatalf("the fixture holds %d messages outside the purge, want 20", n)
	}

	r := exe(t, dsn, "", "message", "purge", "--app", "shop", "--queue", "orders")
	want := fmt.Sprintf("purged %d messages of shop/orders; 2 in flight left to their delivery\n", total-2)
	if r.code != 0 || r.stdout != want || r.stderr != "" {
		t.Errorf("want exit 0 and %q; got %s", want, r)
	}
	var left []string
	if err := pool.QueryRow(t.Context(), `SELECT coalesce(array_agg(m.id::text ORDER BY m.id), '{}') FROM queue_messages m
		JOIN apps a ON a.id = m.app_id WHERE a.name = 'shop' AND m.queue_name = 'orders'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if slices.Sort(busy); !slices.Equal(left, busy) {
		t.Errorf("shop/orders holds %v after the purge, want only the two in flight, %v", left, busy)
	}
	if after := others(); after != before {
		t.Errorf("the purge changed messages it must leave:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	// Again: nothing to delete, and the same two in flight.
	if out := ok(t, dsn, "message", "purge", "--app", "shop", "--queue", "orders"); out != "purged 0 messages of shop/orders; 2 in flight left to their delivery\n" {
		t.Errorf("the second purge printed %q", out)
	}
}

// TestMessagePurgeInFlightNote: the purge's line says how many messages
// of the queue are left in flight, and nothing of them when there are
// none.
func TestMessagePurgeInFlightNote(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	tests := []struct {
		queue    string
		n        int // messages
		inFlight int // of them
		want     string
	}{
		{"none", 0, 0, "purged 0 messages of shop/none\n"},
		{"one", 1, 0, "purged 1 message of shop/one\n"},
		{"idle", 3, 0, "purged 3 messages of shop/idle\n"},
		{"busy", 3, 1, "purged 2 messages of shop/busy; 1 in flight left to its delivery\n"},
		{"all.busy", 2, 2, "purged 0 messages of shop/all.busy; 2 in flight left to their delivery\n"},
	}
	for _, tc := range tests {
		t.Run(tc.queue, func(t *testing.T) {
			t.Parallel()
			if tc.n > 0 {
				ids := addMessages(t, pool, "shop", tc.queue, tc.n)
				if _, err := pool.Exec(t.Context(), makeInFlight, ids[:tc.inFlight]); err != nil {
					t.Fatal(err)
				}
			}
			if out := ok(t, dsn, "message", "purge", "--app", "shop", "--queue", tc.queue); out != tc.want {
				t.Errorf("printed %q, want %q", out, tc.want)
			}
			if n := queryInt(t, pool, `SELECT count(*) FROM queue_messages WHERE queue_name = $1`, tc.queue); n != tc.inFlight {
				t.Errorf("%d messages left, want the %d in flight", n, tc.inFlight)
			}
		})
	}
}

// TestMessagePurgeRefuses: a purge of a --queue that is no valid queue
// name, of an unknown app, or without --queue or --app, is refused with
// exit 2 and one line naming the problem, and deletes nothing.
func TestMessagePurgeRefuses(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	addMessages(t, pool, "shop", "orders", 5)
	addMessages(t, pool, "mall", "orders", 5)
	tests := []struct {
		name string
		env  []string // besides DATABASE_URL
		args []string // after message purge
		want string   // in the one line on stderr
	}{
		{"queue with a space", nil, []string{"--app", "shop", "--queue", "bad q"}, `--queue: invalid queue name "bad q"`},
		{"queue with a slash", nil, []string{"--app", "shop", "--queue", "orders/x"}, `--queue: invalid queue name "orders/x"`},
		{"queue too long", nil, []string{"--app", "shop", "--queue", strings.Repeat("a", 129)}, "--queue: invalid queue name"},
		{"empty queue", nil, []string{"--app", "shop", "--queue", ""}, `--queue: invalid queue name ""`},
		{"SQL for a queue", nil, []string{"--app", "shop", "--queue", "orders'; DELETE FROM queue_messages; --"}, "--queue: invalid queue name"},
		{"unknown app", nil, []string{"--app", "nope", "--queue", "orders"}, `purge queue nope/orders: unknown app "nope"`},
		{"unknown app from BELLHOP_APP", []string{"BELLHOP_APP=nope"}, []string{"--queue", "orders"}, "unknown app"},
		{"bad app", nil, []string{"--app", "shop/orders", "--queue", "orders"}, `--app: invalid name: app name "shop/orders"`},
		{"empty app", nil, []string{"--app", "", "--queue", "orders"}, "--app: invalid name"},
		{"no --queue", nil, []string{"--app", "shop"}, "--queue is required"},
		{"no --app", nil, []string{"--queue", "orders"}, "--app is required"},
		{"empty BELLHOP_APP", []string{"BELLHOP_APP="}, []string{"--queue", "orders"}, "BELLHOP_APP is set but empty; unset it, or name the app"},
		{"neither", nil, nil, "--app and --queue are required"},
		{"a MESSAGE_ID", nil, []string{"--app", "shop", "--queue", "orders", "5a0c1e7e-7d4f-4b8e-9d3a-0e6f1c2b3a4d"}, "bellhop message purge takes no arguments"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			before := queueRows(t, pool)
			r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), "", append([]string{"message", "purge"}, tc.args...)...)
			if r.code != 2 || r.stdout != "" || strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 ||
				!strings.Contains(r.stderr, tc.want) {
				t.Errorf("want exit 2 and one line with %q; got %s", tc.want, r)
			}
			if after := queueRows(t, pool); after != before {
				t.Errorf("the refused purge changed queue_messages")
			}
		})
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 10 {
		t.Errorf("%d messages left, want 10", n)
	}
}

// TestMessagePurgeFailingPartWaySaysWhatWent: a purge whose second batch
// fails (a trigger refuses the second DELETE) keeps the first batch
// deleted, prints how many went before the error, and exits 1 with the
// error; running it again deletes the rest.
func TestMessagePurgeFailingPartWaySaysWhatWent(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	const total = bellhop.PurgeBatch + 100
	addMessages(t, pool, "shop", "orders", total)
	refuseSecondStatement(t, pool, "DELETE")
	r := exe(t, dsn, "", "message", "purge", "--app", "shop", "--queue", "orders")
	want := fmt.Sprintf("purged %d messages of shop/orders before the error\n", bellhop.PurgeBatch)
	if r.code != 1 || r.stdout != want || !strings.Contains(r.stderr, "second batch refused by the test") {
		t.Errorf("want exit 1, %q and the batch's error; got %s", want, r)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 100 {
		t.Errorf("%d messages left, want 100", n)
	}
	if out := ok(t, dsn, "message", "purge", "--app", "shop", "--queue", "orders"); out != "purged 100 messages of shop/orders\n" {
		t.Errorf("the second purge printed %q", out)
	}
}

// TestMessageCommandsInterrupted: message rm and purge, stopped by SIGINT
// while their DELETE waits for a row lock (another transaction's on the
// message), cancel it on the server, say they were interrupted and exit
// 1, and delete nothing, even once the lock is free. A table lock held
// them up before they sent their DELETE (pgx prepares it first, which
// the lock holds up): that deleted nothing whether or not the stop
// cancelled anything.
func TestMessageCommandsInterrupted(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	ids := addMessages(t, pool, "shop", "orders", 3)
	for _, args := range [][]string{
		{"message", "rm", "--app", "shop", ids[1]},
		{"message", "purge", "--app", "shop", "--queue", "orders"},
	} {
		t.Run(args[1], func(t *testing.T) {
			ctx := context.Background()
			before := queueRows(t, pool)
			holder, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Rollback(ctx)
			if _, err := holder.Exec(ctx, "SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE", ids[1]); err != nil {
				t.Fatal(err)
			}
			p := start(t, []string{"DATABASE_URL=" + dsn}, args...)
			waitFor(t, 30*time.Second, strings.Join(args[:2], " ")+" waiting for the row lock", func() bool {
				return queryInt(t, pool, activeOthers+` AND wait_event_type = 'Lock'`) == 1
			})
			p.signal(os.Interrupt)
			if code := p.wait(30 * time.Second); code != 1 || !strings.Contains(p.stderr(), "interrupted") || p.stdout() != "" {
				t.Errorf("after SIGINT: exit %d, stdout %q, stderr %q; want exit 1 saying interrupted", code, p.stdout(), p.stderr())
			}
			if err := holder.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "no other session running a statement", func() bool {
				return queryInt(t, pool, activeOthers) == 0
			})
			if after := queueRows(t, pool); after != before {
				t.Errorf("the interrupted command deleted messages once the lock was free")
			}
		})
	}
}

// TestMessagePurgeSaysWhatWaitsStill: a purge leaves the queue consumer's
// invoke deliveries and the messages enqueued after it began, and its
// line says how many wait still, so that `bellhop queues` showing them
// does not read as a purge that failed.
func TestMessagePurgeSaysWhatWaitsStill(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	c := bellhop.NewClient(pool)
	con, err := c.RegisterConsumer(t.Context(), bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.InvokeAsync(t.Context(), con.ID, []byte(`"invoked"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	addMessages(t, pool, "shop", "orders", 3)
	if _, err := pool.Exec(t.Context(), `INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at)
		SELECT id, 'orders', '"later"', now() + interval '1 hour' FROM apps WHERE name = 'shop'`); err != nil {
		t.Fatal(err)
	}
	want := "purged 3 messages of shop/orders; 2 waiting left (enqueued since the purge began, or invoke deliveries, which it does not delete)\n"
	if out := ok(t, dsn, "message", "purge", "--app", "shop", "--queue", "orders"); out != want {
		t.Errorf("printed %q, want %q", out, want)
	}
	if n := queryInt(t, pool, `SELECT (SELECT count(*) FROM queue_messages) + (SELECT count(*) FROM outbox)`); n != 2 {
		t.Errorf("%d messages and invoke deliveries left, want 2", n)
	}
}

// TestMessageShow: message show prints a queue message as JSON, times in
// UTC, waiting (ClaimedAt null) or in flight, with a payload's bidi
// override escaped; an id of no message of the app exits 2.
func TestMessageShow(t *testing.T) {
	t.Parallel()
	dsn, pool := shopAndMall(t)
	ids := addMessages(t, pool, "shop", "orders", 10) // the tenth delayed
	other := addMessages(t, pool, "mall", "orders", 1)
	if _, err := pool.Exec(t.Context(), `UPDATE queue_messages SET payload = '"a\u202eb"' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), makeInFlight, ids[:1]); err != nil {
		t.Fatal(err)
	}
	type view struct {
		ID, App, Queue       string
		Payload              json.RawMessage
		EnqueuedAt           string
		DeliverAfter         *string
		Attempt, MaxAttempts int
		ClaimedAt            *string
	}
	show := func(id string) (view, string) {
		t.Helper()
		out := ok(t, dsn, "message", "show", "--app", "shop", id)
		var v view
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			t.Fatalf("message show %s printed %q: %v", id, out, err)
		}
		return v, out
	}
	utc := func(s *string) bool { return s != nil && strings.HasSuffix(*s, "Z") }
	v, out := show(ids[0])
	if v.ID != ids[0] || v.App != "shop" || v.Queue != "orders" || !utc(&v.EnqueuedAt) || v.DeliverAfter != nil ||
		v.Attempt != 1 || v.MaxAttempts != 3 || !utc(v.ClaimedAt) || !strings.Contains(out, `"a\u202eb"`) {
		t.Errorf("a message in flight: %s", out)
	}
	if v, out := show(ids[9]); !utc(v.DeliverAfter) || v.ClaimedAt != nil || v.Attempt != 0 || strings.Join(strings.Fields(string(v.Payload)), "") != `{"n":10}` {
		t.Errorf("a delayed message waiting: %s", out)
	}
	// A payload nested deeper than encoding/json reads, which plain SQL
	// can store: shown as a string, and said so.
	if _, err := pool.Exec(t.Context(), `UPDATE queue_messages SET payload = (repeat('[', 10001) || repeat(']', 10001))::jsonb WHERE id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	r := exe(t, dsn, "", "message", "show", "--app", "shop", ids[1])
	var deep struct{ Payload string }
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &deep) != nil || len(deep.Payload) != 2*10001 || !strings.Contains(r.stderr, "nests too deep") {
		t.Errorf("message show of a payload nested 10,001 deep: exit %d, stderr %q, %d bytes of payload as a string; want exit 0, the payload as a string of %d bytes, and a word on stderr",
			r.code, r.stderr, len(deep.Payload), 2*10001)
	}
	for _, id := range []string{other[0], "0b6e3a8e-8f5d-4c3a-9d2b-1a2b3c4d5e6f"} {
		if r := exe(t, dsn, "", "message", "show", "--app", "shop", id); r.code != 2 || r.stdout != "" || !strings.Contains(r.stderr, "unknown message") {
			t.Errorf("message show of no message of the app: %s; want exit 2 saying unknown message", r)
		}
	}
}
