package bellhop_test

// Tests of the listing methods (DeadLetters, Queues, Consumers) and of the
// dead-letter operations' input checks: an app that does not exist is
// ErrUnknownApp there as in the methods that act on one app, "" still
// lists every app, and a bad queue name or limit is refused before
// anything is read or written. Helpers (fxEnv, ...) are in schema_test.go.

import (
	"context"
	"errors"
	"math"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// deadLetter inserts a dead letter of app's queue, as a dispatcher
// leaves one.
func (e *fxEnv) deadLetter(app uuid.UUID, queue string) {
	e.t.Helper()
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		VALUES (gen_random_uuid(), 'queue', $1, $2, '{}', now(), 3, 3, 'boom')`, app, queue)
}

func TestListingsRefuseUnknownApp(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, other := e.app("shop"), e.app("other")
	for _, a := range []bellhop.App{shop, other} {
		e.deadLetter(a.ID, "orders")
		if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: a.Name, Queue: "orders"}); err != nil {
			t.Fatal(err)
		}
	}
	// Each lister returns the apps of the rows it listed, sorted, once each.
	listers := []struct {
		name string
		list func(c *bellhop.Client, app string) ([]string, error)
	}{
		{"DeadLetters", func(c *bellhop.Client, app string) ([]string, error) {
			ds, err := c.DeadLetters(e.ctx, bellhop.DeadFilter{App: app})
			var apps []string
			for _, d := range ds {
				apps = append(apps, d.App)
			}
			return apps, err
		}},
		{"Queues", func(c *bellhop.Client, app string) ([]string, error) {
			qs, err := c.Queues(e.ctx, app)
			var apps []string
			for _, q := range qs {
				apps = append(apps, q.App)
			}
			return apps, err
		}},
		{"Consumers", func(c *bellhop.Client, app string) ([]string, error) {
			cs, err := c.Consumers(e.ctx, app)
			var apps []string
			for _, x := range cs {
				apps = append(apps, x.App)
			}
			return apps, err
		}},
	}
	tests := []struct {
		name     string
		client   *bellhop.Client
		app      string
		want     error  // nil: success
		wantText string // in the error
		wantApps []string
	}{
		{name: "unknown app", client: e.client, app: "nosuch", want: bellhop.ErrUnknownApp, wantText: `unknown app "nosuch"`},
		{name: "not an app name", client: e.client, app: "bad name", want: bellhop.ErrUnknownApp, wantText: `unknown app "bad name"`},
		{name: "one app", client: e.client, app: "shop", wantApps: []string{"shop"}},
		{name: "every app", client: e.client, app: "", wantApps: []string{"other", "shop"}},
		{name: "another app, as a principal", client: e.client.As(other.DefaultPrincipal), app: "shop", want: bellhop.ErrForbidden},
		{name: "its own app, as a principal", client: e.client.As(other.DefaultPrincipal), app: "other", wantApps: []string{"other"}},
	}
	for _, l := range listers {
		for _, tc := range tests {
			t.Run(l.name+" "+tc.name, func(t *testing.T) {
				apps, err := l.list(tc.client, tc.app)
				if tc.want != nil {
					if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.wantText) || apps != nil {
						t.Errorf("got %v, %v; want an error wrapping %v that says %q", apps, err, tc.want, tc.wantText)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				slices.Sort(apps)
				if apps = slices.Compact(apps); !slices.Equal(apps, tc.wantApps) {
					t.Errorf("listed apps %v, want %v", apps, tc.wantApps)
				}
			})
		}
	}
}

// TestDeadLetterInputChecks: a dead-letter filter or operation with a
// queue that is no valid queue name, or a listing limit out of range, is
// refused with its typed error and changes nothing; it used to select
// nothing (or 100 rows, for a limit below 1) and succeed.
func TestDeadLetterInputChecks(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	for range 3 {
		e.deadLetter(shop.ID, "orders")
	}
	list := func(f bellhop.DeadFilter) error {
		f.App = "shop"
		_, err := e.client.DeadLetters(e.ctx, f)
		return err
	}
	refused := []struct {
		name string
		call func() error
		want error
	}{
		{"DeadLetters limit -1", func() error { return list(bellhop.DeadFilter{Limit: -1}) }, bellhop.ErrInvalidOptions},
		{"DeadLetters limit over the maximum", func() error { return list(bellhop.DeadFilter{Limit: bellhop.MaxDeadLimit + 1}) }, bellhop.ErrInvalidOptions},
		{"DeadLetters bad queue", func() error { return list(bellhop.DeadFilter{Queue: "bad q"}) }, bellhop.ErrInvalidQueueName},
		{"Redrive bad queue", func() error {
			_, err := e.client.Redrive(e.ctx, "shop", "bad q", uuid.Nil)
			return err
		}, bellhop.ErrInvalidQueueName},
		{"PurgeDead bad queue", func() error {
			_, err := e.client.PurgeDead(e.ctx, "shop", "orders/x", uuid.Nil)
			return err
		}, bellhop.ErrInvalidQueueName},
		{"PurgeDead 129-byte queue", func() error {
			_, err := e.client.PurgeDead(e.ctx, "shop", strings.Repeat("a", 129), uuid.Nil)
			return err
		}, bellhop.ErrInvalidQueueName},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			dead, queued := e.tableState("dead_letters"), e.tableState("queue_messages")
			if err := tc.call(); !errors.Is(err, tc.want) {
				t.Errorf("got %v, want %v", err, tc.want)
			}
			if got := e.tableState("dead_letters"); got != dead {
				t.Errorf("dead_letters changed: %s, was %s", got, dead)
			}
			if got := e.tableState("queue_messages"); got != queued {
				t.Errorf("queue_messages changed: %s, was %s", got, queued)
			}
		})
	}
	accepted := []struct {
		limit, want int
	}{
		{0, 3}, // the default
		{1, 1},
		{bellhop.MaxDeadLimit, 3},
	}
	for _, tc := range accepted {
		ds, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Queue: "orders", Limit: tc.limit})
		if err != nil || len(ds) != tc.want {
			t.Errorf("DeadLetters limit %d: %d rows, %v; want %d rows", tc.limit, len(ds), err, tc.want)
		}
	}
}

// TestPayloadLimitsWhereChecked pins down the README's account of what is
// checked where: the client counts the bytes it is given (white space
// included) and limits nesting; the database measures the size as jsonb
// text and does not limit nesting.
func TestPayloadLimitsWhereChecked(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	// 1500007 bytes as given, 8 as jsonb text ({"a": 1}).
	padded := []byte(`{"a":` + strings.Repeat(" ", 1500000) + `1}`)
	deep := strings.Repeat("[", 200) + strings.Repeat("]", 200)

	_, err := e.client.Enqueue(e.ctx, "shop", "orders", padded, bellhop.EnqueueOptions{})
	if !errors.Is(err, bellhop.ErrPayloadTooLarge) || !strings.Contains(err.Error(), "payload too large: 1500007 bytes") {
		t.Errorf("client, 1500007 bytes of which 8 as jsonb: got %v, want ErrPayloadTooLarge naming 1500007 bytes", err)
	}
	if _, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(deep), bellhop.EnqueueOptions{}); !errors.Is(err, bellhop.ErrInvalidPayload) {
		t.Errorf("client, nested 200 deep: got %v, want ErrInvalidPayload", err)
	}
	if n := e.int64("SELECT count(*) FROM queue_messages"); n != 0 {
		t.Fatalf("the client wrote %d messages", n)
	}

	// The same two payloads pass the database, by plain INSERT and by
	// enqueue().
	e.exec(`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', $2::jsonb), ($1, 'orders', $3::jsonb)`,
		shop.ID, string(padded), deep)
	e.exec(`SELECT enqueue($1, 'orders', $2::jsonb), enqueue($1, 'orders', $3::jsonb)`, shop.ID, string(padded), deep)
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE octet_length(payload::text) = 8`); n != 2 {
		t.Errorf("%d padded payloads stored as 8 bytes of jsonb text, want 2", n)
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE payload::text = $1`, deep); n != 2 {
		t.Errorf("%d payloads nested 200 deep stored, want 2", n)
	}
}

// TestQueuesCountInvokeDeliveries: a queue's counts take in its
// consumer's invoke deliveries, pending and dead, as dead ls, redrive and
// purge select them. It counted the queue's messages only, so invoke
// deliveries could wait or die unseen by the queue list and its metrics.
func TestQueuesCountInvokeDeliveries(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, cons := e.appConsumer("shop", "orders")
	e.deadLetter(shop.ID, "orders")
	for range 2 {
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error)
			VALUES (gen_random_uuid(), 'invoke', $1, 'orders', $2, '{}', now(), 3, 3, 'boom')`, shop.ID, cons.ID)
	}
	if _, err := e.client.InvokeAsync(e.ctx, cons.ID, []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.InvokeAsync(e.ctx, cons.ID, []byte(`2`), bellhop.EnqueueOptions{Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	// The base system's rows are not the queue's.
	e.exec(`INSERT INTO outbox (app_id, source_kind, trigger_id, payload) VALUES ($1, 'event', $2, '{}')`, shop.ID, cons.ID)
	ds, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	qs, err := e.client.Queues(e.ctx, "shop")
	if err != nil {
		t.Fatal(err)
	}
	if len(qs) != 1 || qs[0].Dead != 3 || qs[0].Ready != 1 || qs[0].Delayed != 1 || len(ds) != 3 {
		t.Errorf("Queues: %+v, DeadLetters: %d; want one queue with 1 ready, 1 delayed and 3 dead, and 3 listed", qs, len(ds))
	}
}

// TestQueuesOldestReadyBounded: a producer's plain INSERT may set
// enqueued_at to anything finite. Year 1 (Go's zero time) made OldestReady
// -292 years, a float converted past int64; an enqueued_at ahead of the
// database's clock made it negative. The age metric then hid the queue
// from every alert.
func TestQueuesOldestReadyBounded(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	e.exec(`INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at) VALUES
		($1, 'ancient', '{}', '0001-01-01 00:00:00+00'), ($1, 'future', '{}', now() + interval '1 hour'),
		($1, 'recent', '{}', now() - interval '1 minute')`, shop.ID)
	qs, err := e.client.Queues(e.ctx, "shop")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]func(time.Duration) bool{
		"ancient": func(d time.Duration) bool { return d == math.MaxInt64 },
		"future":  func(d time.Duration) bool { return d == 0 },
		"recent":  func(d time.Duration) bool { return d >= time.Minute && d < time.Hour },
	}
	for _, q := range qs {
		if ok := want[q.Queue]; ok == nil || !ok(q.OldestReady) {
			t.Errorf("queue %s: OldestReady %s", q.Queue, q.OldestReady)
		}
		delete(want, q.Queue)
	}
	for q := range want {
		t.Errorf("queue %s not listed", q)
	}
}

// TestDeadListReadsNewestFirst: listing one app's dead letters reads its
// newest from idx_dead_letters_died and stops at the limit. Filtered
// through the join with apps, it read and sorted every dead letter.
func TestDeadListReadsNewestFirst(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, other := e.app("shop"), e.app("other")
	for _, a := range []bellhop.App{shop, other} {
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
			SELECT gen_random_uuid(), 'queue', $1, 'q' || (g % 20), '{}', now(), 3, 3, 'boom', now() - g * interval '1 second'
			FROM generate_series(1, 20000) g`, a.ID)
	}
	e.exec(`ANALYZE dead_letters`)
	// Both listings, with and without payloads, from the newest and after
	// a given one.
	for _, c := range []struct{ name, stmt, afterID, afterDied string }{
		{"dead_list.sql", queries.DeadList, "NULL", "NULL"},
		{"dead_list_brief.sql", queries.DeadListBrief, "NULL", "NULL"},
		{"dead_list.sql after one", queries.DeadList, "'" + uuid.NewString() + "'", "now() - interval '10000 seconds'"},
		{"dead_list_brief.sql after one", queries.DeadListBrief, "'" + uuid.NewString() + "'", "now() - interval '10000 seconds'"},
	} {
		name := c.name
		sql := strings.NewReplacer("@app_name", "'shop'", "@queue_name", "NULL", "@id", "NULL", "@max_rows", "100",
			"@after_id", c.afterID, "@after_died", c.afterDied, "@after_source", "'queue'").Replace(c.stmt)
		var plan strings.Builder
		rows, err := e.pool.Query(e.ctx, "EXPLAIN "+sql)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan.WriteString(line + "\n")
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		p := plan.String()
		// Sorted by source only within ties of the index's order (an
		// incremental sort), never as a whole.
		if !strings.Contains(p, "idx_dead_letters_died") || fullSort.MatchString(p) || strings.Contains(p, "Seq Scan") ||
			(c.afterID != "NULL" && !strings.Contains(p, "Index Cond: ((app_id = $0) AND (died_at <= ")) {
			t.Errorf("%s: listing one app's dead letters does not read them newest first from idx_dead_letters_died:\n%s", name, p)
		}
	}
	got, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].App != "shop" || !got[0].DiedAt.After(got[1].DiedAt) || !got[1].DiedAt.After(got[2].DiedAt) {
		t.Errorf("listed %d dead letters, want shop's 3 newest, newest first: %+v", len(got), got)
	}
}

// fullSort finds a plan's Sort node: a sort of every row it reads.
var fullSort = regexp.MustCompile(`(?m)^\s*(->\s*)?Sort\s+\(`)

// TestDeadLettersOmitPayload: with OmitPayload, DeadLetters lists the
// same dead letters without their payloads, and reads none: a role that
// may read every column of dead_letters but the payload can list them so,
// and not otherwise. bellhop dead ls read every listed payload into
// memory (300 of 1 MB: 304 MB) though its table shows none.
func TestDeadLettersOmitPayload(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT gen_random_uuid(), 'queue', $1, 'orders', jsonb_build_object('n', g, 'pad', repeat('x', 100000)), now(), 3, 3, 'boom'
		FROM generate_series(1, 3) g`, shop.ID)
	full, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	brief, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", OmitPayload: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(full) != 3 || len(brief) != 3 {
		t.Fatalf("listed %d dead letters with payloads and %d without, want 3 each", len(full), len(brief))
	}
	for i := range full {
		if len(full[i].Payload) < 100000 {
			t.Errorf("dead letter %s listed by default with a payload of %d bytes, want its 100 KB", full[i].ID, len(full[i].Payload))
		}
		if brief[i].Payload != nil {
			t.Errorf("dead letter %s listed with OmitPayload has a payload of %d bytes, want nil", brief[i].ID, len(brief[i].Payload))
		}
		f, b := full[i], brief[i]
		f.Payload, b.Payload = nil, nil
		if !reflect.DeepEqual(f, b) {
			t.Errorf("but for the payload, the dead letter listed with OmitPayload differs:\n%+v\n%+v", f, b)
		}
	}

	// A role that may read every column of dead_letters but the payload.
	dsn := e.login("bellhop_nopayload_", "")
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	role := pgx.Identifier{cfg.User}.Sanitize()
	// Before the role's drop (cleanups run last-in first-out), which its
	// grants in this database would refuse.
	t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), "DROP OWNED BY "+role) })
	e.exec(`GRANT SELECT ON apps, principals TO ` + role)
	e.exec(`DO $$ BEGIN EXECUTE format('GRANT SELECT (%s) ON dead_letters TO %s',
		(SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns
		 WHERE table_schema = 'public' AND table_name = 'dead_letters' AND column_name <> 'payload'), '` + cfg.User + `'); END $$`)
	pool, err := pgxpool.New(e.ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	limited := bellhop.NewClient(pool)
	if got, err := limited.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", OmitPayload: true}); err != nil || len(got) != 3 {
		t.Errorf("listing without payloads as a role that may not read them: %d listed, %v; want 3", len(got), err)
	}
	// The role really cannot read them.
	if _, err := limited.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop"}); fxPgError(t, err).Code != "42501" {
		t.Errorf("listing with payloads as a role that may not read them: %v, want permission denied", err)
	}
}

// TestDeadLettersAfter: a listing continued page by page with After, each
// page after the last dead letter of the one before, lists every dead
// letter once, in the order of one listing of them all, though many died
// at the same time (a reclaim pass dead-letters its batch in one
// statement) and a message and an invoke delivery share an id, at the
// same time or not (the diff review found a cursor of the id alone
// listing one page for ever, or skipping one of the two). A cursor whose
// dead letter is gone still places the listing; one that is not a dead
// letter a listing returned is refused.
func TestDeadLettersAfter(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop, other := e.app("shop"), e.app("other")
	// 12 at one time, 13 apart, for each app; and, in shop, two pairs of
	// a message and an invoke delivery of one id: one pair among the 12,
	// one pair apart.
	for _, a := range []bellhop.App{shop, other} {
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
			SELECT gen_random_uuid(), 'queue', $1, 'q' || (g % 2), '{}', now(), 3, 3, 'boom',
			       CASE WHEN g <= 12 THEN now() - interval '1 hour' ELSE now() - g * interval '1 second' END
			FROM generate_series(1, 25) g`, a.ID)
	}
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at, attempt, max_attempts, last_error, died_at)
		SELECT p.id, s.source, $1, 'q1', CASE WHEN s.source = 'invoke' THEN gen_random_uuid() END, '{}', now(), 3, 3, 'boom',
		       CASE WHEN p.n = 1 THEN now() - interval '1 hour' ELSE now() - interval '14 seconds' - s.k * interval '3 seconds' END
		FROM (VALUES (1, gen_random_uuid()), (2, gen_random_uuid())) AS p (n, id),
		     (VALUES ('queue', 0), ('invoke', 1)) AS s (source, k)`, shop.ID)
	type key struct {
		id     uuid.UUID
		source string
	}
	keys := func(ds []bellhop.DeadLetter) []key {
		var out []key
		for _, d := range ds {
			out = append(out, key{d.ID, d.Source})
		}
		return out
	}
	for _, f := range []bellhop.DeadFilter{{App: "shop"}, {App: "shop", Queue: "q1"}, {}} {
		all, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: f.App, Queue: f.Queue, Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		for _, size := range []int{1, 2, 7} {
			var paged []key
			g := f
			for page := 0; ; page++ {
				if page > len(all) {
					t.Fatalf("%+v: still paging after %d pages", g, page)
				}
				g.Limit = size
				got, err := e.client.DeadLetters(e.ctx, g)
				if err != nil {
					t.Fatalf("%+v: %v", g, err)
				}
				paged = append(paged, keys(got)...)
				if len(got) < size {
					break
				}
				g.After = &got[len(got)-1]
			}
			if want := keys(all); len(want) == 0 || !slices.Equal(paged, want) {
				t.Errorf("app %q queue %q: pages of %d listed %d dead letters, one listing %d; want the same, in the same order",
					f.App, f.Queue, size, len(paged), len(want))
			}
		}
	}

	// The cursor's own dead letter purged: the next page is where it was.
	first, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Limit: 4})
	if err != nil || len(first) != 4 {
		t.Fatalf("shop's 4 newest: %d, %v", len(first), err)
	}
	want, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Limit: 2, After: &first[3]})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`DELETE FROM dead_letters WHERE id = $1 AND source = $2`, first[3].ID, first[3].Source)
	if got, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", Limit: 2, After: &first[3]}); err != nil ||
		!slices.Equal(keys(got), keys(want)) {
		t.Errorf("after a purged dead letter: %v, %v; want the 2 after it, %v", keys(got), err, keys(want))
	}

	for name, after := range map[string]*bellhop.DeadLetter{
		"no id":        {DiedAt: time.Now(), Source: "queue"},
		"no DiedAt":    {ID: uuid.New(), Source: "queue"},
		"no source":    {ID: uuid.New(), DiedAt: time.Now()},
		"other source": {ID: uuid.New(), DiedAt: time.Now(), Source: "cron"},
	} {
		got, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", After: after})
		if !errors.Is(err, bellhop.ErrInvalidOptions) {
			t.Errorf("After with %s: listed %d, error %v; want ErrInvalidOptions", name, len(got), err)
		}
	}
	_ = other
}
