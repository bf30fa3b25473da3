package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
)

// schemaSnapshot lists the public relations with their OIDs: a migration
// that ran again would have to drop and recreate them, changing OIDs.
func schemaSnapshot(t *testing.T, dsn string) []string {
	t.Helper()
	rows, err := db(t, dsn).Query(context.Background(),
		`SELECT c.relname || ':' || c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = 'public' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestMigrateOnEmptyDatabase(t *testing.T) {
	t.Parallel()
	dsn := emptyDatabase(t)
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("database is at schema version %d (%s)\n", latest, migrations.Name(latest))

	if out := ok(t, dsn, "migrate"); out != want {
		t.Fatalf("first migrate printed %q, want %q", out, want)
	}
	before := schemaSnapshot(t, dsn)
	if !slices.ContainsFunc(before, func(s string) bool { return strings.HasPrefix(s, "queue_messages:") }) {
		t.Fatalf("migrate created no queue_messages table: %v", before)
	}
	if out := ok(t, dsn, "migrate"); out != want {
		t.Fatalf("second migrate printed %q, want %q", out, want)
	}
	if after := schemaSnapshot(t, dsn); !slices.Equal(before, after) {
		t.Fatalf("second migrate changed the schema:\nbefore %v\nafter  %v", before, after)
	}
	if v := queryInt(t, db(t, dsn), "SELECT version FROM "+migrations.VersionTable); v != latest {
		t.Fatalf("schema version %d, want %d", v, latest)
	}
}

// TestHappyPath: app create, consumer add, run, and messages enqueued by
// the CLI (one argument, and a stream on stdin) and by plain SQL all
// reach the consumer signed and with the documented headers.
func TestHappyPath(t *testing.T) {
	t.Parallel()
	dsn := emptyDatabase(t)
	ok(t, dsn, "migrate")
	out := strings.TrimSpace(ok(t, dsn, "app", "create", "shop"))
	m := appCreatedRE.FindStringSubmatch(out)
	if m == nil || m[1] != "shop" {
		t.Fatalf("app create printed %q", out)
	}
	appID := m[2]
	// The default principal's id, which Client.As takes.
	if n := queryInt(t, db(t, dsn), `SELECT count(*) FROM principals WHERE id = $1 AND app_id = $2 AND name = 'default'`, m[3], appID); n != 1 {
		t.Errorf("app create printed %s as the default principal's id; no such principal of the app", m[3])
	}
	h := newHook(t)
	consumerID, secret := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", h.srv.URL+"/hook", "--max-attempts", "4")
	h.setSecret(secret)

	d := startDaemon(t, dsn)

	want := map[string]string{} // payload by message id, where known
	want[enqueue(t, dsn, "shop", "orders", `{"a":1}`)] = `{"a":1}`
	r := exe(t, dsn, "{\"b\":1}\n\n  {\"b\":2}\n[3]\n", "enqueue", "--app", "shop", "--queue", "orders", "-")
	if r.code != 0 || !enqueuedManyR.MatchString(strings.TrimSpace(r.stdout)) || !strings.Contains(r.stdout, "enqueued 3 ") {
		t.Fatalf("enqueue -: %s", r)
	}
	pool := db(t, dsn)
	if _, err := pool.Exec(context.Background(),
		`INSERT INTO queue_messages (app_id, queue_name, payload) SELECT id, 'orders', '{"sql": true}' FROM apps WHERE name = 'shop'`); err != nil {
		t.Fatal(err)
	}

	got := h.waitCount(t, 5, 30*time.Second)
	var bodies []string
	for _, g := range got {
		if g.verify != nil {
			t.Errorf("message %s: signature does not verify: %v", g.id(), g.verify)
		}
		hd := g.header
		checks := map[string]string{
			"Content-Type":           "application/json",
			"User-Agent":             httppush.DefaultUserAgent,
			bellhop.HeaderApp:        "shop",
			bellhop.HeaderQueue:      "orders",
			bellhop.HeaderAttempt:    "1",
			bellhop.HeaderConsumerID: consumerID,
			bellhop.HeaderSource:     "queue",
		}
		// The consumer's --max-attempts is the default of messages
		// enqueued through the CLI; a plain INSERT gets the column's
		// default (3), as documented on bellhop.ConsumerSpec.
		wantMax := "4"
		if strings.Contains(string(g.body), "sql") {
			wantMax = "3"
		}
		if got := hd.Get(bellhop.HeaderMaxAttempts); got != wantMax {
			t.Errorf("message %s (%s): %s = %q, want %q", g.id(), g.body, bellhop.HeaderMaxAttempts, got, wantMax)
		}
		if !uuidLineRE.MatchString(g.id()) {
			t.Errorf("message id header %q", g.id())
		}
		for k, v := range checks {
			if hd.Get(k) != v {
				t.Errorf("message %s: header %s = %q, want %q", g.id(), k, hd.Get(k), v)
			}
		}
		if ts, err := strconv.ParseInt(hd.Get(bellhop.HeaderTimestamp), 10, 64); err != nil || time.Since(time.Unix(ts, 0)).Abs() > time.Minute {
			t.Errorf("message %s: Bellhop-Timestamp %q", g.id(), hd.Get(bellhop.HeaderTimestamp))
		}
		if at, err := time.Parse(time.RFC3339Nano, hd.Get(bellhop.HeaderEnqueuedAt)); err != nil || time.Since(at) > time.Minute {
			t.Errorf("message %s: Bellhop-Enqueued-At %q", g.id(), hd.Get(bellhop.HeaderEnqueuedAt))
		}
		if p, known := want[g.id()]; known && !jsonEqual(t, []byte(p), g.body) {
			t.Errorf("message %s: body %s, want %s", g.id(), g.body, p)
		}
		var v any
		_ = json.Unmarshal(g.body, &v)
		b, _ := json.Marshal(v)
		bodies = append(bodies, string(b))
	}
	slices.Sort(bodies)
	wantBodies := []string{`[3]`, `{"a":1}`, `{"b":1}`, `{"b":2}`, `{"sql":true}`}
	if !slices.Equal(bodies, wantBodies) {
		t.Errorf("bodies %v, want %v", bodies, wantBodies)
	}
	// Every message acked: the rows are gone.
	waitFor(t, 10*time.Second, "queue_messages to empty", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM queue_messages") == 0
	})
	if n := len(h.deliveries()); n != 5 {
		t.Errorf("%d deliveries, want 5 (no redelivery after ack)", n)
	}
	// The queue list shows the queue with its consumer and nothing left.
	row := queueRow(t, ok(t, dsn, "queues"), "shop", "orders")
	if row["READY"] != "0" || row["IN FLIGHT"] != "0" || row["DEAD"] != "0" || row["CONSUMER"] != consumerID {
		t.Errorf("queues row %v", row)
	}
	if ls := ok(t, dsn, "app", "ls"); !strings.Contains(ls, appID) {
		t.Errorf("app ls lacks %s:\n%s", appID, ls)
	}

	d.signal(syscall.SIGTERM)
	if code := d.wait(20 * time.Second); code != 0 {
		t.Fatalf("run exited %d after SIGTERM", code)
	}
}

// queueRow parses `bellhop queues` output (columns separated by two or
// more spaces) and returns the row of app/queue by column name.
func queueRow(t *testing.T, out, app, queue string) map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	sep := regexp.MustCompile(`\s{2,}`)
	header := sep.Split(strings.TrimSpace(lines[0]), -1)
	wantHeader := []string{"APP", "QUEUE", "READY", "DELAYED", "IN FLIGHT", "DEAD", "OLDEST READY", "CONSUMER"}
	if !slices.Equal(header, wantHeader) {
		t.Fatalf("queues header %q, want %q", header, wantHeader)
	}
	for _, l := range lines[1:] {
		f := sep.Split(strings.TrimSpace(l), -1)
		if len(f) != len(header) {
			t.Fatalf("queues row %q has %d columns", l, len(f))
		}
		if f[0] == app && f[1] == queue {
			row := map[string]string{}
			for i, h := range header {
				row[h] = f[i]
			}
			return row
		}
	}
	t.Fatalf("queues shows no %s/%s:\n%s", app, queue, out)
	return nil
}

// TestResponseCodes: 503 with Retry-After is honoured, 400 dead-letters
// at once, and a redriven dead letter is delivered again.
func TestResponseCodes(t *testing.T) {
	t.Parallel()
	// A short backoff: a retry seconds later can only be Retry-After's doing.
	dsn, h, _ := setup(t, "--backoff-min", "50ms", "--backoff-max", "100ms")
	h.respond = func(w http.ResponseWriter, _ *http.Request, d delivery, nth int) {
		var p struct{ Case string }
		_ = json.Unmarshal(d.body, &p)
		switch {
		case p.Case == "busy" && nth == 1:
			w.Header().Set("Retry-After", "2")
			http.Error(w, "come back later", http.StatusServiceUnavailable)
		case p.Case == "reject" && nth == 1:
			http.Error(w, "no such order", http.StatusBadRequest)
		default:
			w.WriteHeader(http.StatusOK)
		}
	}
	startDaemon(t, dsn)
	pool := db(t, dsn)

	busy := enqueue(t, dsn, "shop", "orders", `{"case":"busy"}`)
	reject := enqueue(t, dsn, "shop", "orders", `{"case":"reject"}`)
	h.waitCount(t, 3, 20*time.Second) // busy twice, reject once

	var busyAt []time.Time
	for _, d := range h.deliveries() {
		if d.id() == busy {
			busyAt = append(busyAt, d.at)
			if want := strconv.Itoa(len(busyAt)); d.header.Get(bellhop.HeaderAttempt) != want {
				t.Errorf("busy delivery %d has attempt %q", len(busyAt), d.header.Get(bellhop.HeaderAttempt))
			}
		}
	}
	if len(busyAt) != 2 {
		t.Fatalf("busy message delivered %d times, want 2", len(busyAt))
	}
	if gap := busyAt[1].Sub(busyAt[0]); gap < 1900*time.Millisecond || gap > 6*time.Second {
		t.Errorf("retry %s after a 503 with Retry-After: 2, want about 2s", gap)
	}

	// The 400 dead-lettered the message after one attempt.
	waitFor(t, 10*time.Second, "the rejected message in dead_letters", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM dead_letters WHERE id = $1", reject) == 1
	})
	ls := ok(t, dsn, "dead", "ls", "--app", "shop")
	var line string
	for l := range strings.SplitSeq(ls, "\n") {
		if strings.HasPrefix(l, reject) {
			line = l
		}
	}
	if line == "" || !strings.Contains(line, "orders") || !strings.Contains(line, "1/5") || !strings.Contains(line, "HTTP 400") {
		t.Fatalf("dead ls has no proper line for %s:\n%s", reject, ls)
	}
	var dl struct {
		ID          string
		App, Queue  string
		Source      string
		Payload     json.RawMessage
		Attempt     int
		MaxAttempts int
		LastError   string
		DiedAt      time.Time
	}
	show := ok(t, dsn, "dead", "show", "--app", "shop", reject)
	if err := json.Unmarshal([]byte(show), &dl); err != nil {
		t.Fatalf("dead show is not JSON: %v\n%s", err, show)
	}
	if dl.ID != reject || dl.App != "shop" || dl.Queue != "orders" || dl.Source != "queue" || dl.Attempt != 1 || dl.MaxAttempts != 5 ||
		!strings.Contains(dl.LastError, "HTTP 400") || !strings.Contains(dl.LastError, "no such order") ||
		!jsonEqual(t, dl.Payload, []byte(`{"case":"reject"}`)) || time.Since(dl.DiedAt) > time.Minute {
		t.Errorf("dead show: %+v", dl)
	}

	// Redrive: delivered again, and this time accepted.
	if out := ok(t, dsn, "dead", "redrive", "--app", "shop", reject); out != "redrove 1 dead letter\n" {
		t.Errorf("dead redrive printed %q", out)
	}
	h.waitCount(t, 4, 20*time.Second)
	last := h.deliveries()[3]
	if last.id() != reject || last.verify != nil {
		t.Fatalf("4th delivery is %s (verify %v), want the redriven %s", last.id(), last.verify, reject)
	}
	waitFor(t, 10*time.Second, "the redriven message acked", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM queue_messages") == 0
	})
	if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 0 {
		t.Errorf("%d dead letters left after redrive", n)
	}
	// A dead letter that is not there: an error, not "redrove 0".
	if r := exe(t, dsn, "", "dead", "redrive", "--app", "shop", reject); r.code != 2 || !strings.Contains(r.stderr, "no dead letter") {
		t.Errorf("redrive of a gone dead letter: %s", r)
	}
}

// TestDeadQueueOperations: redrive and purge of all of a queue's dead
// letters, without a daemon (dead letters are made with SQL).
func TestDeadQueueOperations(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	kill := func(queue string, n int) {
		t.Helper()
		if _, err := pool.Exec(context.Background(), `
			INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
			SELECT gen_random_uuid(), 'queue', id, $1, jsonb_build_object('n', g), now(), 3, 3, 'boom'
			FROM apps, generate_series(1, $2) AS g WHERE name = 'shop'`, queue, n); err != nil {
			t.Fatal(err)
		}
	}
	kill("a", 3)
	kill("b", 2)
	if out := ok(t, dsn, "dead", "redrive", "--app", "shop", "--queue", "a"); out != "redrove 3 dead letters\n" {
		t.Errorf("redrive --queue a printed %q", out)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE queue_name = 'a' AND claim_token IS NULL"); n != 3 {
		t.Errorf("%d messages back in queue a, want 3", n)
	}
	if out := ok(t, dsn, "dead", "purge", "--app", "shop", "--queue", "b"); out != "purged 2 dead letters\n" {
		t.Errorf("purge --queue b printed %q", out)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 0 {
		t.Errorf("%d dead letters left", n)
	}
	// A long last error is cut in the listing, on a character boundary.
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT gen_random_uuid(), 'queue', id, 'long', '{}', now(), 1, 1, 'x' || repeat('é', 100) FROM apps WHERE name = 'shop'`); err != nil {
		t.Fatal(err)
	}
	if out := ok(t, dsn, "dead", "ls", "--app", "shop", "--queue", "long"); !utf8.ValidString(out) || !strings.Contains(out, "xéé") || !strings.Contains(out, "é…") {
		t.Errorf("dead ls of a long error:\n%q", out)
	}
	ok(t, dsn, "dead", "purge", "--app", "shop", "--queue", "long")

	kill("c", 1)
	var id string
	if err := pool.QueryRow(context.Background(), "SELECT id::text FROM dead_letters").Scan(&id); err != nil {
		t.Fatal(err)
	}
	if out := ok(t, dsn, "dead", "ls", "--app", "shop", "--queue", "c"); !strings.Contains(out, id) || !strings.Contains(out, "3/3") || !strings.Contains(out, "boom") {
		t.Errorf("dead ls --queue c:\n%s", out)
	}
	if out := ok(t, dsn, "dead", "purge", "--app", "shop", id); out != "purged 1 dead letter\n" {
		t.Errorf("purge %s printed %q", id, out)
	}
	if r := exe(t, dsn, "", "dead", "show", "--app", "shop", id); r.code != 2 || !strings.Contains(r.stderr, "no dead letter") {
		t.Errorf("dead show of a purged letter: %s", r)
	}
}
