package bellhop_test

// Integration tests of the producer API: Enqueue, EnqueueMany and
// EnqueueTx reject every bad input with its typed error and write nothing,
// accept what they document, and notify only on commit. Helpers (fxEnv,
// fxListener, ...) are in schema_test.go.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// fxAPI is one way to enqueue a single message.
type fxAPI struct {
	name    string
	enqueue func(e *fxEnv, app string, m bellhop.NewMessage) (uuid.UUID, error)
}

var fxAPIs = []fxAPI{
	{"Enqueue", func(e *fxEnv, app string, m bellhop.NewMessage) (uuid.UUID, error) {
		return e.client.Enqueue(e.ctx, app, m.Queue, m.Payload, m.Options)
	}},
	{"EnqueueMany", func(e *fxEnv, app string, m bellhop.NewMessage) (uuid.UUID, error) {
		ids, err := e.client.EnqueueMany(e.ctx, app, []bellhop.NewMessage{m})
		if err != nil {
			return uuid.Nil, err
		}
		if len(ids) != 1 {
			e.t.Fatalf("EnqueueMany of 1 message returned %d ids", len(ids))
		}
		return ids[0], nil
	}},
	// EnqueueTx commits whatever happened: a rejected message must leave
	// nothing behind even when the caller goes on to commit.
	{"EnqueueTx", func(e *fxEnv, app string, m bellhop.NewMessage) (uuid.UUID, error) {
		tx, err := e.pool.Begin(e.ctx)
		if err != nil {
			e.t.Fatal(err)
		}
		id, err := e.client.EnqueueTx(e.ctx, tx, app, m.Queue, m.Payload, m.Options)
		cerr := tx.Commit(e.ctx)
		if err == nil && cerr != nil {
			return uuid.Nil, cerr
		}
		return id, err
	}},
}

// fxSentinels are the typed errors of the producer API.
var fxSentinels = map[string]error{
	"ErrInvalidQueueName": bellhop.ErrInvalidQueueName,
	"ErrInvalidName":      bellhop.ErrInvalidName,
	"ErrInvalidPayload":   bellhop.ErrInvalidPayload,
	"ErrPayloadTooLarge":  bellhop.ErrPayloadTooLarge,
	"ErrInvalidOptions":   bellhop.ErrInvalidOptions,
	"ErrUnknownApp":       bellhop.ErrUnknownApp,
	"ErrUnknownPrincipal": bellhop.ErrUnknownPrincipal,
}

// fxCheckTyped fails t unless err is want and none of the other typed
// errors.
func fxCheckTyped(t *testing.T, err, want error) {
	t.Helper()
	if err == nil {
		t.Fatalf("accepted, want %v", want)
	}
	if !errors.Is(err, want) {
		t.Errorf("error %q is not %v", err, want)
	}
	for name, other := range fxSentinels {
		if other != want && errors.Is(err, other) {
			t.Errorf("error %q is %s as well as %v", err, name, want)
		}
	}
}

// Payloads at and around the limits.
var (
	fxOverMiB = []byte(`{"x":"` + strings.Repeat("a", 1<<20) + `"}`)
	// 1048569 bytes as sent, but about 1.4 MB as PostgreSQL prints the
	// jsonb ({"a": 1}, {"a": 1}, ...), which is what the limit counts.
	fxGrowsPastMiB = []byte("[" + strings.Repeat(`{"a":1},`, 131070) + `{"a":1}]`)
	// A JSON string of exactly 1 MiB, which jsonb prints unchanged.
	fxExactlyMiB = []byte(`"` + strings.Repeat("a", 1<<20-2) + `"`)
	fxDeep200    = []byte(strings.Repeat("[", 200) + strings.Repeat("]", 200))
	fxDeep128    = []byte(strings.Repeat(`{"a":`, 127) + "[1]" + strings.Repeat("}", 127))
)

// TestEnqueueRejectsBadInput sends each bad input through Enqueue,
// EnqueueMany and EnqueueTx and checks the typed error and that
// queue_messages is unchanged.
func TestEnqueueRejectsBadInput(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	other := e.app("other")
	// Rows that must survive every rejected call unchanged.
	if _, err := e.client.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{
		{Queue: "orders", Payload: []byte(`{"n":1}`)},
		{Queue: "orders", Payload: []byte(`{"n":2}`)},
		{Queue: "other", Payload: []byte(`{"n":3}`)},
	}); err != nil {
		t.Fatal(err)
	}
	if len(fxGrowsPastMiB) > 1<<20 {
		t.Fatalf("fxGrowsPastMiB is %d bytes, must be within 1 MiB as sent", len(fxGrowsPastMiB))
	}
	now := time.Now()

	// Each case edits a valid message to shop/orders.
	type edit = func(m *bellhop.NewMessage)
	queue := func(q string) edit { return func(m *bellhop.NewMessage) { m.Queue = q } }
	payload := func(p []byte) edit { return func(m *bellhop.NewMessage) { m.Payload = p } }
	options := func(o bellhop.EnqueueOptions) edit { return func(m *bellhop.NewMessage) { m.Options = o } }
	cases := []struct {
		name string
		app  string // "" means shop
		edit edit
		want error
	}{
		{"unknown app", "nonesuch", func(*bellhop.NewMessage) {}, bellhop.ErrUnknownApp},

		{"empty queue name", "", queue(""), bellhop.ErrInvalidQueueName},
		{"129-byte queue name", "", queue(strings.Repeat("a", 129)), bellhop.ErrInvalidQueueName},
		{"unicode queue name", "", queue("naïve"), bellhop.ErrInvalidQueueName},
		{"SQL in queue name", "", queue("'; DROP TABLE queue_messages; --"), bellhop.ErrInvalidQueueName},
		{"NUL byte in queue name", "", queue("a\x00b"), bellhop.ErrInvalidQueueName},
		{"space in queue name", "", queue("a b"), bellhop.ErrInvalidQueueName},

		{"payload not JSON: {", "", payload([]byte(`{`)), bellhop.ErrInvalidPayload},
		{"payload not JSON: hello", "", payload([]byte(`hello`)), bellhop.ErrInvalidPayload},
		{"empty payload", "", payload([]byte{}), bellhop.ErrInvalidPayload},
		{"nil payload", "", payload(nil), bellhop.ErrInvalidPayload},
		{"payload over 1 MiB", "", payload(fxOverMiB), bellhop.ErrPayloadTooLarge},
		{"payload over 1 MiB as jsonb text", "", payload(fxGrowsPastMiB), bellhop.ErrPayloadTooLarge},
		{"payload nested 200 deep", "", payload(fxDeep200), bellhop.ErrInvalidPayload},
		{`payload "\u0000"`, "", payload([]byte(`"\u0000"`)), bellhop.ErrInvalidPayload},

		{"MaxAttempts -1", "", options(bellhop.EnqueueOptions{MaxAttempts: -1}), bellhop.ErrInvalidOptions},
		{"MaxAttempts 1001", "", options(bellhop.EnqueueOptions{MaxAttempts: 1001}), bellhop.ErrInvalidOptions},
		{
			"both Delay and DeliverAfter", "",
			options(bellhop.EnqueueOptions{Delay: time.Minute, DeliverAfter: now.Add(time.Minute)}),
			bellhop.ErrInvalidOptions,
		},
		{"negative Delay", "", options(bellhop.EnqueueOptions{Delay: -time.Second}), bellhop.ErrInvalidOptions},
		{"DeliverAfter 20 years ahead", "", options(bellhop.EnqueueOptions{DeliverAfter: now.AddDate(20, 0, 0)}), bellhop.ErrInvalidOptions},

		{"principal of another app", "", options(bellhop.EnqueueOptions{Principal: other.DefaultPrincipal}), bellhop.ErrUnknownPrincipal},
		{"unknown principal", "", options(bellhop.EnqueueOptions{Principal: uuid.New()}), bellhop.ErrUnknownPrincipal},
	}
	for _, api := range fxAPIs {
		for _, tc := range cases {
			t.Run(api.name+"/"+tc.name, func(t *testing.T) {
				app := tc.app
				if app == "" {
					app = "shop"
				}
				m := bellhop.NewMessage{Queue: "orders", Payload: []byte(`{"ok":true}`)}
				tc.edit(&m)
				before := e.tableState("queue_messages")
				id, err := api.enqueue(e, app, m)
				if err == nil {
					t.Errorf("accepted as message %s", id)
				}
				fxCheckTyped(t, err, tc.want)
				if after := e.tableState("queue_messages"); after != before {
					t.Errorf("queue_messages changed: %s, was %s", after, before)
				}
			})
		}
	}
}

// TestEnqueueAcceptsLimits checks that values at the documented limits
// are accepted by every API, so that the rejections are the limits'.
func TestEnqueueAcceptsLimits(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	cases := []struct {
		name    string
		queue   string
		payload []byte
		opts    bellhop.EnqueueOptions
	}{
		{name: "128-byte queue name", queue: strings.Repeat("a", 128)},
		{name: "every allowed character in the queue name", queue: "Az09._:-"},
		{name: "payload of exactly 1 MiB", payload: fxExactlyMiB},
		{name: "payload nested 128 deep", payload: fxDeep128},
		{name: "payload null", payload: []byte(`null`)},
		{name: "MaxAttempts 1", opts: bellhop.EnqueueOptions{MaxAttempts: 1}},
		{name: "MaxAttempts 1000", opts: bellhop.EnqueueOptions{MaxAttempts: 1000}},
		{name: "Delay of an hour", opts: bellhop.EnqueueOptions{Delay: time.Hour}},
		{name: "DeliverAfter 9 years ahead", opts: bellhop.EnqueueOptions{DeliverAfter: time.Now().AddDate(9, 0, 0)}},
		{name: "the app's own principal", opts: bellhop.EnqueueOptions{Principal: shop.DefaultPrincipal}},
	}
	for _, api := range fxAPIs {
		for _, tc := range cases {
			t.Run(api.name+"/"+tc.name, func(t *testing.T) {
				queue, payload := tc.queue, tc.payload
				if queue == "" {
					queue = "orders"
				}
				if payload == nil {
					payload = []byte(`{"ok":true}`)
				}
				id, err := api.enqueue(e, "shop", bellhop.NewMessage{Queue: queue, Payload: payload, Options: tc.opts})
				if err != nil {
					t.Fatalf("rejected: %v", err)
				}
				var gotQueue string
				if err := e.pool.QueryRow(e.ctx, "SELECT queue_name FROM queue_messages WHERE id = $1", id).Scan(&gotQueue); err != nil {
					t.Fatalf("message %s not stored: %v", id, err)
				}
				if gotQueue != queue {
					t.Errorf("stored in queue %q, want %q", gotQueue, queue)
				}
			})
		}
	}
}

// TestEnqueueFarPastDeliverAfterIsReadyNow checks that a DeliverAfter in
// the past, however far, is accepted and deliverable at once: depth_pending
// counts it and the dispatcher's claim statement takes it.
func TestEnqueueFarPastDeliverAfterIsReadyNow(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	cases := []struct {
		name string
		at   time.Time
	}{
		{"an hour ago", time.Now().Add(-time.Hour)},
		{"1900", time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC)},
		{"year 1, one microsecond after the zero time", time.Time{}.Add(time.Microsecond)},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			queue := "past-" + string(rune('a'+i))
			id, err := e.client.Enqueue(e.ctx, "shop", queue, []byte(`{}`), bellhop.EnqueueOptions{DeliverAfter: tc.at})
			if err != nil {
				t.Fatalf("rejected: %v", err)
			}
			fxCheckReadyNow(t, e, shop.ID, queue, id)
		})
	}
}

// fxCheckReadyNow checks that message id is the one ready message of the
// queue, and that the dispatcher's claim statement takes it.
func fxCheckReadyNow(t *testing.T, e *fxEnv, app uuid.UUID, queue string, id uuid.UUID) {
	t.Helper()
	if n := e.int64("SELECT depth_pending($1, $2)", app, queue); n != 1 {
		t.Fatalf("depth_pending = %d, want 1", n)
	}
	rows, err := e.pool.Query(e.ctx, queries.ClaimQueue, pgx.NamedArgs{"app_id": app, "queue_name": queue, "max_messages": 10})
	if err != nil {
		t.Fatal(err)
	}
	claimed, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (uuid.UUID, error) {
		vals, err := r.Values()
		if err != nil {
			return uuid.Nil, err
		}
		return uuid.UUID(vals[2].([16]byte)), nil // after app_id and queue_name
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(claimed) != 1 || claimed[0] != id {
		t.Fatalf("claim took %v, want [%s]", claimed, id)
	}
}

// TestEnqueueDeliverAfterBeforePostgresRange: EnqueueOptions documents
// that "times in the past mean now", but a time before PostgreSQL's
// timestamptz range (4713 BC) is passed to the database as it is.
func TestEnqueueDeliverAfterBeforePostgresRange(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	at := time.Date(-5000, 1, 1, 0, 0, 0, 0, time.UTC)
	id, err := e.client.Enqueue(e.ctx, "shop", "ancient", []byte(`{}`), bellhop.EnqueueOptions{DeliverAfter: at})
	if err != nil {
		t.Fatalf("DeliverAfter %s (in the past) rejected: %v", at, err)
	}
	fxCheckReadyNow(t, e, shop.ID, "ancient", id)
}

// TestEnqueueNonUTCDeliverAfterKeepsInstant checks that a DeliverAfter in
// another zone is stored as the same instant, not as its wall clock read
// in UTC: each case's wall clock lies on the other side of now.
func TestEnqueueNonUTCDeliverAfterKeepsInstant(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	now := time.Now().Truncate(time.Second)
	cases := []struct {
		name    string
		at      time.Time
		delayed bool
	}{
		// Wall clock now+4:30: read as UTC it would still be delayed.
		{"UTC+05:30, an hour ago", now.Add(-time.Hour).In(time.FixedZone("IST", 5*3600+30*60)), false},
		// Wall clock now-7h: read as UTC it would be ready.
		{"UTC-08:00, an hour ahead", now.Add(time.Hour).In(time.FixedZone("PST", -8*3600)), true},
		{"UTC+14:00, two hours ahead", now.Add(2 * time.Hour).In(time.FixedZone("LINT", 14*3600)), true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			queue := "zone-" + string(rune('a'+i))
			id, err := e.client.Enqueue(e.ctx, "shop", queue, []byte(`{}`), bellhop.EnqueueOptions{DeliverAfter: tc.at})
			if err != nil {
				t.Fatalf("rejected: %v", err)
			}
			var stored time.Time
			var same bool
			// Compare in the database too, against the time as text with
			// its offset, parsed by PostgreSQL itself.
			err = e.pool.QueryRow(e.ctx, `SELECT deliver_after, deliver_after = $2::text::timestamptz
				FROM queue_messages WHERE id = $1`, id, tc.at.Format(time.RFC3339)).Scan(&stored, &same)
			if err != nil {
				t.Fatal(err)
			}
			if !stored.Equal(tc.at) || !same {
				t.Errorf("stored deliver_after %s, want the instant %s (%s)", stored.UTC(), tc.at.UTC(), tc.at.Format(time.RFC3339))
			}
			pending := e.int64("SELECT depth_pending($1, $2)", shop.ID, queue)
			if want := map[bool]int64{true: 0, false: 1}[tc.delayed]; pending != want {
				t.Errorf("depth_pending = %d, want %d (delayed: %t)", pending, want, tc.delayed)
			}
		})
	}
}

// TestEnqueueManyIsAllOrNothing checks that a batch with one bad message
// writes nothing, and that the same batch without it writes every message.
func TestEnqueueManyIsAllOrNothing(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	other := e.app("other")
	batch := func(bad int, m bellhop.NewMessage) []bellhop.NewMessage {
		msgs := make([]bellhop.NewMessage, 5)
		for i := range msgs {
			msgs[i] = bellhop.NewMessage{Queue: []string{"orders", "refunds"}[i%2], Payload: []byte(`{"i":` + string(rune('0'+i)) + `}`)}
		}
		if bad >= 0 {
			msgs[bad] = m
		}
		return msgs
	}
	cases := []struct {
		name string
		bad  int // index of the bad message
		msg  bellhop.NewMessage
		want error
	}{
		{"3rd has an invalid queue name", 2, bellhop.NewMessage{Queue: "a b", Payload: []byte(`1`)}, bellhop.ErrInvalidQueueName},
		{"3rd is not JSON", 2, bellhop.NewMessage{Queue: "orders", Payload: []byte(`{`)}, bellhop.ErrInvalidPayload},
		{"3rd is over 1 MiB", 2, bellhop.NewMessage{Queue: "orders", Payload: fxOverMiB}, bellhop.ErrPayloadTooLarge},
		{"3rd is over 1 MiB as jsonb text", 2, bellhop.NewMessage{Queue: "orders", Payload: fxGrowsPastMiB}, bellhop.ErrPayloadTooLarge},
		{
			"3rd has MaxAttempts 1001", 2,
			bellhop.NewMessage{Queue: "orders", Payload: []byte(`1`), Options: bellhop.EnqueueOptions{MaxAttempts: 1001}},
			bellhop.ErrInvalidOptions,
		},
		{
			"3rd names a principal of another app", 2,
			bellhop.NewMessage{Queue: "orders", Payload: []byte(`1`), Options: bellhop.EnqueueOptions{Principal: other.DefaultPrincipal}},
			bellhop.ErrUnknownPrincipal,
		},
		{
			"last names a principal of another app", 4,
			bellhop.NewMessage{Queue: "orders", Payload: []byte(`1`), Options: bellhop.EnqueueOptions{Principal: other.DefaultPrincipal}},
			bellhop.ErrUnknownPrincipal,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := e.tableState("queue_messages")
			ids, err := e.client.EnqueueMany(e.ctx, "shop", batch(tc.bad, tc.msg))
			if err == nil {
				t.Errorf("accepted as %v", ids)
			}
			fxCheckTyped(t, err, tc.want)
			if after := e.tableState("queue_messages"); after != before {
				t.Errorf("queue_messages changed: %s, was %s", after, before)
			}
			// The error names the message, also when the database found
			// the fault (the size as jsonb text, the principal).
			var at interface{ Position() int }
			if want := fmt.Sprintf("message %d of 5", tc.bad+1); !strings.Contains(fmt.Sprint(err), want) ||
				!errors.As(err, &at) || at.Position() != tc.bad {
				t.Errorf("error %q does not name %s by its position", err, want)
			}
		})
	}

	t.Run("the batch without a bad message writes all 5, in order", func(t *testing.T) {
		msgs := batch(-1, bellhop.NewMessage{})
		before := e.int64("SELECT count(*) FROM queue_messages")
		ids, err := e.client.EnqueueMany(e.ctx, "shop", msgs)
		if err != nil {
			t.Fatal(err)
		}
		if len(ids) != len(msgs) {
			t.Fatalf("%d ids for %d messages", len(ids), len(msgs))
		}
		for i, id := range ids {
			var queue, payload string
			if err := e.pool.QueryRow(e.ctx, "SELECT queue_name, payload::text FROM queue_messages WHERE id = $1", id).
				Scan(&queue, &payload); err != nil {
				t.Fatalf("message %d (%s): %v", i+1, id, err)
			}
			if queue != msgs[i].Queue || payload != strings.Replace(string(msgs[i].Payload), ":", ": ", 1) {
				t.Errorf("message %d stored as %s %s, want %s %s", i+1, queue, payload, msgs[i].Queue, msgs[i].Payload)
			}
		}
		if after := e.int64("SELECT count(*) FROM queue_messages"); after != before+5 {
			t.Errorf("queue_messages grew from %d to %d rows, want by 5", before, after)
		}
	})
}

// TestEnqueueTxNotifiesOnlyOnCommit checks the transactional outbox: a
// rolled-back EnqueueTx leaves no row and sends no notification; a
// committed one sends exactly one.
func TestEnqueueTxNotifiesOnlyOnCommit(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{false, true} {
		name := map[bool]string{false: "rolled back", true: "committed"}[commit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			shop := e.app("shop")
			l := e.listen()

			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			id, err := e.client.EnqueueTx(e.ctx, tx, "shop", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var inTx int64
			if err := tx.QueryRow(e.ctx, "SELECT count(*) FROM queue_messages WHERE id = $1", id).Scan(&inTx); err != nil {
				t.Fatal(err)
			}
			if inTx != 1 {
				t.Fatalf("the transaction sees %d rows of its message, want 1", inTx)
			}
			if n := e.int64("SELECT count(*) FROM queue_messages"); n != 0 {
				t.Fatalf("%d rows visible outside the open transaction, want 0", n)
			}

			if commit {
				if err := tx.Commit(e.ctx); err != nil {
					t.Fatal(err)
				}
				if got, want := l.next(), fxQueuePayload(shop.ID, "orders"); got != want {
					t.Fatalf("notification %q, want %q", got, want)
				}
			} else if err := tx.Rollback(e.ctx); err != nil {
				t.Fatal(err)
			}
			l.noMore()

			want := map[bool]int64{false: 0, true: 1}[commit]
			if n := e.int64("SELECT count(*) FROM queue_messages WHERE id = $1", id); n != want {
				t.Errorf("message %s: %d rows after the transaction was %s, want %d", id, n, name, want)
			}
			if n := e.int64("SELECT count(*) FROM queue_messages"); n != want {
				t.Errorf("queue_messages holds %d rows, want %d", n, want)
			}
		})
	}
}

// TestEnqueueRejectsPayloadsJSONBCannotStore: payloads that are valid JSON
// to Go but that PostgreSQL's jsonb refuses must still be rejected with
// ErrInvalidPayload, not an untyped database error.
func TestEnqueueRejectsPayloadsJSONBCannotStore(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	cases := []struct {
		name    string
		payload string
	}{
		{"lone high surrogate", `"\ud800"`},
		{"lone low surrogate in an object", `{"k":"\udc00"}`},
		{"high surrogate, then another escape", `"\ud800\u0041"`},
		{"number beyond numeric's range", `1e1000000`},
		// PostgreSQL 14 and 15 refuse this exponent, 16 takes it: the
		// client refuses it on every version. It reached the server,
		// which aborted an EnqueueTx caller's transaction.
		{"zero with the exponent only PostgreSQL 16 takes", `[0.0e1073741823]`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// The database refuses it indeed.
			if _, err := e.pool.Exec(e.ctx, "SELECT $1::text::jsonb", tc.payload); err == nil && !strings.Contains(tc.payload, "1073741823") {
				t.Fatalf("PostgreSQL accepts %s as jsonb; the case is moot", tc.payload)
			}
			before := e.tableState("queue_messages")
			_, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(tc.payload), bellhop.EnqueueOptions{})
			fxCheckTyped(t, err, bellhop.ErrInvalidPayload)
			if after := e.tableState("queue_messages"); after != before {
				t.Errorf("queue_messages changed: %s, was %s", after, before)
			}
			// Refused before any statement: the caller's transaction
			// goes on (EnqueueTx's doc).
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			_, err = e.client.EnqueueTx(e.ctx, tx, "shop", "orders", []byte(tc.payload), bellhop.EnqueueOptions{})
			fxCheckTyped(t, err, bellhop.ErrInvalidPayload)
			if _, err := tx.Exec(e.ctx, "SELECT 1"); err != nil {
				t.Errorf("the caller's transaction after the refusal: %v", err)
			}
		})
	}
}

// TestEnqueueAcceptsEscapedBackslashBeforeU0000: the JSON string "\\u0000"
// is a backslash followed by "u0000", not a NUL character; jsonb stores it,
// so Enqueue must accept it.
func TestEnqueueAcceptsEscapedBackslashBeforeU0000(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	for _, payload := range []string{`"\\u0000"`, `{"path":"C:\\u0000\\x"}`} {
		t.Run(payload, func(t *testing.T) {
			var text string
			if err := e.pool.QueryRow(e.ctx, "SELECT ($1::text::jsonb)::text", payload).Scan(&text); err != nil {
				t.Fatalf("PostgreSQL refuses %s as jsonb: %v", payload, err)
			}
			id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(payload), bellhop.EnqueueOptions{})
			if err != nil {
				t.Fatalf("rejected: %v", err)
			}
			var stored string
			if err := e.pool.QueryRow(e.ctx, "SELECT payload::text FROM queue_messages WHERE id = $1", id).Scan(&stored); err != nil {
				t.Fatal(err)
			}
			if stored != text {
				t.Errorf("stored %s, want %s", stored, text)
			}
		})
	}
}

// TestDelayOnDatabaseClock: a Delay counts on the database's clock, for a
// producer whose own clock is ten minutes slow too: its minute's delay was
// already over when the message arrived, nine minutes in the past.
func TestDelayOnDatabaseClock(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	_, cons := e.appConsumer("shop", "orders")
	slow := bellhop.NewClient(e.pool)
	bellhop.SetClock(slow, func() time.Time { return time.Now().Add(-10 * time.Minute) })
	opts := bellhop.EnqueueOptions{Delay: time.Minute}
	one, err := slow.Enqueue(e.ctx, "shop", "orders", []byte(`1`), opts)
	if err != nil {
		t.Fatal(err)
	}
	many, err := slow.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`2`), Options: opts}, {Queue: "orders", Payload: []byte(`3`), Options: opts}})
	if err != nil {
		t.Fatal(err)
	}
	invoked, err := slow.InvokeAsync(e.ctx, cons.ID, []byte(`4`), opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range append([]uuid.UUID{one, invoked}, many...) {
		due := e.int64(`SELECT extract(epoch FROM deliver_after - clock_timestamp())::bigint
			FROM (SELECT id, deliver_after FROM queue_messages UNION ALL SELECT id, deliver_after FROM outbox) m WHERE id = $1`, id)
		if due < 50 || due > 60 {
			t.Errorf("message %s is due in %ds by the database's clock, want about 60", id, due)
		}
	}
}

// TestOversizedBatchInLastConnection: a batch refused for a payload over
// 1 MiB as jsonb text, sent in a transaction that holds the pool's only
// connection, returns its error at once. Looking up the message at fault
// waited for a free connection, for ever without a deadline.
func TestOversizedBatchInLastConnection(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	cfg := e.pool.Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(e.ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	tx, err := pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(e.ctx)
	done := make(chan error, 1)
	go func() {
		_, err := bellhop.NewClient(pool).EnqueueManyTx(context.Background(), tx, "shop",
			[]bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: fxGrowsPastMiB}})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, bellhop.ErrPayloadTooLarge) {
			t.Errorf("EnqueueManyTx: %v, want ErrPayloadTooLarge", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("EnqueueManyTx did not return within 10s")
	}
}

// TestEnqueueMaxAttemptsFromItsAppsConsumer: a message enqueued without
// MaxAttempts takes its queue's consumer's, in a batch too, and only the
// consumer of its own app's queue: another app's consumer of a queue of
// the same name does not count, and without one of its own the message
// gets the default of 3.
func TestEnqueueMaxAttemptsFromItsAppsConsumer(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("a")
	e.app("b")
	e.app("c")
	for _, s := range []bellhop.ConsumerSpec{{App: "b", Queue: "orders", MaxAttempts: 9}, {App: "c", Queue: "orders", MaxAttempts: 7}} {
		if _, err := e.client.RegisterConsumer(e.ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	check := func(t *testing.T, id uuid.UUID, want int64) {
		t.Helper()
		if got := e.int64(`SELECT max_attempts FROM queue_messages WHERE id = $1`, id); got != want {
			t.Errorf("message %s has max_attempts %d, want %d", id, got, want)
		}
	}
	for _, api := range fxAPIs {
		t.Run(api.name+"/another app's consumer", func(t *testing.T) {
			id, err := api.enqueue(e, "a", bellhop.NewMessage{Queue: "orders", Payload: []byte(`1`)})
			if err != nil {
				t.Fatal(err)
			}
			check(t, id, 3)
		})
	}
	t.Run("EnqueueMany of 2/its own consumer", func(t *testing.T) {
		ids, err := e.client.EnqueueMany(e.ctx, "c", []bellhop.NewMessage{
			{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: []byte(`2`)},
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			check(t, id, 7)
		}
	})
	t.Run("EnqueueMany of 2/another app's consumer", func(t *testing.T) {
		ids, err := e.client.EnqueueMany(e.ctx, "a", []bellhop.NewMessage{
			{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: []byte(`2`)},
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			check(t, id, 3)
		}
	})
}

// TestOversizedBatchNamesFirst: a batch refused by the database for two
// payloads over 1 MiB as jsonb text, the 2nd and the 4th, names the 2nd,
// the first at fault.
func TestOversizedBatchNamesFirst(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	msgs := []bellhop.NewMessage{
		{Queue: "orders", Payload: []byte(`1`)},
		{Queue: "orders", Payload: fxGrowsPastMiB},
		{Queue: "orders", Payload: []byte(`3`)},
		{Queue: "orders", Payload: fxGrowsPastMiB},
	}
	_, err := e.client.EnqueueMany(e.ctx, "shop", msgs)
	fxCheckTyped(t, err, bellhop.ErrPayloadTooLarge)
	var at interface{ Position() int }
	if !strings.Contains(fmt.Sprint(err), "message 2 of 4") || !errors.As(err, &at) || at.Position() != 1 {
		t.Errorf("error %q does not name message 2 of 4 by its position", err)
	}
}

// TestEnqueueManyKeepsItsOrder: the messages of one batch get distinct
// enqueued_at times, in the batch's order, so that a claim, which takes the
// oldest first, takes them in that order. They shared the transaction's
// start, and ties came in heap order, which reuses free space on earlier
// pages: found by review, a batch could reach a consumer with MaxInFlight
// 1 out of its order.
func TestEnqueueManyKeepsItsOrder(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	const n = 300
	msgs := make([]bellhop.NewMessage, n)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "ordered", Payload: fmt.Appendf(nil, `{"i":%d}`, i)}
	}
	ids, err := e.client.EnqueueMany(e.ctx, "shop", msgs)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := e.pool.Query(e.ctx, `SELECT id, count(*) OVER (PARTITION BY enqueued_at) FROM queue_messages
		WHERE queue_name = 'ordered' ORDER BY enqueued_at`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		ID   uuid.UUID
		Same int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != n {
		t.Fatalf("%d messages stored, want %d", len(got), n)
	}
	for i, r := range got {
		if r.Same != 1 {
			t.Fatalf("message %d shares its enqueued_at with %d others", i, r.Same-1)
		}
		if r.ID != ids[i] {
			t.Fatalf("message %d by enqueued_at is %s, want the batch's %d-th, %s", i, r.ID, i, ids[i])
		}
	}
}

// TestOneTransactionKeepsItsOrder: the messages of one transaction get
// distinct enqueued_at times in the order of its calls, whichever way they
// were enqueued: EnqueueTx, EnqueueManyTx and enqueue() in SQL. A claim
// takes the oldest first; the statements of one transaction used to share
// the transaction's start, position by position, so that a consumer got
// `bellhop enqueue -`'s 500-line batches as lines 1, 501, 1001, 2, ...
// (found by review). A setting a producer forged reads as no count.
func TestOneTransactionKeepsItsOrder(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	for _, forged := range []string{"", "-1000000", "x", "1000000000", "99999999999"} {
		t.Run("setting "+strconv.Quote(forged), func(t *testing.T) {
			queue := "ordered" + strconv.Itoa(len(forged))
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			if forged != "" {
				if _, err := tx.Exec(e.ctx, "SELECT set_config('bellhop.enqueue_seq', $1, true)", forged); err != nil {
					t.Fatal(err)
				}
			}
			var want []string
			one := func(label string) {
				t.Helper()
				if _, err := e.client.EnqueueTx(e.ctx, tx, "shop", queue, fmt.Appendf(nil, "%q", label), bellhop.EnqueueOptions{}); err != nil {
					t.Fatal(err)
				}
				want = append(want, label)
			}
			many := func(labels ...string) {
				t.Helper()
				msgs := make([]bellhop.NewMessage, len(labels))
				for i, l := range labels {
					msgs[i] = bellhop.NewMessage{Queue: queue, Payload: fmt.Appendf(nil, "%q", l)}
				}
				if _, err := e.client.EnqueueManyTx(e.ctx, tx, "shop", msgs); err != nil {
					t.Fatal(err)
				}
				want = append(want, labels...)
			}
			sql := func(label string) {
				t.Helper()
				if _, err := tx.Exec(e.ctx, "SELECT enqueue($1, $2, to_jsonb($3::text))", shop.ID, queue, label); err != nil {
					t.Fatal(err)
				}
				want = append(want, label)
			}
			one("tx 1")
			many("many 1a", "many 1b", "many 1c")
			one("tx 2")
			sql("sql 1")
			sql("sql 2")
			many("many 2a", "many 2b")
			one("tx 3")
			rows, err := tx.Query(e.ctx, `SELECT label FROM (SELECT payload #>> '{}' AS label, enqueued_at,
					count(*) OVER (PARTITION BY enqueued_at) AS same FROM queue_messages WHERE queue_name = $1) m
				WHERE same = 1 ORDER BY enqueued_at`, queue)
			if err != nil {
				t.Fatal(err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Errorf("by enqueued_at, leaving out ties: %q, want %q", got, want)
			}
		})
	}

	// A control character in a bad queue name shows escaped.
	_, err := e.pool.Exec(e.ctx, "SELECT enqueue($1, E'q1\\n', '{}')", shop.ID)
	if pe := fxPgError(t, err); pe.Code != "BH002" || pe.Message != `bellhop: invalid queue name "q1\n"` {
		t.Errorf("error %s %q, want BH002 naming the queue escaped", pe.Code, pe.Message)
	}
}

// TestEnqueueErrorsNameTheirCause: a batch whose payloads total more than
// one call may send is refused before any work, naming the limit (it used
// to fail after encoding them all: over 1 GiB, 43 s and 4.9 GB of client
// memory, "write failed: message body too large"); a foreign principal is
// named by its id.
func TestEnqueueErrorsNameTheirCause(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	other := e.app("other")
	before := e.tableState("queue_messages")

	// 257 payloads of 1 MiB, sharing one array.
	big := append(append([]byte(`"`), bytes.Repeat([]byte("a"), 1<<20-2)...), '"')
	msgs := make([]bellhop.NewMessage, 257)
	for i := range msgs {
		msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: big}
	}
	_, err := e.client.EnqueueMany(e.ctx, "shop", msgs)
	fxCheckTyped(t, err, bellhop.ErrPayloadTooLarge)
	if !strings.Contains(fmt.Sprint(err), "total 269484032 bytes, more than the 268435456 bytes (256 MiB) one call may send") {
		t.Errorf("error %q does not give the total and the limit", err)
	}

	foreign := bellhop.EnqueueOptions{Principal: other.DefaultPrincipal}
	_, err = e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), foreign)
	fxCheckTyped(t, err, bellhop.ErrUnknownPrincipal)
	if want := fmt.Sprintf(`enqueue shop/orders: unknown principal: principal %s does not belong to app "shop"`, other.DefaultPrincipal); fmt.Sprint(err) != want {
		t.Errorf("error %q, want %q", err, want)
	}
	_, err = e.client.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{
		{Queue: "orders", Payload: []byte(`1`)},
		{Queue: "orders", Payload: []byte(`2`), Options: foreign},
		{Queue: "orders", Payload: []byte(`3`), Options: foreign},
	})
	fxCheckTyped(t, err, bellhop.ErrUnknownPrincipal)
	if want := fmt.Sprintf(`message 2 of 3 (queue orders): unknown principal: principal %s does not belong to app "shop" (2 messages of the batch name one that does not)`, other.DefaultPrincipal); !strings.HasSuffix(fmt.Sprint(err), want) {
		t.Errorf("error %q, want one ending %q", err, want)
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Errorf("queue_messages changed: %s, was %s", after, before)
	}
}

// TestConstraintErrorKeepsPgError: a payload the database refuses (over
// 1 MiB as jsonb text, which the client cannot know beforehand) is
// ErrPayloadTooLarge, and the PostgreSQL error stays in the chain, for a
// caller that wants its SQLSTATE or constraint: it was formatted with %v,
// and errors.As found no *pgconn.PgError (found by the API review).
func TestConstraintErrorKeepsPgError(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	_, err := e.client.Enqueue(e.ctx, "shop", "orders", fxGrowsPastMiB, bellhop.EnqueueOptions{})
	var pgErr *pgconn.PgError
	if !errors.Is(err, bellhop.ErrPayloadTooLarge) || !errors.As(err, &pgErr) || pgErr.ConstraintName != "queue_messages_payload_size_check" {
		t.Fatalf("Enqueue of a payload over 1 MiB as jsonb text: %v (PgError %+v), want ErrPayloadTooLarge wrapping the check's PgError", err, pgErr)
	}
}
