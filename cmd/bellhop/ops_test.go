package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// consumerRow parses `bellhop consumer ls` and returns the row of id by
// column name, or nil if id is not listed.
func consumerRow(t *testing.T, out, id string) map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	sep := regexp.MustCompile(`\s{2,}`)
	header := sep.Split(strings.TrimSpace(lines[0]), -1)
	want := []string{"ID", "APP", "QUEUE", "ENABLED", "URL", "VISIBILITY", "ATTEMPTS", "BACKOFF", "IN-FLIGHT", "LAST FIRED"}
	if !slices.Equal(header, want) {
		t.Fatalf("consumer ls header %q, want %q", header, want)
	}
	for _, l := range lines[1:] {
		f := sep.Split(strings.TrimSpace(l), -1)
		if len(f) != len(header) {
			t.Fatalf("consumer ls row %q has %d columns", l, len(f))
		}
		if f[0] == id {
			row := map[string]string{}
			for i, h := range header {
				row[h] = f[i]
			}
			return row
		}
	}
	return nil
}

// TestConsumerLifecycle: consumer add/ls/update/pause/resume/rm, against
// a running daemon where that is what matters.
func TestConsumerLifecycle(t *testing.T) {
	t.Parallel()
	dsn, h, id := setup(t, "--visibility-timeout", "20s", "--max-attempts", "6", "--backoff-min", "200ms", "--backoff-max", "3s", "--max-in-flight", "4")
	row := consumerRow(t, ok(t, dsn, "consumer", "ls", "--app", "shop"), id)
	want := map[string]string{"APP": "shop", "QUEUE": "orders", "ENABLED": "true", "URL": h.srv.URL + "/hook",
		"VISIBILITY": "20s", "ATTEMPTS": "6", "BACKOFF": "200ms..3s", "IN-FLIGHT": "4", "LAST FIRED": "-"}
	for k, v := range want {
		if row[k] != v {
			t.Errorf("consumer ls %s = %q, want %q", k, row[k], v)
		}
	}
	// A second consumer for the same queue is refused (exit 1: a conflict).
	if r := exe(t, dsn, "", "consumer", "add", "--app", "shop", "--queue", "orders", "--url", h.srv.URL); r.code != 1 || !strings.Contains(r.stderr, "already has a consumer") {
		t.Errorf("second consumer of a queue: %s", r)
	}
	// Listing never shows the secret.
	if out := ok(t, dsn, "consumer", "ls"); strings.Contains(out, h.secret) {
		t.Error("consumer ls shows the signing secret")
	}

	// A probe queue with its own consumer shows that the daemon is
	// delivering while the paused queue gets nothing.
	probe := newHook(t)
	_, probeSecret := addConsumer(t, dsn, "--app", "shop", "--queue", "probe", "--url", probe.srv.URL)
	probe.setSecret(probeSecret)

	if out := ok(t, dsn, "consumer", "pause", "--app", "shop", id); out != "" {
		t.Errorf("pause printed %q", out)
	}
	if row := consumerRow(t, ok(t, dsn, "consumer", "ls"), id); row["ENABLED"] != "false" {
		t.Errorf("paused consumer listed as enabled %q", row["ENABLED"])
	}
	paused := enqueue(t, dsn, "shop", "orders", `{"while":"paused"}`)
	if row := queueRow(t, ok(t, dsn, "queues", "--app", "shop"), "shop", "orders"); row["CONSUMER"] != id+" (paused)" || row["READY"] != "1" {
		t.Errorf("queues row of the paused queue: %v", row)
	}

	d := startDaemon(t, dsn)
	enqueue(t, dsn, "shop", "probe", `{"probe":1}`)
	probe.waitCount(t, 1, 20*time.Second)
	if n := len(h.deliveries()); n != 0 {
		t.Fatalf("a paused consumer got %d deliveries", n)
	}

	// Update while running: the new URL and settings are used.
	moved := newHook(t)
	moved.setSecret(h.secret)
	if out := ok(t, dsn, "consumer", "update", "--app", "shop", "--url", moved.srv.URL+"/v2", "--max-attempts", "9", "--visibility-timeout", "30s", id); out != "consumer "+id+" updated\n" {
		t.Errorf("update printed %q", out)
	}
	row = consumerRow(t, ok(t, dsn, "consumer", "ls"), id)
	if row["URL"] != moved.srv.URL+"/v2" || row["ATTEMPTS"] != "9" || row["VISIBILITY"] != "30s" || row["BACKOFF"] != "200ms..3s" || row["IN-FLIGHT"] != "4" {
		t.Errorf("after update: %v", row)
	}

	if out := ok(t, dsn, "consumer", "resume", "--app", "shop", id); out != "" {
		t.Errorf("resume printed %q", out)
	}
	got := moved.waitCount(t, 1, 20*time.Second)
	if got[0].id() != paused || got[0].verify != nil {
		t.Errorf("after resume the new URL got %s (verify %v), want %s", got[0].id(), got[0].verify, paused)
	}
	if n := len(h.deliveries()); n != 0 {
		t.Errorf("the old URL got %d deliveries after the update", n)
	}
	pool := db(t, dsn)
	waitFor(t, 10*time.Second, "the paused message acked", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE queue_name = 'orders'") == 0
	})
	// The enqueue happened before the update, so its attempts are fixed.
	if got[0].header.Get(bellhop.HeaderMaxAttempts) != "6" {
		t.Errorf("%s = %q, want 6 (set at enqueue)", bellhop.HeaderMaxAttempts, got[0].header.Get(bellhop.HeaderMaxAttempts))
	}
	next := enqueue(t, dsn, "shop", "orders", `{"after":"update"}`)
	got = moved.waitCount(t, 2, 20*time.Second)
	if got[1].id() != next || got[1].header.Get(bellhop.HeaderMaxAttempts) != "9" {
		t.Errorf("after update: delivery %s with max attempts %q, want %s with 9", got[1].id(), got[1].header.Get(bellhop.HeaderMaxAttempts), next)
	}
	waitFor(t, 10*time.Second, "last fired to be recorded", func() bool {
		return consumerRow(t, ok(t, dsn, "consumer", "ls"), id)["LAST FIRED"] != "-"
	})

	// Remove: gone from the list; the queue's messages stay.
	if out := ok(t, dsn, "consumer", "rm", "--app", "shop", id); out != "" {
		t.Errorf("rm printed %q", out)
	}
	if consumerRow(t, ok(t, dsn, "consumer", "ls"), id) != nil {
		t.Error("removed consumer still listed")
	}
	kept := enqueue(t, dsn, "shop", "orders", `{"after":"rm"}`)
	enqueue(t, dsn, "shop", "probe", `{"probe":2}`)
	probe.waitCount(t, 2, 20*time.Second)
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL", kept); n != 1 {
		t.Errorf("message of a queue without consumer: %d unclaimed rows, want 1", n)
	}
	if row := queueRow(t, ok(t, dsn, "queues"), "shop", "orders"); row["CONSUMER"] != "-" || row["READY"] != "1" {
		t.Errorf("queues row after rm: %v", row)
	}
	if r := exe(t, dsn, "", "consumer", "rm", "--app", "shop", id); r.code != 2 || !strings.Contains(r.stderr, "unknown consumer") {
		t.Errorf("second rm: %s", r)
	}
	_ = d
}

// TestQueuesOutput: the queue list counts ready, delayed, in-flight and
// dead messages per queue, with the oldest ready age and the consumer.
func TestQueuesOutput(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	ok(t, dsn, "app", "create", "other")
	cid, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	pool := db(t, dsn)
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(context.Background(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	for range 3 {
		enqueue(t, dsn, "shop", "orders", `{}`)
	}
	enqueue(t, dsn, "shop", "orders", `{}`, "--delay", "1h")
	enqueue(t, dsn, "shop", "orders", `{}`, "--at", time.Now().Add(48*time.Hour).UTC().Format(time.RFC3339))
	enqueue(t, dsn, "other", "emails", `{}`)
	// One ready message is ten minutes old; one is leased; one is dead.
	exec(`UPDATE queue_messages SET enqueued_at = now() - interval '10 minutes'
	      WHERE id = (SELECT id FROM queue_messages WHERE queue_name = 'orders' AND deliver_after IS NULL ORDER BY id LIMIT 1)`)
	exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1
	      WHERE id = (SELECT id FROM queue_messages WHERE queue_name = 'orders' AND deliver_after IS NULL ORDER BY id DESC LIMIT 1)`)
	exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
	      SELECT gen_random_uuid(), 'queue', id, 'orders', '{}', now(), 5, 5, 'x' FROM apps WHERE name = 'shop'`)

	out := ok(t, dsn, "queues")
	row := queueRow(t, out, "shop", "orders")
	for k, v := range map[string]string{"READY": "2", "DELAYED": "2", "IN FLIGHT": "1", "DEAD": "1", "CONSUMER": cid} {
		if row[k] != v {
			t.Errorf("shop/orders %s = %q, want %q", k, row[k], v)
		}
	}
	if age, err := time.ParseDuration(row["OLDEST READY"]); err != nil || age < 10*time.Minute || age > 11*time.Minute {
		t.Errorf("shop/orders OLDEST READY = %q, want about 10m", row["OLDEST READY"])
	}
	other := queueRow(t, out, "other", "emails")
	if other["READY"] != "1" || other["CONSUMER"] != "-" {
		t.Errorf("other/emails: %v", other)
	}
	// --app filters.
	if out := ok(t, dsn, "queues", "--app", "other"); strings.Contains(out, "shop") || !strings.Contains(out, "emails") {
		t.Errorf("queues --app other:\n%s", out)
	}
	// BELLHOP_APP filters too.
	if r := exeEnv(t, []string{"DATABASE_URL=" + dsn, "BELLHOP_APP=shop"}, "", "queues"); r.code != 0 || strings.Contains(r.stdout, "emails") {
		t.Errorf("BELLHOP_APP=shop queues: %s", r)
	}
}

// TestQueuesWatch: --watch redraws until interrupted, then exits 0.
func TestQueuesWatch(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	enqueue(t, dsn, "shop", "orders", `{}`)
	p := start(t, []string{"DATABASE_URL=" + dsn}, "queues", "--watch")
	header := regexp.MustCompile(`APP\s+QUEUE\s+READY`)
	p.waitLine(false, header, 20*time.Second)
	enqueue(t, dsn, "shop", "orders", `{}`)
	// A later frame shows the second message.
	p.waitLine(false, regexp.MustCompile(`^shop\s+orders\s+2\s`), 20*time.Second)
	if n := p.countLines(header); n < 2 {
		t.Errorf("%d frames drawn, want at least 2", n)
	}
	p.signal(os.Interrupt)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Errorf("queues --watch exited %d on SIGINT, want 0", code)
	}
	if s := p.stderr(); s != "" {
		t.Errorf("stderr: %s", s)
	}
}

// TestEnqueueStdin: `enqueue -` reads one JSON value per line, skips
// blank lines, inserts in batches, and on a bad line names it, having
// written the batches before it and nothing of its own batch.
func TestEnqueueStdin(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	lines := func(n int, bad int) string {
		var b strings.Builder
		for i := 1; i <= n; i++ {
			if i == bad {
				b.WriteString("{oops\n")
				continue
			}
			fmt.Fprintf(&b, `{"n":%d}`+"\n", i)
			if i%100 == 0 {
				b.WriteString("\n") // blank lines are skipped
			}
		}
		return b.String()
	}
	tests := []struct {
		name        string
		stdin       string
		flags       []string
		wantCode    int
		wantOut     string // stdout, exactly
		wantErr     string // in stderr
		wantRows    int
		wantDelayed bool
	}{
		{name: "one line", stdin: `{"a":1}`, wantOut: "enqueued 1 messages\n", wantRows: 1},
		{name: "empty input", stdin: "", wantOut: "enqueued 0 messages\n"},
		{name: "many batches", stdin: lines(1201, 0), wantOut: "enqueued 1201 messages\n", wantRows: 1201},
		{name: "delayed", stdin: "1\n2\n", flags: []string{"--delay", "1h"}, wantOut: "enqueued 2 messages\n", wantRows: 2, wantDelayed: true},
		// The bad line (1103rd input line with the blank ones) is in the
		// third batch: two batches of 500 are written.
		{name: "bad line", stdin: lines(1200, 1092), wantCode: 2, wantErr: "line 1102 is not a JSON value (1000 messages before its batch were written)", wantRows: 1000},
		{name: "bad first line", stdin: "nope\n{}\n", wantCode: 2, wantErr: "line 1 is not a JSON value (0 messages", wantRows: 0},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			queue := fmt.Sprintf("q%d", i)
			r := exe(t, dsn, tc.stdin, append(append([]string{"enqueue", "--app", "shop", "--queue", queue}, tc.flags...), "-")...)
			if r.code != tc.wantCode || (tc.wantOut != "" && r.stdout != tc.wantOut) || !strings.Contains(r.stderr, tc.wantErr) {
				t.Errorf("want exit %d, stdout %q, stderr with %q; got %s", tc.wantCode, tc.wantOut, tc.wantErr, r)
			}
			if tc.wantCode != 0 && strings.Count(strings.TrimRight(r.stderr, "\n"), "\n") != 0 {
				t.Errorf("stderr is not one line: %q", r.stderr)
			}
			if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE queue_name = $1", queue); n != tc.wantRows {
				t.Errorf("%d rows written, want %d", n, tc.wantRows)
			}
			if tc.wantDelayed {
				if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages WHERE queue_name = $1 AND deliver_after > now() + interval '50 minutes'", queue); n != tc.wantRows {
					t.Errorf("%d of %d rows delayed by --delay 1h", n, tc.wantRows)
				}
			}
		})
	}
	// Order is kept: payload n matches insertion order.
	if n := queryInt(t, pool, `SELECT count(*) FROM (SELECT (payload->>'n')::int AS n, row_number() OVER (ORDER BY enqueued_at, id) AS r
		FROM queue_messages WHERE queue_name = 'q2') x WHERE n <> r`); n != 0 {
		t.Errorf("%d messages out of order", n)
	}
}

// TestComposeFlow runs what docker-compose.yml runs, without Docker:
// migrate, setup-demo (twice: it must be re-runnable), run, the example
// consumer and a producer that INSERTs with plain SQL.
func TestComposeFlow(t *testing.T) {
	t.Parallel()
	dsn := emptyDatabase(t)
	secretFile := filepath.Join(t.TempDir(), "orders")
	ok(t, dsn, "migrate")
	// The consumer's address is needed for setup-demo, which the
	// consumer needs for its secret: start it first, as compose's
	// consumer reads the secret file on every request.
	consumer := start(t, nil, "example-consumer", "--addr", "127.0.0.1:0", "--secret-file", secretFile)
	addr := consumer.waitLine(false, regexp.MustCompile(`^example consumer listening on (\S+)$`), 20*time.Second)[1]
	setupArgs := []string{"setup-demo", "--app", "demo", "--queue", "orders", "--url", "http://" + addr + "/hook", "--secret-file", secretFile}
	var ids []string
	for range 2 {
		out := ok(t, dsn, setupArgs...)
		m := regexp.MustCompile(`^consumer (\S+) registered for demo/orders; secret written to `).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("setup-demo printed %q", out)
		}
		ids = append(ids, m[1])
	}
	if ids[0] == ids[1] {
		t.Error("the second setup-demo did not re-register the consumer")
	}
	fi, err := os.Stat(secretFile)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Size() != 64 {
		t.Errorf("secret file: %v, mode %v, %d bytes; want 0600 and 64 bytes", err, fi.Mode().Perm(), fi.Size())
	}
	if out := ok(t, dsn, "consumer", "ls"); strings.Count(strings.TrimSpace(out), "\n") != 1 || !strings.Contains(out, ids[1]) {
		t.Errorf("want exactly the second consumer:\n%s", out)
	}

	startDaemon(t, dsn)
	pool := db(t, dsn)
	for range 3 {
		if _, err := pool.Exec(context.Background(), `INSERT INTO queue_messages (app_id, queue_name, payload)
			SELECT id, 'orders', jsonb_build_object('sent_at', now()) FROM apps WHERE name = 'demo'`); err != nil {
			t.Fatal(err)
		}
	}
	delivered := regexp.MustCompile(`demo/orders message \S+ attempt 1: \d+ bytes$`)
	waitFor(t, 20*time.Second, "3 deliveries at the example consumer", func() bool { return consumer.countLines(delivered) >= 3 })
	if strings.Contains(consumer.stdout(), "rejected") {
		t.Errorf("the example consumer rejected a request:\n%s", consumer.stdout())
	}
	waitFor(t, 10*time.Second, "the queue to drain", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM queue_messages") == 0
	})
	consumer.signal(os.Interrupt)
	if code := consumer.wait(10 * time.Second); code != 0 {
		t.Errorf("example-consumer exited %d on SIGINT", code)
	}
}
