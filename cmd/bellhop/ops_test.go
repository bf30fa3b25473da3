package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// consumerRow parses `bellhop consumer ls` and returns the row of id by
// column name, or nil if id is not listed.
func consumerRow(t *testing.T, out, id string) map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	sep := regexp.MustCompile(`\s{2,}`)
	header := sep.Split(strings.TrimSpace(lines[0]), -1)
	want := []string{"ID", "APP", "QUEUE", "ENABLED", "URL", "TIMEOUT", "VISIBILITY", "ATTEMPTS", "BACKOFF", "IN-FLIGHT", "LAST FIRED"}
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
	want := map[string]string{"APP": "shop", "QUEUE": "orders", "ENABLED": "true", "URL": h.srv.URL + "/hook", "TIMEOUT": "default",
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

	if out := ok(t, dsn, "consumer", "pause", "--app", "shop", id); out != "consumer "+id+" paused\n" {
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
	if out := ok(t, dsn, "consumer", "update", "--app", "shop", "--url", moved.srv.URL+"/v2", "--max-attempts", "9", "--visibility-timeout", "30s", "--timeout", "3s", id); out != "consumer "+id+" updated\n" {
		t.Errorf("update printed %q", out)
	}
	row = consumerRow(t, ok(t, dsn, "consumer", "ls"), id)
	if row["URL"] != moved.srv.URL+"/v2" || row["TIMEOUT"] != "3s" || row["ATTEMPTS"] != "9" || row["VISIBILITY"] != "30s" || row["BACKOFF"] != "200ms..3s" || row["IN-FLIGHT"] != "4" {
		t.Errorf("after update: %v", row)
	}

	if out := ok(t, dsn, "consumer", "resume", "--app", "shop", id); out != "consumer "+id+" resumed\n" {
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
	if out := ok(t, dsn, "consumer", "rm", "--app", "shop", id); out != "consumer "+id+" removed\n" {
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

// TestPrincipalList: principal ls lists each app's principals, the
// default one and those added since, by app and name, with their ids, for
// one app (--app or BELLHOP_APP) or every app, and refuses an unknown app
// as the other listings do.
func TestPrincipalList(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	defaultID := map[string]string{}
	for _, app := range []string{"shop", "other"} {
		m := regexp.MustCompile(`default principal: id (\S+)`).FindStringSubmatch(ok(t, dsn, "app", "create", app))
		if m == nil {
			t.Fatalf("app create %s printed no default principal", app)
		}
		defaultID[app] = m[1]
	}
	billing, err := bellhop.NewClient(db(t, dsn)).CreatePrincipal(t.Context(), "shop", "billing")
	if err != nil {
		t.Fatal(err)
	}
	otherDefault := []string{"other", "default", defaultID["other"]}
	shopBilling := []string{"shop", "billing", billing.String()}
	shopDefault := []string{"shop", "default", defaultID["shop"]}
	tests := []struct {
		name string
		env  []string
		args []string
		want [][]string // APP, NAME, ID of each row, in order
	}{
		{"every app", nil, nil, [][]string{otherDefault, shopBilling, shopDefault}},
		{"--app", nil, []string{"--app", "shop"}, [][]string{shopBilling, shopDefault}},
		{"BELLHOP_APP", []string{"BELLHOP_APP=other"}, nil, [][]string{otherDefault}},
		{"--app over BELLHOP_APP", []string{"BELLHOP_APP=other"}, []string{"--app", "shop"}, [][]string{shopBilling, shopDefault}},
	}
	sep := regexp.MustCompile(`\s{2,}`)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), "", append([]string{"principal", "ls"}, tc.args...)...)
			if r.code != 0 {
				t.Fatalf("principal ls %s: %s", strings.Join(tc.args, " "), r)
			}
			lines := strings.Split(strings.TrimRight(r.stdout, "\n"), "\n")
			if h := sep.Split(lines[0], -1); !slices.Equal(h, []string{"APP", "NAME", "ID", "CREATED"}) {
				t.Fatalf("header %q", h)
			}
			if len(lines)-1 != len(tc.want) {
				t.Fatalf("%d rows, want %d:\n%s", len(lines)-1, len(tc.want), r.stdout)
			}
			for i, l := range lines[1:] {
				f := sep.Split(l, -1)
				if len(f) != 4 || !slices.Equal(f[:3], tc.want[i]) {
					t.Errorf("row %d %q, want %q and a time", i+1, f, tc.want[i])
					continue
				}
				if at, err := time.Parse(time.RFC3339, f[3]); err != nil || time.Since(at) > time.Hour || time.Until(at) > time.Hour {
					t.Errorf("row %d CREATED %q, want about now (RFC 3339)", i+1, f[3])
				}
			}
		})
	}
	for _, env := range [][]string{nil, {"BELLHOP_APP=nope"}} {
		args := []string{"principal", "ls", "--app", "nope"}
		want := `bellhop: list principals: unknown app "nope"` + "\n"
		if env != nil {
			args = args[:2]
			want = `bellhop: list principals: unknown app "nope" (from BELLHOP_APP)` + "\n"
		}
		if r := exeEnv(t, append([]string{"DATABASE_URL=" + dsn}, env...), "", args...); r.code != 2 || r.stderr != want || r.stdout != "" {
			t.Errorf("%q bellhop %s: %s\nwant exit 2 and %q", env, strings.Join(args, " "), r, want)
		}
	}
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
	// Queues with no ready message: only a delayed one, only a leased
	// one, only a dead letter.
	enqueue(t, dsn, "other", "later", `{}`, "--delay", "1h")
	enqueue(t, dsn, "other", "leased", `{}`)
	exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1 WHERE queue_name = 'leased'`)
	exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
	      SELECT gen_random_uuid(), 'queue', id, 'graveyard', '{}', now(), 5, 5, 'x' FROM apps WHERE name = 'other'`)

	out := ok(t, dsn, "queues")
	// No ready message has no age: "-", as CONSUMER shows none, where
	// "0s" read as a message ready this instant.
	for _, q := range []string{"later", "leased", "graveyard"} {
		if row := queueRow(t, out, "other", q); row["READY"] != "0" || row["OLDEST READY"] != "-" {
			t.Errorf("other/%s READY %q, OLDEST READY %q; want 0 and -", q, row["READY"], row["OLDEST READY"])
		}
	}
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

// TestQueuesWatch: --watch redraws until interrupted, then exits 0, also
// when its terminal is closed (SIGHUP), which used to kill it.
func TestQueuesWatch(t *testing.T) {
	t.Parallel()
	for _, sig := range []os.Signal{os.Interrupt, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) {
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
			p.signal(sig)
			if code := p.wait(10 * time.Second); code != 0 {
				t.Errorf("queues --watch exited %d on %s, want 0", code, sig)
			}
			if s := p.stderr(); s != "" {
				t.Errorf("stderr: %s", s)
			}
		})
	}
}

// TestEnqueueStdin: `enqueue -` reads one JSON value per line, skips
// blank lines and inserts in batches, all or nothing: on a bad line, a
// line too long to read or any other failure, wherever it is in the
// stream, it names the problem and writes nothing, so that a re-run does
// not duplicate messages.
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
		{name: "one line", stdin: `{"a":1}`, wantOut: "enqueued 1 message\n", wantRows: 1},
		{name: "empty --at", stdin: `{"a":1}`, flags: []string{"--at", ""}, wantCode: 2, wantErr: `--at "" is not an RFC 3339 time`},
		{name: "empty input", stdin: "", wantOut: "enqueued 0 messages\n"},
		{name: "many batches", stdin: lines(1201, 0), wantOut: "enqueued 1201 messages\n", wantRows: 1201},
		{name: "delayed", stdin: "1\n2\n", flags: []string{"--delay", "1h"}, wantOut: "enqueued 2 messages\n", wantRows: 2, wantDelayed: true},
		// The bad line (1102nd input line with the blank ones) is in the
		// third batch: the two batches before it are not kept.
		{name: "bad line", stdin: lines(1200, 1092), wantCode: 2, wantErr: "line 1102: invalid payload: not JSON: invalid character 'o' looking for beginning of object key string; nothing was enqueued"},
		{name: "bad first line", stdin: "nope\n{}\n", wantCode: 2, wantErr: "line 1: invalid payload: not JSON"},
		{name: "white space around a line", stdin: " \t{}\t \r\n", wantOut: "enqueued 1 message\n", wantRows: 1},
		// Only JSON's white space is trimmed, as Enqueue takes: a line
		// wrapped in no-break spaces is not JSON.
		{name: "no-break spaces around a line", stdin: "\u00a0{}\u00a0\n", wantCode: 2, wantErr: "line 1: invalid payload: not JSON"},
		{name: "byte-order mark", stdin: "\ufeff{}\n", wantCode: 2, wantErr: "line 1: invalid payload: not JSON: it starts with a byte-order mark"},
		{name: "bad last line", stdin: lines(600, 0) + "[1,\n", wantCode: 2, wantErr: "line 607: invalid payload: not JSON"},
		{name: "payload too large", stdin: lines(600, 0) + `"` + strings.Repeat("x", validate.MaxPayloadBytes) + `"` + "\n", wantCode: 2,
			wantErr: "line 607: payload too large: 1048578 bytes, more than the 1048576-byte limit; nothing was enqueued"},
		{name: "line too long", stdin: lines(600, 0) + `"` + strings.Repeat("x", maxLine) + `"` + "\n{}\n", wantCode: 2,
			wantErr: "line 607 is longer than the 2097152-byte limit of a line (a payload is at most 1048576 bytes); nothing was enqueued"},
		// The database measures the size as jsonb text, with a space
		// after each ',' and ':'; it refuses the batch, and the error
		// names the line.
		{name: "over 1 MiB as jsonb text", stdin: lines(600, 0) + "[" + strings.Repeat(`{"a":1},`, 131070) + `{"a":1}]` + "\n", wantCode: 2,
			wantErr: "line 607: enqueue to app shop: message 101 of 101"},
		{name: "lone surrogate", stdin: lines(600, 0) + `"\ud800"` + "\n", wantCode: 2, wantErr: `line 607: invalid payload: it contains \ud800`},
		{name: "payload nested too deep", stdin: lines(600, 0) + strings.Repeat("[", 200) + strings.Repeat("]", 200) + "\n", wantCode: 2, wantErr: "line 607: invalid payload: nested 200 deep"},
		{name: "bad --max-attempts", stdin: lines(600, 0), flags: []string{"--max-attempts", "1001"}, wantCode: 2, wantErr: "--max-attempts 1001: must be 1 to 1000"},
		{name: "--at too far ahead", stdin: lines(600, 0), flags: []string{"--at", "2999-01-01T00:00:00Z"}, wantCode: 2, wantErr: "invalid option: --at 2999-01-01T00:00:00Z is more than"},
		// The app is checked by the database before the first line, also
		// when there is none.
		{name: "unknown app", stdin: lines(600, 0), flags: []string{"--app", "nope"}, wantCode: 2,
			wantErr: `bellhop: enqueue to app nope: unknown app "nope"; nothing was enqueued`},
		{name: "unknown app, empty input", stdin: "", flags: []string{"--app", "nope"}, wantCode: 2,
			wantErr: `bellhop: enqueue to app nope: unknown app "nope"; nothing was enqueued`},
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

// TestExampleConsumerSecretFile: the example consumer answers 503 (which
// Bellhop retries) while its secret file is missing or holds no secret,
// and verifies with the secret once it is there. An empty file, as while
// the file is being written, got 401, which dead-letters the message. So
// did a request signed with another secret, as a running daemon's are
// between setup-demo's registration of a consumer and its writing of the
// new secret, and one with a timestamp out of the window: both get 503
// now. Only an unsigned request, which is not Bellhop's, gets 401.
func TestExampleConsumerSecretFile(t *testing.T) {
	t.Parallel()
	secretFile := filepath.Join(t.TempDir(), "orders")
	consumer := start(t, nil, "example-consumer", "--addr", "127.0.0.1:0", "--secret-file", secretFile)
	addr := consumer.waitLine(false, regexp.MustCompile(`^example consumer listening on (\S+)$`), 20*time.Second)[1]
	// push sends a request signed with "the-secret" at a timestamp age
	// ago, or an unsigned one.
	push := func(unsigned bool, age time.Duration) int {
		t.Helper()
		body := []byte(`{}`)
		req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/hook", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if !unsigned {
			ts := time.Now().Add(-age).Unix()
			req.Header.Set(bellhop.HeaderTimestamp, strconv.FormatInt(ts, 10))
			req.Header.Set(bellhop.HeaderSignature, bellhop.SignPush("the-secret", ts, body))
			// Not signed, so a replay may set it to anything HTTP allows:
			// a right-to-left override and a C1 control (CSI, which
			// starts an escape sequence on some terminals).
			req.Header.Set(bellhop.HeaderQueue, "orders\u202e\u009b")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	ptr := func(s string) *string { return &s }
	for _, tt := range []struct {
		name     string
		content  *string // nil: no file
		unsigned bool
		age      time.Duration // of the request's timestamp
		want     int
	}{
		{name: "missing", want: http.StatusServiceUnavailable},
		{name: "empty", content: ptr(""), want: http.StatusServiceUnavailable},
		{name: "blank", content: ptr(" \n"), want: http.StatusServiceUnavailable},
		{name: "another secret", content: ptr("not-the-secret\n"), want: http.StatusServiceUnavailable},
		{name: "the secret, stale timestamp", content: ptr("the-secret\n"), age: 10 * time.Minute, want: http.StatusServiceUnavailable},
		{name: "the secret, unsigned request", content: ptr("the-secret\n"), unsigned: true, want: http.StatusUnauthorized},
		{name: "the secret", content: ptr("the-secret\n"), want: http.StatusNoContent},
	} {
		if tt.content != nil {
			if err := os.WriteFile(secretFile, []byte(*tt.content), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if got := push(tt.unsigned, tt.age); got != tt.want {
			t.Errorf("secret file %s: HTTP %d, want %d", tt.name, got, tt.want)
		}
	}
	// Whoever watches the consumer answer 503s is told why, once per
	// reason: "empty" and "blank" share theirs. The delivery's line comes
	// after them on the same pipe, so once it is read, they all are.
	delivered := consumer.waitLine(false, regexp.MustCompile(`^.* message .* attempt .*: 2 bytes$`), 20*time.Second)[0]
	if !printable.Is(delivered) || !strings.Contains(delivered, "/orders?? message") {
		t.Errorf("the delivery's line is %q; want the queue header's unprintable runes as ?", delivered)
	}
	consumer.mu.Lock()
	var why []string
	for _, l := range consumer.out {
		if m := regexp.MustCompile(`^no signing secret yet \((.*)\): answering 503 until there is one$`).FindStringSubmatch(l); m != nil {
			why = append(why, m[1])
		}
	}
	consumer.mu.Unlock()
	if len(why) != 2 || !strings.Contains(why[0], "no such file or directory") || why[1] != "it is empty" {
		t.Errorf("lines about the missing secret give %q; want the missing file's error, then \"it is empty\"", why)
	}
}

// TestExampleConsumerStopsGracefully: SIGTERM while a request is in
// flight lets it finish and be acked before the process exits. It used
// to exit as soon as the server began shutting down, under the request,
// whose message Bellhop would then push again.
func TestExampleConsumerStopsGracefully(t *testing.T) {
	t.Parallel()
	secretFile := filepath.Join(t.TempDir(), "orders")
	if err := os.WriteFile(secretFile, []byte("the-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	consumer := start(t, nil, "example-consumer", "--addr", "127.0.0.1:0", "--secret-file", secretFile)
	addr := consumer.waitLine(false, regexp.MustCompile(`^example consumer listening on (\S+)$`), 20*time.Second)[1]

	// Expect: 100-continue makes the server say when the handler begins
	// to read the body, so the signal is known to come mid-request. The
	// body is held back until the consumer has begun to stop.
	body := []byte(`{"n":1}`)
	pr, pw := io.Pipe()
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/hook", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = int64(len(body))
	ts := time.Now().Unix()
	req.Header.Set("Expect", "100-continue")
	req.Header.Set(bellhop.HeaderTimestamp, strconv.FormatInt(ts, 10))
	req.Header.Set(bellhop.HeaderSignature, bellhop.SignPush("the-secret", ts, body))
	reading := make(chan struct{})
	req = req.WithContext(httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got100Continue: func() { close(reading) },
	}))
	client := &http.Client{Transport: &http.Transport{ExpectContinueTimeout: time.Minute}}
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := client.Do(req)
		if err != nil {
			done <- result{err: err}
			return
		}
		resp.Body.Close()
		done <- result{code: resp.StatusCode}
	}()
	select {
	case <-reading:
	case r := <-done:
		t.Fatalf("request ended before its body was sent: %+v", r)
	case <-time.After(20 * time.Second):
		t.Fatal("the handler did not begin to read the body")
	}
	consumer.signal(syscall.SIGTERM)
	consumer.waitLine(false, regexp.MustCompile(`^example consumer stopping: finishing the requests in flight`), 20*time.Second)
	if _, err := pw.Write(body); err != nil {
		t.Fatalf("send the body after SIGTERM: %v", err)
	}
	pw.Close()
	select {
	case r := <-done:
		if r.err != nil || r.code != http.StatusNoContent {
			t.Errorf("request in flight at SIGTERM: HTTP %d, error %v; want 204", r.code, r.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no answer to the request in flight")
	}
	if code := consumer.wait(15 * time.Second); code != 0 {
		t.Errorf("exit %d after SIGTERM, want 0; stderr %q", code, consumer.stderr())
	}
}

// TestComposeFlow runs what docker-compose.yml runs, without Docker:
// migrate, setup-demo (twice: it must be re-runnable, keeping the consumer
// and its secret), run, the example consumer and a producer that INSERTs
// with plain SQL.
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
	for _, re := range []string{
		`^consumer (\S+) registered for demo/orders; secret written to `,
		`^consumer (\S+) of demo/orders is registered already; kept it and its secret in `,
	} {
		out := ok(t, dsn, setupArgs...)
		m := regexp.MustCompile(re).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("setup-demo printed %q, want a match for %q", out, re)
		}
		ids = append(ids, m[1])
	}
	if ids[0] != ids[1] {
		t.Error("the second setup-demo replaced the consumer")
	}
	fi, err := os.Stat(secretFile)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Size() != 64 {
		t.Errorf("secret file: %v, mode %v, %d bytes; want 0600 and 64 bytes", err, fi.Mode().Perm(), fi.Size())
	}
	if out := ok(t, dsn, "consumer", "ls"); strings.Count(strings.TrimSpace(out), "\n") != 1 || !strings.Contains(out, ids[0]) {
		t.Errorf("want exactly the first consumer:\n%s", out)
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

// TestSetupDemo: setup-demo checks its input before it changes anything,
// keeps a consumer whose secret the file holds, registers the consumer
// again otherwise, and always leaves the file holding the secret of the
// queue's consumer, replaced whole, mode 0600.
func TestSetupDemo(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	dir := t.TempDir()
	secretFile := filepath.Join(dir, "orders")
	notADir := filepath.Join(dir, "plain")
	if err := os.WriteFile(notADir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	const url = "http://127.0.0.1:9/hook"
	// state is what the test knows of the queue's consumer.
	type state struct{ id, secret string }
	read := func() state {
		t.Helper()
		var s state
		err := pool.QueryRow(t.Context(), `SELECT id::text, push_secret FROM queue_consumers WHERE app_name = 'demo' AND queue_name = 'orders'`).Scan(&s.id, &s.secret)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return s
	}
	tests := []struct {
		name    string
		url     string // default: url
		file    string // default: secretFile
		before  func() // changes made before the run
		code    int
		want    string // in stdout (exit 0) or stderr
		replace bool   // a new consumer is registered (exit 0 only)
	}{
		{name: "URL without a host, before the app exists", url: "http://:9/hook", code: 2, want: `--url: invalid option: URL "http://:9/hook" has no host`},
		{name: "first run", code: 0, want: "registered for demo/orders; secret written to " + secretFile, replace: true},
		{name: "re-run keeps the consumer and secret", code: 0, want: "is registered already; kept it and its secret in " + secretFile},
		{name: "bad URL leaves the consumer", url: "ftp://127.0.0.1/hook", code: 2, want: "scheme must be http or https"},
		{name: "missing directory leaves the consumer", file: filepath.Join(dir, "missing", "orders"), code: 2, want: "cannot write in its directory"},
		{name: "file under a file leaves the consumer", file: filepath.Join(notADir, "orders"), code: 2, want: "cannot write in its directory"},
		{name: "directory leaves the consumer", file: dir, code: 2, want: "is a directory"},
		{name: "re-run after the failures keeps the consumer", code: 0, want: "is registered already"},
		{name: "lost secret file", before: func() { os.Remove(secretFile) }, code: 0, want: "secret written to", replace: true},
		{name: "file with another secret", before: func() { os.WriteFile(secretFile, []byte(strings.Repeat("0", 64)), 0o644) }, code: 0, want: "secret written to", replace: true},
		{name: "new URL", url: "http://127.0.0.1:10/hook", code: 0, want: "secret written to", replace: true},
		{name: "re-run with the new URL keeps it", url: "http://127.0.0.1:10/hook", code: 0, want: "is registered already"},
	}
	var prev state
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			u, file := tc.url, tc.file
			if u == "" {
				u = url
			}
			if file == "" {
				file = secretFile
			}
			if tc.before != nil {
				tc.before()
			}
			r := exe(t, dsn, "", "setup-demo", "--app", "demo", "--queue", "orders", "--url", u, "--secret-file", file)
			out := r.stdout
			if tc.code != 0 {
				out = r.stderr
			}
			if r.code != tc.code || !strings.Contains(out, tc.want) {
				t.Fatalf("want exit %d and %q; got %s", tc.code, tc.want, r)
			}
			if strings.Contains(r.stdout+r.stderr, prev.secret) && prev.secret != "" {
				t.Error("setup-demo printed the signing secret")
			}
			now := read()
			switch {
			case tc.code != 0 && prev.id == "" && (now.id != "" || queryInt(t, pool, "SELECT count(*) FROM apps") != 0):
				t.Errorf("a failed first run created the app or registered consumer %q", now.id)
			case tc.code != 0 && now != prev:
				t.Errorf("a failed run changed the consumer: %+v -> %+v", prev, now)
			case tc.code == 0 && tc.replace && (now.id == prev.id || now.secret == prev.secret):
				t.Errorf("the consumer was not registered again: %+v -> %+v", prev, now)
			case tc.code == 0 && !tc.replace && now != prev:
				t.Errorf("the consumer was replaced: %+v -> %+v", prev, now)
			}
			if tc.code == 0 {
				b, err := os.ReadFile(secretFile)
				fi, serr := os.Stat(secretFile)
				if err != nil || serr != nil || string(b) != now.secret || fi.Mode().Perm() != 0o600 {
					t.Errorf("secret file: %v %v, mode %v; holds the consumer's secret: %t", err, serr, fi.Mode().Perm(), string(b) == now.secret)
				}
			}
			if tc.code == 0 && tc.replace {
				if got := queryInt(t, pool, "SELECT count(*) FROM queue_consumers WHERE app_name = 'demo' AND push_url = $1", u); got != 1 {
					t.Errorf("%d consumers at %s, want 1", got, u)
				}
				// A consumer replaced is named: it may have been paused
				// or tuned (the CLI review).
				said := strings.Contains(r.stdout, "replaced consumer "+prev.id+" of demo/orders")
				if prev.id != "" && !said || prev.id == "" && strings.Contains(r.stdout, "replaced consumer") {
					t.Errorf("replacing consumer %q: stdout %q", prev.id, r.stdout)
				}
			}
			prev = now
		})
	}
	// No temporary file is left behind, whatever failed.
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() != "orders" && e.Name() != "plain" {
			t.Errorf("%s left in the secret file's directory", e.Name())
		}
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM apps WHERE name = 'demo'"); n != 1 {
		t.Errorf("%d demo apps", n)
	}
}

// TestSetupDemoReplaceOutlivesStop: once setup-demo has begun to replace
// the queue's consumer, a stop does not cut it short: the old consumer is
// removed, the new one registered and its secret written. A stop between
// the removal and the registration left the queue with no consumer.
func TestSetupDemoReplaceOutlivesStop(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	oldID, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	old, err := uuid.Parse(oldID)
	if err != nil {
		t.Fatal(err)
	}
	c := bellhop.NewClient(db(t, dsn))
	path := filepath.Join(t.TempDir(), "orders")
	secret, err := newSecretFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer secret.discard()
	// The stop came as the replacement began.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	const url = "http://127.0.0.1:10/hook"
	con, err := replaceConsumer(ctx, c, old, bellhop.ConsumerSpec{App: "shop", Queue: "orders", URL: url}, secret)
	if err != nil {
		t.Fatalf("replacing after the stop: %v", err)
	}
	now, err := c.ConsumerOf(t.Context(), "shop", "orders")
	if err != nil || now.ID != con.ID || now.ID == old || now.URL != url {
		t.Errorf("the queue's consumer after the replacement: %+v, %v; want %s at %s", now, err, con.ID, url)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != con.Secret {
		t.Errorf("the secret file does not hold the new consumer's secret: %v", err)
	}
}

// TestDeadRefusesNilID: the nil UUID names no dead letter; given as one,
// it used to select every dead letter of the queue or app.
func TestDeadRefusesNilID(t *testing.T) {
	t.Parallel()
	dsn, pool := shopWithDeadLetters(t, 3)
	const nilID = "00000000-0000-0000-0000-000000000000"
	for _, args := range [][]string{
		{"dead", "purge", "--app", "shop", nilID},
		{"dead", "purge", "--app", "shop", "--queue", "orders", nilID},
		{"dead", "redrive", "--app", "shop", nilID},
		{"dead", "redrive", "--app", "shop", "--queue", "orders", nilID},
		{"dead", "show", "--app", "shop", nilID},
	} {
		t.Run(strings.Join(args[:2], " ")+" "+strings.Join(args[2:len(args)-1], " "), func(t *testing.T) {
			r := exe(t, dsn, "", args...)
			if r.code != 2 || r.stdout != "" || !strings.Contains(r.stderr, "message id "+nilID+" is the nil UUID") {
				t.Errorf("want exit 2 naming the nil UUID; got %s", r)
			}
			if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 3 {
				t.Errorf("%d dead letters left, want 3", n)
			}
			if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 0 {
				t.Errorf("%d messages redriven, want 0", n)
			}
		})
	}
}

// TestDeadLimitAndBadQueue: dead ls lists at most --limit dead letters
// (100 by default), and a --queue that is no valid queue name is refused
// by ls, redrive and purge with exit 2 before any dead letter moves or
// goes; it used to select nothing and exit 0.
func TestDeadLimitAndBadQueue(t *testing.T) {
	t.Parallel()
	dsn, pool := shopWithDeadLetters(t, 101)
	limits := []struct {
		flags []string
		want  int // rows listed
	}{
		{nil, 100},
		{[]string{"--limit", "1"}, 1},
		{[]string{"--limit", "100"}, 100},
		{[]string{"--limit", "10000"}, 101},
	}
	for _, tc := range limits {
		t.Run("dead ls "+strings.Join(tc.flags, " "), func(t *testing.T) {
			out := ok(t, dsn, append([]string{"dead", "ls", "--app", "shop"}, tc.flags...)...)
			if got := strings.Count(out, "\n") - 1; got != tc.want || !strings.HasPrefix(out, "ID ") {
				t.Errorf("listed %d dead letters, want %d:\n%s", got, tc.want, out)
			}
		})
	}
	for _, queue := range []string{"bad q", "orders/x", strings.Repeat("a", 129)} {
		for _, verb := range []string{"ls", "redrive", "purge"} {
			t.Run(verb+" --queue "+queue[:min(len(queue), 10)], func(t *testing.T) {
				r := exe(t, dsn, "", "dead", verb, "--app", "shop", "--queue", queue)
				if r.code != 2 || r.stdout != "" || !strings.Contains(r.stderr, "invalid queue name") {
					t.Errorf("want exit 2 naming the invalid queue name; got %s", r)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 101 {
					t.Errorf("%d dead letters left, want 101", n)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 0 {
					t.Errorf("%d messages redriven, want 0", n)
				}
			})
		}
	}
}

// TestDeadRefusesIDWithQueue: redrive and purge take a MESSAGE_ID or
// --queue, not both; given both, they used to act on the id if it was of
// that queue and report no dead letter otherwise. An empty MESSAGE_ID (an
// unset shell variable, quoted) is a bad id, not none: read as none, it
// purged the whole queue. Nothing moves or goes.
func TestDeadRefusesIDWithQueue(t *testing.T) {
	t.Parallel()
	dsn, pool := shopWithDeadLetters(t, 3)
	var id string
	if err := pool.QueryRow(t.Context(), "SELECT id::text FROM dead_letters LIMIT 1").Scan(&id); err != nil {
		t.Fatal(err)
	}
	for _, verb := range []string{"redrive", "purge"} {
		for _, args := range [][]string{
			{"--queue", "orders", id},
			{id, "--queue", "orders"},
			{"--queue", "other", id},
			{"--queue", "orders", ""},
			{""},
		} {
			t.Run(verb+" "+strings.Join(args, " "), func(t *testing.T) {
				r := exe(t, dsn, "", append([]string{"dead", verb, "--app", "shop"}, args...)...)
				want := "bellhop: give a MESSAGE_ID or --queue, not both"
				if slices.Contains(args, "") {
					want = `bellhop: message id "" is not a UUID`
				}
				if r.code != 2 || r.stdout != "" || strings.TrimSpace(r.stderr) != want {
					t.Errorf("want exit 2 and %q; got %s", want, r)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 3 {
					t.Errorf("%d dead letters left, want 3", n)
				}
				if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 0 {
					t.Errorf("%d messages redriven, want 0", n)
				}
			})
		}
	}
	// Each alone still works.
	if out := ok(t, dsn, "dead", "redrive", "--app", "shop", id); out != "redrove 1 dead letter\n" {
		t.Errorf("redrive %s printed %q", id, out)
	}
	if out := ok(t, dsn, "dead", "purge", "--app", "shop", "--queue", "orders"); out != "purged 2 dead letters\n" {
		t.Errorf("purge --queue orders printed %q", out)
	}
}

// TestConsumerAddBackoffMinAboveDefaultCap: --backoff-min above the
// default cap raises the cap, as the library does, when --backoff-max is
// not given; the CLI refused it with the default 10m cap.
func TestConsumerAddBackoffMinAboveDefaultCap(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	ok(t, dsn, "consumer", "add", "--app", "shop", "--queue", "slow", "--url", "http://127.0.0.1:9/hook", "--backoff-min", "1h")
	pool := db(t, dsn)
	if n := queryInt(t, pool, `SELECT count(*) FROM queue_consumers WHERE queue_name = 'slow' AND backoff_base_ms = 3600000 AND backoff_cap_ms = 3600000`); n != 1 {
		t.Errorf("%d consumers with a 1h base and cap, want 1", n)
	}
}

// TestDeadLsReadsNoPayload: dead ls, whose table shows no payload, reads
// none: it runs as a role that may read every column of dead_letters but
// the payload, which dead show, which prints payloads, may not. It read
// every listed payload into memory (300 of 1 MB: 304 MB, and up to
// 10,000 of them with --limit).
func TestDeadLsReadsNoPayload(t *testing.T) {
	t.Parallel()
	dsn, pool := shopWithDeadLetters(t, 3)
	var id string
	if err := pool.QueryRow(t.Context(), "SELECT id::text FROM dead_letters LIMIT 1").Scan(&id); err != nil {
		t.Fatal(err)
	}
	role := "bellhop_nopayload_" + uuid.NewString()[:8]
	for _, sql := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT SELECT ON apps, principals TO " + role,
		`DO $$ BEGIN EXECUTE format('GRANT SELECT (%s) ON dead_letters TO ` + role + `',
			(SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns
			 WHERE table_schema = 'public' AND table_name = 'dead_letters' AND column_name <> 'payload')); END $$`,
	} {
		if _, err := pool.Exec(t.Context(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	t.Cleanup(func() { // before the pool closes: registered after it
		for _, sql := range []string{"DROP OWNED BY " + role, "DROP ROLE " + role} {
			if _, err := pool.Exec(context.Background(), sql); err != nil {
				t.Errorf("%s: %v", sql, err)
			}
		}
	})
	limited, err := pgdsn.WithUser(dsn, role)
	if err != nil {
		t.Fatal(err)
	}
	r := exe(t, limited, "", "dead", "ls", "--app", "shop")
	if r.code != 0 || strings.Count(r.stdout, "\n") != 4 || !strings.Contains(r.stdout, id) {
		t.Errorf("dead ls as a role that may not read payloads: want exit 0 and 3 dead letters listed; got %s", r)
	}
	// The role really may not read them.
	if r := exe(t, limited, "", "dead", "show", "--app", "shop", id); r.code != 1 || !strings.Contains(r.stderr, "permission denied") {
		t.Errorf("dead show as a role that may not read payloads: want exit 1, permission denied; got %s", r)
	}
}

// batchCounter is a pgx tracer that counts the statements of
// EnqueueManyTx: one per batch of `enqueue -`.
type batchCounter struct{ n atomic.Int64 }

func (b *batchCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if data.SQL == queries.Enqueue || data.SQL == queries.EnqueueOne {
		b.n.Add(1)
	}
	return ctx
}

func (b *batchCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestEnqueueStdinBatchesByBytes: `enqueue -` sends a batch once its
// payloads reach the byte cap, not only every 500 lines: 500 lines of
// 1 MB made one batch of 2.5 GB in memory and a 520 MB bind message. The
// stream is still one transaction: each message arrives once, in order,
// and a bad line, wherever its batch, writes nothing and is named by its
// line. The cap is small here, passed to enqueueStream.
func TestEnqueueStdinBatchesByBytes(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	check := db(t, dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var batches batchCounter
	cfg.ConnConfig.Tracer = &batches
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := bellhop.NewClient(pool)
	// payload n is 30 bytes: a cap of 100 bytes sends every 4th line.
	payload := func(n int) string {
		return fmt.Sprintf(`{"n":%d,"pad":"%s"}`, n, strings.Repeat("x", 30-len(fmt.Sprintf(`{"n":%d,"pad":""}`, n))))
	}
	limit := streamBatch{lines: 500, bytes: 100}
	// Over 1 MiB as jsonb text, which only the database finds: at
	// position 2 of the batch of lines 5 to 7.
	tooBig := "[" + strings.Repeat(`{"a":1},`, 131070) + `{"a":1}]`
	tests := []struct {
		name        string
		lines       []string
		wantErr     string // "": success
		wantBatches int64
	}{
		{name: "split by bytes", lines: []string{payload(1), payload(2), payload(3), payload(4), "", payload(5), payload(6), payload(7), payload(8), payload(9), payload(10)},
			wantBatches: 3},
		{name: "bad line after two batches", lines: []string{payload(1), payload(2), payload(3), payload(4), payload(5), payload(6), payload(7), payload(8), "{oops", payload(10)},
			wantErr: "line 9: invalid payload: not JSON", wantBatches: 2},
		{name: "database refuses a line within a batch", lines: []string{payload(1), payload(2), payload(3), payload(4), payload(5), payload(6), tooBig, payload(8)},
			wantErr: "line 7: enqueue to app shop: message 3 of 3", wantBatches: 2},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			queue := fmt.Sprintf("bytes%d", i)
			before := batches.n.Load()
			var out bytes.Buffer
			err := enqueueStream(t.Context(), c, pool, "shop", queue, bellhop.EnqueueOptions{}, limit,
				strings.NewReader(strings.Join(tc.lines, "\n")+"\n"), &out)
			if got := batches.n.Load() - before; got != tc.wantBatches {
				t.Errorf("%d batches sent, want %d", got, tc.wantBatches)
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.HasSuffix(err.Error(), "; nothing was enqueued") {
					t.Errorf("error %v, want one with %q, saying that nothing was enqueued", err, tc.wantErr)
				}
				if n := queryInt(t, check, "SELECT count(*) FROM queue_messages WHERE queue_name = $1", queue); n != 0 {
					t.Errorf("%d messages written, want none", n)
				}
				return
			}
			if err != nil || out.String() != "enqueued 10 messages\n" {
				t.Fatalf("enqueueStream: %v, printed %q", err, out.String())
			}
			// Each message once, in the order of the lines, as a claim
			// takes them: by enqueued_at, with no two alike. Batches
			// used to share their times position by position (migration
			// 0065).
			if n := queryInt(t, check, `SELECT count(*) FROM (SELECT (payload->>'n')::int AS n, row_number() OVER (ORDER BY enqueued_at) AS r
				FROM queue_messages WHERE queue_name = $1) x WHERE n = r`, queue); n != 10 {
				t.Errorf("%d of 10 messages arrived once in their place by enqueued_at", n)
			}
			if n := queryInt(t, check, "SELECT count(DISTINCT enqueued_at) FROM queue_messages WHERE queue_name = $1", queue); n != 10 {
				t.Errorf("%d distinct enqueued_at among 10 messages", n)
			}
			if n := queryInt(t, check, "SELECT count(*) FROM queue_messages WHERE queue_name = $1", queue); n != 10 {
				t.Errorf("%d messages written, want 10", n)
			}
		})
	}
}

// TestReadOnlyServerHinted: a write to a server that takes none (a hot
// standby; here default_transaction_read_only) fails with exit 1 and a
// hint at the cause, which PostgreSQL's "cannot execute ... in a
// read-only transaction" alone does not give (the CLI review).
func TestReadOnlyServerHinted(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	// Through the environment, which pgx reads whatever the form of the
	// connection string.
	p := start(t, []string{"DATABASE_URL=" + dsn, "PGOPTIONS=-c default_transaction_read_only=on"}, "app", "create", "shop")
	if code := p.wait(30 * time.Second); code != 1 || !strings.Contains(p.stderr(), "SQLSTATE 25006") ||
		!strings.Contains(p.stderr(), "the server is read-only") {
		t.Fatalf("app create on a read-only server: want exit 1 and the hint; got exit %d:\n%s", code, p.stderr())
	}
}

// TestDeadListSaysItWasCut: a dead ls that stops at its limit says so on
// stderr (a script counting its lines took 100 for all there were, found
// by the CLI review), with the --after that lists the next; one that
// lists them all says nothing.
func TestDeadListSaysItWasCut(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	if _, err := pool.Exec(t.Context(), `INSERT INTO dead_letters (id, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, source)
		SELECT gen_random_uuid(), a.id, 'orders', '{}', now(), 3, 3, 'boom', 'queue' FROM apps a, generate_series(1, 3)`); err != nil {
		t.Fatal(err)
	}
	noteRE := regexp.MustCompile(`^bellhop: showing 2 dead letters; there may be more: --after (\S+) lists the next`)
	r := exe(t, dsn, "", "dead", "ls", "--app", "shop", "--limit", "2")
	m := noteRE.FindStringSubmatch(r.stderr)
	if r.code != 0 || m == nil || strings.Count(r.stdout, "\n") != 3 {
		t.Fatalf("dead ls --limit 2 of 3: want exit 0, a header and 2 rows, and the note; got %s", r)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	last := strings.Fields(lines[2])[0]
	if m[1] != last+":queue" {
		t.Errorf("the note says --after %s, want the last listed, %s:queue", m[1], last)
	}
	for _, after := range []string{m[1], last} { // ID:SOURCE, or the ID alone
		next := exe(t, dsn, "", "dead", "ls", "--app", "shop", "--limit", "2", "--after", after)
		if next.code != 0 || next.stderr != "" || strings.Count(next.stdout, "\n") != 2 ||
			strings.Contains(r.stdout, strings.Fields(strings.Split(next.stdout, "\n")[1])[0]) {
			t.Errorf("dead ls --after %s, the last of the first 2: want the third alone and no note; got %s", after, next)
		}
	}
	if r := exe(t, dsn, "", "dead", "ls", "--app", "shop"); r.code != 0 || r.stderr != "" || strings.Count(r.stdout, "\n") != 4 {
		t.Errorf("dead ls of all 3: want exit 0, 3 rows and nothing on stderr; got %s", r)
	}
	// A message and an invoke delivery of one id: the ID alone is refused.
	if _, err := pool.Exec(t.Context(), `INSERT INTO dead_letters (id, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error, source)
		SELECT $1::uuid, a.id, 'orders', gen_random_uuid(), '{}', now(), 3, 3, 'boom', s FROM apps a, unnest(ARRAY['queue', 'invoke']) s`, last); err == nil {
		t.Fatalf("a second dead letter of id %s was stored beside the first, whose source is queue too", last)
	}
	shared := "6f1c7a52-95e4-4c3a-9d43-1d6f3f1e8a11"
	if _, err := pool.Exec(t.Context(), `INSERT INTO dead_letters (id, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error, source)
		SELECT $1::uuid, a.id, 'orders', gen_random_uuid(), '{}', now(), 3, 3, 'boom', s FROM apps a, unnest(ARRAY['queue', 'invoke']) s`, shared); err != nil {
		t.Fatal(err)
	}
	if r := exe(t, dsn, "", "dead", "ls", "--app", "shop", "--after", shared); r.code != 2 ||
		!strings.Contains(r.stderr, "a message and an invoke delivery share this id: give "+shared+":queue or "+shared+":invoke") {
		t.Errorf("dead ls --after an id two dead letters share: want exit 2 naming ID:queue and ID:invoke; got %s", r)
	}
	// The two are the newest, the invoke delivery first (by source).
	if r := exe(t, dsn, "", "dead", "ls", "--app", "shop", "--after", shared+":invoke"); r.code != 0 ||
		strings.Count(r.stdout, "\n") != 5 || !strings.HasPrefix(strings.Split(r.stdout, "\n")[1], shared+"  orders  queue") {
		t.Errorf("dead ls --after ID:invoke of the newest: want its message, then the 3 older; got %s", r)
	}
}
