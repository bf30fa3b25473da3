package main

import (
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestRedriveSaysWhatStayed: a redrive that could move some dead letters
// and not others moves those it can, prints how many, and exits 2 naming
// why the rest stayed. A dead letter whose id a producer had reused for a
// live message made the whole redrive fail with a bare unique violation
// (exit 1), moving nothing.
func TestRedriveSaysWhatStayed(t *testing.T) {
	t.Parallel()
	dsn, pool := shopWithDeadLetters(t, 2)
	if _, err := pool.Exec(t.Context(), `INSERT INTO queue_messages (id, app_id, queue_name, payload)
		SELECT id, app_id, 'orders', '{"second":"life"}' FROM dead_letters ORDER BY id LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	r := exe(t, dsn, "", "dead", "redrive", "--app", "shop", "--queue", "orders")
	if r.code != 2 || strings.TrimSpace(r.stdout) != "redrove 1 dead letter" ||
		!strings.Contains(r.stderr, "1 dead letter(s) not redriven") || !strings.Contains(r.stderr, "id a live message has taken again") {
		t.Errorf("want exit 2, 1 redriven and the reason the other stayed; got %s", r)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 1 {
		t.Errorf("%d dead letters left, want 1", n)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 2 {
		t.Errorf("%d messages queued, want 2 (the live one and the redriven one)", n)
	}
}

// TestRedriveFailingPartWaySaysWhatMoved: a redrive works in batches of
// bellhop.DeadBatch; one whose second batch fails (here a trigger refuses
// the second statement's insert) keeps the first batch moved, prints how
// many moved before the error, and fails; the rest stay dead letters for
// the next run, which moves them. It was one statement: a failure moved
// nothing, and a large one held every lock until it failed.
func TestRedriveFailingPartWaySaysWhatMoved(t *testing.T) {
	t.Parallel()
	total := bellhop.DeadBatch + 100
	dsn, pool := shopWithDeadLetters(t, total)
	refuseSecondStatement(t, pool, "INSERT")
	r := exe(t, dsn, "", "dead", "redrive", "--app", "shop", "--queue", "orders")
	want := fmt.Sprintf("redrove %d dead letters before the error", bellhop.DeadBatch)
	if r.code == 0 || strings.TrimSpace(r.stdout) != want || !strings.Contains(r.stderr, "second batch refused by the test") {
		t.Errorf("want a failure, %q and the batch's error; got %s", want, r)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 100 {
		t.Errorf("%d dead letters left, want 100", n)
	}
	if r := exe(t, dsn, "", "dead", "redrive", "--app", "shop", "--queue", "orders"); r.code != 0 || strings.TrimSpace(r.stdout) != "redrove 100 dead letters" {
		t.Errorf("the second redrive: want the 100 left moved; got %s", r)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != total {
		t.Errorf("%d messages queued, want %d", n, total)
	}
}

// TestDeadShowSharedID: dead show prints every dead letter with the id,
// as redrive and purge act on every one. A queue message and an invoke
// delivery may share an id; show printed one, and a purge then deleted one
// the user had not been shown.
func TestDeadShowSharedID(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	const id = "0b6e4d7a-1111-4c2b-9a55-2f0c3e7d9a01"
	if _, err := pool.Exec(t.Context(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT $1, s, a.id, 'orders', CASE WHEN s = 'invoke' THEN gen_random_uuid() END, '{}', now(), 3, 3, 'boom'
		FROM apps a, unnest(ARRAY['queue', 'invoke']) AS s WHERE a.name = 'shop'`, id); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(strings.NewReader(ok(t, dsn, "dead", "show", "--app", "shop", id)))
	var sources []string
	for {
		var dl struct{ ID, Source string }
		if err := dec.Decode(&dl); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("dead show is not a stream of JSON objects: %v", err)
		}
		if dl.ID != id {
			t.Errorf("dead show printed id %s, want %s", dl.ID, id)
		}
		sources = append(sources, dl.Source)
	}
	slices.Sort(sources)
	if !slices.Equal(sources, []string{"invoke", "queue"}) {
		t.Errorf("dead show printed the dead letters of sources %v, want [invoke queue]", sources)
	}
}

// TestDeadListingsEscapeTerminalCodes: a dead letter's error may quote
// what a producer sent (a handler's fmt.Errorf("bad note %s", ...)), and
// its payload is the producer's. Printed as they were, an OSC 52 sequence
// set the operator's clipboard and cursor movements hid rows of dead ls;
// dead show's JSON escaped ESC but wrote bidi overrides and C1 controls
// as they are. Both now print them harmless, dead show as the same JSON.
func TestDeadListingsEscapeTerminalCodes(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	const id = "0b6e4d7a-2222-4c2b-9a55-2f0c3e7d9a01"
	payload := `{"note":"\u001b]52;c;ZWNobyBwd25lZAo=\u0007\u001b[1A\u001b[2K\r", "n":"a\u202eb\u009b31mc"}`
	lastError := "attempts exhausted: bad note \x1b]52;c;ZWNobyBwd25lZAo=\x07\x1b[1A\x1b[2K\r\tgpj.exe\u202e"
	if _, err := pool.Exec(t.Context(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT $1, 'queue', a.id, 'orders', $2, now(), 3, 3, $3 FROM apps a WHERE a.name = 'shop'`, id, payload, lastError); err != nil {
		t.Fatal(err)
	}
	bad := func(out string) []rune {
		var found []rune
		for _, r := range out {
			if r != '\n' && !unicode.IsPrint(r) {
				found = append(found, r)
			}
		}
		return found
	}
	ls := ok(t, dsn, "dead", "ls", "--app", "shop")
	if found := bad(ls); len(found) > 0 || !strings.Contains(ls, "bad note ?]52;c;") {
		t.Errorf("dead ls prints %q (unprintable %q)", ls, found)
	}
	show := ok(t, dsn, "dead", "show", "--app", "shop", id)
	if found := bad(show); len(found) > 0 {
		t.Errorf("dead show prints %q (unprintable %q)", show, found)
	}
	var dl struct {
		Payload   map[string]string
		LastError string
	}
	if err := json.Unmarshal([]byte(show), &dl); err != nil {
		t.Fatalf("dead show is not JSON: %v", err)
	}
	if dl.Payload["n"] != "a\u202eb\u009b31mc" || dl.LastError != lastError {
		t.Errorf("dead show's JSON decodes to %q and %q, not the dead letter's payload and error", dl.Payload, dl.LastError)
	}
}

// TestDeadListingsOfOddRows: plain SQL may store what the Go client would
// not: a payload nested deeper than encoding/json reads (10,000 levels),
// and times outside years 0 to 9999. Found by review: one such dead
// letter made dead ls fail for its whole app ("exceeded max depth"), and
// dead show fail on it (Time.MarshalJSON refuses such years).
func TestDeadListingsOfOddRows(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	const deep, old = "0b6e4d7a-3333-4c2b-9a55-2f0c3e7d9a01", "0b6e4d7a-4444-4c2b-9a55-2f0c3e7d9a01"
	if _, err := pool.Exec(t.Context(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, deliver_after, attempt, max_attempts, last_error)
		SELECT $1::uuid, 'queue', a.id, 'orders', (repeat('[', 10001) || repeat(']', 10001))::jsonb, now(), NULL::timestamptz, 3, 3, 'deep'
		FROM apps a WHERE a.name = 'shop'
		UNION ALL
		SELECT $2::uuid, 'queue', a.id, 'orders', '{}', '0044-03-15 12:00:00+00 BC'::timestamptz, '20000-01-01 00:00:00+00'::timestamptz, 3, 3, 'old'
		FROM apps a WHERE a.name = 'shop'`, deep, old); err != nil {
		t.Fatal(err)
	}
	ls := ok(t, dsn, "dead", "ls", "--app", "shop")
	if !strings.Contains(ls, deep) || !strings.Contains(ls, old) {
		t.Errorf("dead ls does not list both dead letters:\n%s", ls)
	}

	r := exe(t, dsn, "", "dead", "show", "--app", "shop", deep)
	var shown struct{ Payload string }
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &shown) != nil || len(shown.Payload) != 2*10001 ||
		!strings.Contains(r.stderr, "nests too deep") {
		t.Errorf("dead show of the deep payload: exit %d, stderr %q, %d bytes of payload as a string; want exit 0, the payload as a string of %d bytes, and a word on stderr",
			r.code, r.stderr, len(shown.Payload), 2*10001)
	}

	show := ok(t, dsn, "dead", "show", "--app", "shop", old)
	var times struct{ EnqueuedAt, DeliverAfter string }
	if err := json.Unmarshal([]byte(show), &times); err != nil {
		t.Fatalf("dead show is not JSON: %v\n%s", err, show)
	}
	if !strings.HasPrefix(times.EnqueuedAt, "-0043-03-15T12:00:00") || !strings.HasPrefix(times.DeliverAfter, "20000-01-01T00:00:00") {
		t.Errorf("dead show's times are %q and %q, want 44 BC (year -43) and year 20000", times.EnqueuedAt, times.DeliverAfter)
	}
}

// TestDeadViewMirrorsDeadLetter: dead show prints deadView, which must
// keep DeadLetter's fields, names and order, as it grows; so must
// messageView, which message show prints, keep QueuedMessage's.
func TestDeadViewMirrorsDeadLetter(t *testing.T) {
	t.Parallel()
	names := func(v any) []string {
		var out []string
		for f := range reflect.TypeOf(v).Fields() {
			out = append(out, f.Name)
		}
		return out
	}
	if got, want := names(deadView{}), names(bellhop.DeadLetter{}); !slices.Equal(got, want) {
		t.Errorf("deadView's fields are %v, DeadLetter's %v", got, want)
	}
	if got, want := names(messageView{}), names(bellhop.QueuedMessage{}); !slices.Equal(got, want) {
		t.Errorf("messageView's fields are %v, QueuedMessage's %v", got, want)
	}
}

// TestDeadShowPrintsUTC: dead show prints a dead letter's times in UTC,
// as every other listing does; it printed them in the host's time zone.
// message show prints a queue message's alike.
// The times come in a zone that is not UTC, as pgx gives them on a host
// whose zone is not: time.Local cannot be set in a parallel test.
func TestDeadShowPrintsUTC(t *testing.T) {
	t.Parallel()
	zone := time.FixedZone("UTC+5:30", 5*3600+1800)
	at := time.Date(2030, 1, 2, 8, 34, 5, 123456000, zone) // 03:04:05.123456 UTC
	v := shownDead(bellhop.DeadLetter{EnqueuedAt: at, DeliverAfter: &at, DiedAt: at, RedriveAfter: &at})
	m := shownMessage(bellhop.QueuedMessage{EnqueuedAt: at, DeliverAfter: &at, ClaimedAt: &at})
	const want = "2030-01-02T03:04:05.123456Z"
	for name, got := range map[string]string{"EnqueuedAt": v.EnqueuedAt, "DeliverAfter": *v.DeliverAfter, "DiedAt": v.DiedAt, "RedriveAfter": *v.RedriveAfter,
		"message show's EnqueuedAt": m.EnqueuedAt, "message show's DeliverAfter": *m.DeliverAfter, "message show's ClaimedAt": *m.ClaimedAt} {
		if got != want {
			t.Errorf("dead show prints %s as %q, want %q", name, got, want)
		}
	}
}

// refuseSecondStatement makes the second statement that runs event
// (INSERT, DELETE) on queue_messages fail with "second batch refused by
// the test", as a batch of a redrive or purge may fail part way.
func refuseSecondStatement(t *testing.T, pool *pgxpool.Pool, event string) {
	t.Helper()
	for _, sql := range []string{
		`CREATE SEQUENCE statements`,
		`CREATE FUNCTION refuse_second() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN IF nextval('statements') = 2 THEN RAISE EXCEPTION 'second batch refused by the test'; END IF; RETURN NULL; END $$`,
		`CREATE TRIGGER refuse_second AFTER ` + event + ` ON queue_messages FOR EACH STATEMENT EXECUTE FUNCTION refuse_second()`,
	} {
		if _, err := pool.Exec(t.Context(), sql); err != nil {
			t.Fatal(err)
		}
	}
}
