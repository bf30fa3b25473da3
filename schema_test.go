package bellhop_test

// Integration tests of the schema itself: the seed's table and indexes, the
// insert notifications, the table constraints that hold for plain SQL, the
// enqueue() SQL function, and the depth helpers and queue_list view.
//
// Helpers shared with enqueue_test.go carry an "fx" prefix, to stay clear of
// other test files in this package.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// fxTimeout bounds each test's database work and every wait for a
// notification.
const fxTimeout = 60 * time.Second

// fxEnv is one test's own migrated database with a pool and a Client.
type fxEnv struct {
	t      *testing.T
	ctx    context.Context
	pool   *pgxpool.Pool
	client *bellhop.Client
}

func fxNew(t *testing.T) *fxEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), fxTimeout)
	t.Cleanup(cancel)
	pool := pgtest.NewPool(t)
	return &fxEnv{t: t, ctx: ctx, pool: pool, client: bellhop.NewClient(pool)}
}

func (e *fxEnv) app(name string) bellhop.App {
	e.t.Helper()
	a, err := e.client.CreateApp(e.ctx, name)
	if err != nil {
		e.t.Fatalf("create app %q: %v", name, err)
	}
	return a
}

// appConsumer creates app name and registers the consumer of its queue.
func (e *fxEnv) appConsumer(name, queue string) (bellhop.App, bellhop.Consumer) {
	e.t.Helper()
	a := e.app(name)
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: name, Queue: queue})
	if err != nil {
		e.t.Fatalf("register the consumer of %s/%s: %v", name, queue, err)
	}
	return a, c
}

// login creates a role that logs in, a member of roles (none if empty),
// and returns a connection string for it. The role is dropped when the
// test ends; cleanups run last-in first-out, so after any pool or
// dispatcher started later has closed its connections.
func (e *fxEnv) login(prefix, roles string) string {
	e.t.Helper()
	name := prefix + uuid.NewString()[:8]
	stmt := `CREATE ROLE ` + name + ` LOGIN`
	if roles != "" {
		stmt += ` IN ROLE ` + roles
	}
	e.exec(stmt)
	e.t.Cleanup(func() { _, _ = pgxpoolExec(pgtest.AdminConnString(), `DROP ROLE IF EXISTS `+name) })
	dsn, err := pgdsn.WithUser(e.pool.Config().ConnConfig.ConnString(), name)
	if err != nil {
		e.t.Fatal(err)
	}
	return dsn
}

// int64 runs a query that returns one bigint.
func (e *fxEnv) int64(sql string, args ...any) int64 {
	e.t.Helper()
	var n int64
	if err := e.pool.QueryRow(e.ctx, sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (e *fxEnv) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(e.ctx, sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// tableState summarises a table's rows: their count and a digest of their
// content, so that "unchanged" means neither added, removed nor altered.
func (e *fxEnv) tableState(table string) string {
	e.t.Helper()
	var n int64
	var digest string
	sql := fmt.Sprintf(`SELECT count(*), coalesce(md5(string_agg(t::text, ',' ORDER BY t::text)), '-') FROM %s t`,
		pgx.Identifier{table}.Sanitize())
	if err := e.pool.QueryRow(e.ctx, sql).Scan(&n, &digest); err != nil {
		e.t.Fatalf("read %s: %v", table, err)
	}
	return fmt.Sprintf("%d rows, digest %s", n, digest)
}

// fxPgError returns err's PostgreSQL error, or fails the test.
func fxPgError(t *testing.T, err error) *pgconn.PgError {
	t.Helper()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("want a PostgreSQL error, got %v", err)
	}
	return pe
}

// fxListener is a dedicated connection LISTENing on "bellhop".
type fxListener struct {
	e    *fxEnv
	conn *pgx.Conn
}

const fxSentinel = "h:sentinel"

func (e *fxEnv) listen() *fxListener {
	e.t.Helper()
	conn, err := pgx.ConnectConfig(e.ctx, e.pool.Config().ConnConfig.Copy())
	if err != nil {
		e.t.Fatalf("connect listener: %v", err)
	}
	e.t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(e.ctx, "LISTEN bellhop"); err != nil {
		e.t.Fatalf("LISTEN: %v", err)
	}
	return &fxListener{e: e, conn: conn}
}

// next waits for the next notification on "bellhop".
func (l *fxListener) next() string {
	l.e.t.Helper()
	ctx, cancel := context.WithTimeout(l.e.ctx, 10*time.Second)
	defer cancel()
	n, err := l.conn.WaitForNotification(ctx)
	if err != nil {
		l.e.t.Fatalf("wait for a notification: %v", err)
	}
	if n.Channel != "bellhop" {
		l.e.t.Fatalf("notification on channel %q, want bellhop", n.Channel)
	}
	return n.Payload
}

// receive waits for n notifications and returns their payloads, sorted.
func (l *fxListener) receive(n int) []string {
	l.e.t.Helper()
	got := make([]string, 0, n)
	for range n {
		got = append(got, l.next())
	}
	slices.Sort(got)
	return got
}

// noMore proves that nothing was notified beyond what was received: it
// sends a sentinel from a later transaction and checks that the sentinel
// is the next notification. PostgreSQL delivers notifications in commit
// order, so any notification of an earlier transaction would come first.
func (l *fxListener) noMore() {
	l.e.t.Helper()
	l.e.exec("SELECT pg_notify('bellhop', $1)", fxSentinel)
	if got := l.next(); got != fxSentinel {
		l.e.t.Fatalf("got notification %q before the sentinel, want no more notifications", got)
	}
}

func fxQueuePayload(app uuid.UUID, queue string) string {
	return "q:" + app.String() + ":" + queue
}

// TestQueueMessagesMatchesSeed reads the columns and the seed's three
// indexes of queue_messages back from the catalog and compares them with
// shared/seed/0034_queue_messages.sql, written out here by hand.
func TestQueueMessagesMatchesSeed(t *testing.T) {
	t.Parallel()
	e := fxNew(t)

	type column struct {
		Name, Type, Nullable string
		Default              *string
	}
	def := func(s string) *string { return &s }
	wantColumns := []column{
		{"id", "uuid", "NO", def("gen_random_uuid()")},
		{"app_id", "uuid", "NO", nil},
		{"queue_name", "text", "NO", nil},
		{"payload", "jsonb", "NO", nil},
		{"enqueued_at", "timestamp with time zone", "NO", def("now()")},
		{"deliver_after", "timestamp with time zone", "YES", nil},
		{"claim_token", "uuid", "YES", nil},
		{"claimed_at", "timestamp with time zone", "YES", nil},
		{"attempt", "integer", "NO", def("0")},
		{"max_attempts", "integer", "NO", def("3")},
		{"enqueued_by_principal", "uuid", "YES", nil},
	}
	rows, err := e.pool.Query(e.ctx, `
		SELECT column_name, data_type, is_nullable, column_default
		FROM information_schema.columns
		WHERE table_schema = 'public' AND table_name = 'queue_messages'
		ORDER BY ordinal_position`)
	if err != nil {
		t.Fatal(err)
	}
	gotColumns, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (column, error) {
		var c column
		return c, r.Scan(&c.Name, &c.Type, &c.Nullable, &c.Default)
	})
	if err != nil {
		t.Fatal(err)
	}
	show := func(cs []column) string {
		var b strings.Builder
		for _, c := range cs {
			d := "(none)"
			if c.Default != nil {
				d = *c.Default
			}
			fmt.Fprintf(&b, "\n  %s %s nullable=%s default=%s", c.Name, c.Type, c.Nullable, d)
		}
		return b.String()
	}
	if show(gotColumns) != show(wantColumns) {
		t.Errorf("queue_messages columns:%s\nwant (the seed's):%s", show(gotColumns), show(wantColumns))
	}

	wantIndexes := map[string]string{
		"idx_queue_messages_dispatch": "CREATE INDEX idx_queue_messages_dispatch ON public.queue_messages " +
			"USING btree (app_id, queue_name, enqueued_at) WHERE (claim_token IS NULL)",
		"idx_queue_messages_app_queue": "CREATE INDEX idx_queue_messages_app_queue ON public.queue_messages " +
			"USING btree (app_id, queue_name)",
		"idx_queue_messages_claimed": "CREATE INDEX idx_queue_messages_claimed ON public.queue_messages " +
			"USING btree (claimed_at) WHERE (claim_token IS NOT NULL)",
	}
	for name, want := range wantIndexes {
		var got string
		err := e.pool.QueryRow(e.ctx, `
			SELECT indexdef FROM pg_indexes
			WHERE schemaname = 'public' AND tablename = 'queue_messages' AND indexname = $1`, name).Scan(&got)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			t.Errorf("index %s of the seed is missing", name)
		case err != nil:
			t.Fatal(err)
		case got != want:
			t.Errorf("index %s:\n  got  %s\n  want %s", name, got, want)
		}
	}
}

// TestInsertNotifications checks that inserts into queue_messages notify
// once per (app, queue) per transaction, whatever the number of rows, and
// not more.
func TestInsertNotifications(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		write  func(e *fxEnv, app uuid.UUID)
		rows   int64
		queues []string // one notification for each, sorted
	}{
		{
			name: "one INSERT of 1000 rows across 3 queues",
			write: func(e *fxEnv, app uuid.UUID) {
				e.exec(`
					INSERT INTO queue_messages (app_id, queue_name, payload)
					SELECT $1, (ARRAY['alpha', 'beta', 'gamma'])[g % 3 + 1], jsonb_build_object('n', g)
					FROM generate_series(1, 1000) AS g`, app)
			},
			rows:   1000,
			queues: []string{"alpha", "beta", "gamma"},
		},
		{
			name: "one row in each of 2 transactions to the same queue",
			write: func(e *fxEnv, app uuid.UUID) {
				for i := range 2 {
					err := pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(e.ctx, `INSERT INTO queue_messages (app_id, queue_name, payload)
							VALUES ($1, 'orders', jsonb_build_object('n', $2::int))`, app, i)
						return err
					})
					if err != nil {
						e.t.Fatal(err)
					}
				}
			},
			rows:   2,
			queues: []string{"orders", "orders"},
		},
		{
			name: "COPY of 500 rows across 2 queues",
			write: func(e *fxEnv, app uuid.UUID) {
				rows := make([][]any, 500)
				for i := range rows {
					rows[i] = []any{app, []string{"left", "right"}[i%2], []byte(fmt.Sprintf(`{"n":%d}`, i))}
				}
				n, err := e.pool.CopyFrom(e.ctx, pgx.Identifier{"queue_messages"},
					[]string{"app_id", "queue_name", "payload"}, pgx.CopyFromRows(rows))
				if err != nil || n != 500 {
					e.t.Fatalf("CopyFrom: %d rows, %v", n, err)
				}
			},
			rows:   500,
			queues: []string{"left", "right"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := fxNew(t)
			app := e.app("shop").ID
			l := e.listen()

			tc.write(e, app)

			if n := e.int64("SELECT count(*) FROM queue_messages"); n != tc.rows {
				t.Fatalf("queue_messages holds %d rows, want %d", n, tc.rows)
			}
			want := make([]string, len(tc.queues))
			for i, q := range tc.queues {
				want[i] = fxQueuePayload(app, q)
			}
			if got := l.receive(len(want)); !slices.Equal(got, want) {
				t.Fatalf("notifications %q, want %q", got, want)
			}
			l.noMore()
		})
	}
}

// TestConstraintsRejectPlainSQL writes bad rows with plain SQL, bypassing
// the Go API, and checks that the table constraints reject each one and
// leave the tables unchanged, while boundary values pass.
func TestConstraintsRejectPlainSQL(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	app := e.app("shop")
	// Two consumers' parent rows for queue_trigger_details.
	newTrigger := func() uuid.UUID {
		var id uuid.UUID
		err := e.pool.QueryRow(e.ctx, `INSERT INTO triggers (app_id, kind, principal_id)
			VALUES ($1, 'queue', $2) RETURNING id`, app.ID, app.DefaultPrincipal).Scan(&id)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	trigger := newTrigger()

	const insertMessage = `INSERT INTO queue_messages (app_id, queue_name, payload, max_attempts, attempt)
		VALUES ($1, $2, $3, $4, $5)`
	const insertDetails = `INSERT INTO queue_trigger_details (trigger_id, queue_name, visibility_timeout_secs)
		VALUES ($1, $2, $3)`
	payload := []byte(`{"ok":true}`)

	cases := []struct {
		name       string
		sql        string
		args       []any
		constraint string
	}{
		{"empty queue name", insertMessage, []any{app.ID, "", payload, 3, 0}, "queue_messages_queue_name_check"},
		{"129-byte queue name", insertMessage, []any{app.ID, strings.Repeat("a", 129), payload, 3, 0}, "queue_messages_queue_name_check"},
		{"unicode queue name", insertMessage, []any{app.ID, "naïve", payload, 3, 0}, "queue_messages_queue_name_check"},
		{"queue name with a space", insertMessage, []any{app.ID, "a b", payload, 3, 0}, "queue_messages_queue_name_check"},
		{"SQL in queue name", insertMessage, []any{app.ID, "'; DROP TABLE queue_messages; --", payload, 3, 0}, "queue_messages_queue_name_check"},
		{"max_attempts 0", insertMessage, []any{app.ID, "orders", payload, 0, 0}, "queue_messages_max_attempts_check"},
		{"max_attempts 1001", insertMessage, []any{app.ID, "orders", payload, 1001, 0}, "queue_messages_max_attempts_check"},
		{"attempt -1", insertMessage, []any{app.ID, "orders", payload, 3, -1}, "queue_messages_attempt_check"},
		{
			"payload over 1 MiB",
			`INSERT INTO queue_messages (app_id, queue_name, payload)
			 VALUES ($1, 'orders', jsonb_build_object('x', repeat('a', 1100000)))`,
			[]any{app.ID}, "queue_messages_payload_size_check",
		},
		{"visibility_timeout_secs 0", insertDetails, []any{trigger, "orders", 0}, "queue_trigger_details_visibility_timeout_check"},
		{"visibility_timeout_secs 43201", insertDetails, []any{trigger, "orders", 43201}, "queue_trigger_details_visibility_timeout_check"},
		{"consumer queue name with a space", insertDetails, []any{trigger, "a b", 30}, "queue_trigger_details_queue_name_check"},
		// Neither claimable nor reclaimable: never delivered (0050).
		{"claim_token without claimed_at", `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token)
			VALUES ($1, 'orders', '{}', gen_random_uuid())`, []any{app.ID}, "queue_messages_claim_pair_check"},
		{"claimed_at without claim_token", `INSERT INTO queue_messages (app_id, queue_name, payload, claimed_at)
			VALUES ($1, 'orders', '{}', now())`, []any{app.ID}, "queue_messages_claim_pair_check"},
		{"invoke delivery with claim_token without claimed_at", `INSERT INTO outbox (app_id, source_kind, trigger_id, payload, claim_token)
			VALUES ($1, 'invoke', $2, '{}', gen_random_uuid())`, []any{app.ID, trigger}, "outbox_claim_pair_check"},
		// Times Go cannot read, which stopped the queue's claims (0056).
		{"enqueued_at -infinity", `INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at)
			VALUES ($1, 'orders', '{}', '-infinity')`, []any{app.ID}, "queue_messages_enqueued_at_finite_check"},
		{"deliver_after infinity", `INSERT INTO queue_messages (app_id, queue_name, payload, deliver_after)
			VALUES ($1, 'orders', '{}', 'infinity')`, []any{app.ID}, "queue_messages_deliver_after_finite_check"},
		{"invoke delivery due at -infinity", `INSERT INTO outbox (app_id, source_kind, trigger_id, payload, deliver_after)
			VALUES ($1, 'invoke', $2, '{}', '-infinity')`, []any{app.ID, trigger}, "outbox_times_finite_check"},
	}
	for _, tc := range cases {
		t.Run("rejects "+tc.name, func(t *testing.T) {
			messages, details := e.tableState("queue_messages"), e.tableState("queue_trigger_details")
			_, err := e.pool.Exec(e.ctx, tc.sql, tc.args...)
			if err == nil {
				t.Fatal("the insert succeeded, want a check violation")
			}
			pe := fxPgError(t, err)
			if pe.Code != "23514" || pe.ConstraintName != tc.constraint {
				t.Errorf("SQLSTATE %s, constraint %q (%s); want 23514, %q", pe.Code, pe.ConstraintName, pe.Message, tc.constraint)
			}
			if got := e.tableState("queue_messages"); got != messages {
				t.Errorf("queue_messages changed: %s, was %s", got, messages)
			}
			if got := e.tableState("queue_trigger_details"); got != details {
				t.Errorf("queue_trigger_details changed: %s, was %s", got, details)
			}
		})
	}

	// Boundary values pass, so the rejections above are the constraints'
	// limits and not a broken insert.
	accepted := []struct {
		name  string
		sql   string
		args  []any
		table string
	}{
		{"128-byte queue name", insertMessage, []any{app.ID, strings.Repeat("a", 128), payload, 3, 0}, "queue_messages"},
		{"queue name of every allowed character", insertMessage, []any{app.ID, "Az09._:-", payload, 3, 0}, "queue_messages"},
		{"max_attempts 1, attempt 0", insertMessage, []any{app.ID, "orders", payload, 1, 0}, "queue_messages"},
		{"max_attempts 1000", insertMessage, []any{app.ID, "orders", payload, 1000, 0}, "queue_messages"},
		{
			"payload of 1048576 bytes as text",
			// {"x": "aaa..."} prints as 9 bytes around the string.
			`INSERT INTO queue_messages (app_id, queue_name, payload)
			 VALUES ($1, 'orders', jsonb_build_object('x', repeat('a', 1048576 - 9)))`,
			[]any{app.ID}, "queue_messages",
		},
		{"visibility_timeout_secs 1", insertDetails, []any{trigger, "orders", 1}, "queue_trigger_details"},
		{"visibility_timeout_secs 43200", insertDetails, []any{newTrigger(), "orders", 43200}, "queue_trigger_details"},
		{"a claimed message", `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
			VALUES ($1, 'orders', '{}', gen_random_uuid(), now(), 1)`, []any{app.ID}, "queue_messages"},
		// The base system's outbox rows keep their own rules.
		{"an event row with claim_token only", `INSERT INTO outbox (app_id, source_kind, trigger_id, payload, claim_token)
			VALUES ($1, 'event', $2, '{}', gen_random_uuid())`, []any{app.ID, trigger}, "outbox"},
	}
	for _, tc := range accepted {
		t.Run("accepts "+tc.name, func(t *testing.T) {
			before := e.int64("SELECT count(*) FROM " + tc.table)
			if _, err := e.pool.Exec(e.ctx, tc.sql, tc.args...); err != nil {
				t.Fatalf("insert: %v", err)
			}
			if after := e.int64("SELECT count(*) FROM " + tc.table); after != before+1 {
				t.Fatalf("%s holds %d rows, want %d", tc.table, after, before+1)
			}
		})
	}
}

// fxStored is what a queue_messages row holds, minus id and times the
// server chooses.
type fxStored struct {
	AppID        uuid.UUID
	Queue        string
	Payload      string
	DeliverAfter *time.Time
	Attempt      int
	MaxAttempts  int
	Principal    *uuid.UUID
	Claimed      bool
}

func (s fxStored) String() string {
	deliver, principal := "NULL", "NULL"
	if s.DeliverAfter != nil {
		deliver = s.DeliverAfter.UTC().Format(time.RFC3339Nano)
	}
	if s.Principal != nil {
		principal = s.Principal.String()
	}
	return fmt.Sprintf("{app %s queue %q payload %s deliver_after %s attempt %d max_attempts %d principal %s claimed %t}",
		s.AppID, s.Queue, s.Payload, deliver, s.Attempt, s.MaxAttempts, principal, s.Claimed)
}

// TestEnqueueSQLFunction checks the enqueue() SQL function: what it
// stores, the max_attempts it takes from the queue's consumer, and the
// SQLSTATE of each error it documents.
func TestEnqueueSQLFunction(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	other := e.app("other")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "policed", MaxAttempts: 7}); err != nil {
		t.Fatal(err)
	}
	const call = `SELECT enqueue($1::uuid, $2::text, $3::jsonb, $4::timestamptz, $5::int, $6::uuid)`

	read := func(t *testing.T, id uuid.UUID) fxStored {
		t.Helper()
		var s fxStored
		err := e.pool.QueryRow(e.ctx, `SELECT app_id, queue_name, payload::text, deliver_after, attempt,
			max_attempts, enqueued_by_principal, claim_token IS NOT NULL FROM queue_messages WHERE id = $1`, id).
			Scan(&s.AppID, &s.Queue, &s.Payload, &s.DeliverAfter, &s.Attempt, &s.MaxAttempts, &s.Principal, &s.Claimed)
		if err != nil {
			t.Fatalf("read message %s: %v", id, err)
		}
		return s
	}
	later := time.Now().Add(time.Hour).Truncate(time.Second)
	happy := []struct {
		name string
		args []any
		want fxStored
	}{
		{
			"no consumer: max_attempts 3",
			[]any{shop.ID, "plain", `{"k": "v"}`, nil, nil, nil},
			fxStored{AppID: shop.ID, Queue: "plain", Payload: `{"k": "v"}`, MaxAttempts: 3},
		},
		{
			"consumer with MaxAttempts 7: max_attempts 7",
			[]any{shop.ID, "policed", `[1, 2]`, nil, nil, nil},
			fxStored{AppID: shop.ID, Queue: "policed", Payload: `[1, 2]`, MaxAttempts: 7},
		},
		{
			"explicit max_attempts wins over the consumer's",
			[]any{shop.ID, "policed", `"s"`, nil, 2, nil},
			fxStored{AppID: shop.ID, Queue: "policed", Payload: `"s"`, MaxAttempts: 2},
		},
		{
			"another app's queue of the same name has no consumer: 3",
			[]any{other.ID, "policed", `null`, nil, nil, nil},
			fxStored{AppID: other.ID, Queue: "policed", Payload: `null`, MaxAttempts: 3},
		},
		{
			"deliver_after and principal are stored",
			[]any{shop.ID, "plain", `{}`, later, nil, shop.DefaultPrincipal},
			fxStored{AppID: shop.ID, Queue: "plain", Payload: `{}`, DeliverAfter: &later, MaxAttempts: 3, Principal: &shop.DefaultPrincipal},
		},
	}
	for _, tc := range happy {
		t.Run(tc.name, func(t *testing.T) {
			before := e.int64("SELECT count(*) FROM queue_messages")
			var id uuid.UUID
			if err := e.pool.QueryRow(e.ctx, call, tc.args...).Scan(&id); err != nil {
				t.Fatalf("enqueue(): %v", err)
			}
			if id == uuid.Nil {
				t.Fatal("enqueue() returned the nil UUID")
			}
			if got := read(t, id).String(); got != tc.want.String() {
				t.Errorf("stored %s\nwant   %s", got, tc.want)
			}
			if after := e.int64("SELECT count(*) FROM queue_messages"); after != before+1 {
				t.Errorf("queue_messages grew from %d to %d rows, want by 1", before, after)
			}
		})
	}

	errorsCases := []struct {
		name  string
		sql   string
		args  []any
		state string
	}{
		{"unknown app", call, []any{uuid.New(), "plain", `{}`, nil, nil, nil}, "BH001"},
		{"NULL app", call, []any{nil, "plain", `{}`, nil, nil, nil}, "BH001"},
		{"empty queue name", call, []any{shop.ID, "", `{}`, nil, nil, nil}, "BH002"},
		{"129-byte queue name", call, []any{shop.ID, strings.Repeat("a", 129), `{}`, nil, nil, nil}, "BH002"},
		{"unicode queue name", call, []any{shop.ID, "naïve", `{}`, nil, nil, nil}, "BH002"},
		{"SQL in queue name", call, []any{shop.ID, "'; DROP TABLE queue_messages; --", `{}`, nil, nil, nil}, "BH002"},
		{"queue name with a space", call, []any{shop.ID, "a b", `{}`, nil, nil, nil}, "BH002"},
		{"NULL queue name", call, []any{shop.ID, nil, `{}`, nil, nil, nil}, "BH002"},
		{"NULL payload", call, []any{shop.ID, "plain", nil, nil, nil, nil}, "BH003"},
		{
			"payload over 1 MiB",
			`SELECT enqueue($1, 'plain', jsonb_build_object('x', repeat('a', 1100000)))`,
			[]any{shop.ID}, "BH003",
		},
		{"max_attempts 0", call, []any{shop.ID, "plain", `{}`, nil, 0, nil}, "BH004"},
		{"max_attempts 1001", call, []any{shop.ID, "plain", `{}`, nil, 1001, nil}, "BH004"},
		// The table refuses infinite times too (0056), but with SQLSTATE
		// 23514: -infinity passed enqueue()'s own checks.
		{"deliver_after -infinity", `SELECT enqueue($1, 'plain', '{}', '-infinity')`, []any{shop.ID}, "BH004"},
		{"deliver_after infinity", `SELECT enqueue($1, 'plain', '{}', 'infinity')`, []any{shop.ID}, "BH004"},
		{"deliver_after 3651 days ahead", `SELECT enqueue($1, 'plain', '{}', now() + interval '3651 days')`, []any{shop.ID}, "BH004"},
		{"deliver_after 87600 hours and a minute ahead", `SELECT enqueue($1, 'plain', '{}', now() + interval '87600 hours 1 minute')`, []any{shop.ID}, "BH004"},
		// 1e131071 prints as 131,072 digits: nine of them pass 1 MiB.
		{"numbers that print past 1 MiB", `SELECT enqueue($1, 'plain', (SELECT ('[' || string_agg('1e131071', ',') || ']')::jsonb FROM generate_series(1, 9)))`, []any{shop.ID}, "BH003"},
		{"principal of another app", call, []any{shop.ID, "plain", `{}`, nil, nil, other.DefaultPrincipal}, "BH005"},
		{"unknown principal", call, []any{shop.ID, "plain", `{}`, nil, nil, uuid.New()}, "BH005"},
	}
	for _, tc := range errorsCases {
		t.Run("raises "+tc.state+" for "+tc.name, func(t *testing.T) {
			before := e.tableState("queue_messages")
			var id uuid.UUID
			err := e.pool.QueryRow(e.ctx, tc.sql, tc.args...).Scan(&id)
			if err == nil {
				t.Fatalf("enqueue() returned %s, want SQLSTATE %s", id, tc.state)
			}
			if pe := fxPgError(t, err); pe.Code != tc.state {
				t.Errorf("SQLSTATE %s (%s), want %s", pe.Code, pe.Message, tc.state)
			}
			if after := e.tableState("queue_messages"); after != before {
				t.Errorf("queue_messages changed: %s, was %s", after, before)
			}
		})
	}

	// The limits are the Go client's: 87600 hours, whatever the session's
	// time zone (days follow its daylight-saving changes), and numbers
	// measured one at a time, before the payload is printed whole, which
	// for a few kilobytes of long numbers built a gigabyte and failed with
	// "out of memory" rather than BH003.
	limits := []struct {
		name, sql, message string
	}{
		{"deliver_after", `SELECT enqueue($1, 'plain', '{}', now() + interval '87600 hours 1 minute')`, "more than 87600 hours ahead"},
		{"numbers", `SELECT enqueue($1, 'plain', (SELECT ('[' || string_agg('1e131071', ',') || ']')::jsonb FROM generate_series(1, 1000)))`,
			"numbers alone print to more than the 1048576-byte limit"},
		// A zero keeps its scale: 0e-16383 prints 16,385 characters.
		{"zeros", `SELECT enqueue($1, 'plain', (SELECT ('[' || string_agg('0e-16383', ',') || ']')::jsonb FROM generate_series(1, 100)))`,
			"numbers alone print to more than the 1048576-byte limit"},
	}
	for _, tc := range limits {
		t.Run("says why for "+tc.name, func(t *testing.T) {
			var id uuid.UUID
			err := e.pool.QueryRow(e.ctx, tc.sql, shop.ID).Scan(&id)
			if pe := fxPgError(t, err); !strings.Contains(pe.Message, tc.message) {
				t.Errorf("enqueue() said %q, want it to say %q", pe.Message, tc.message)
			}
		})
	}
	t.Run("accepts long numbers within the limit", func(t *testing.T) {
		var id uuid.UUID
		if err := e.pool.QueryRow(e.ctx, `SELECT enqueue($1, 'plain', '[1e1000, -1e1000, 1e-1000, 0, 0e-100, 1.5]')`, shop.ID).Scan(&id); err != nil {
			t.Fatalf("enqueue(): %v", err)
		}
		if got := read(t, id).Payload; len(got) < 3000 {
			t.Errorf("stored payload of %d bytes, want the numbers printed in full", len(got))
		}
	})
	t.Run("accepts 87600 hours less a minute", func(t *testing.T) {
		tx, err := e.pool.Begin(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(e.ctx)
		if _, err := tx.Exec(e.ctx, `SET LOCAL TimeZone = 'America/New_York'`); err != nil {
			t.Fatal(err)
		}
		var id uuid.UUID
		if err := tx.QueryRow(e.ctx, `SELECT enqueue($1, 'plain', '{}', now() + interval '87599 hours 59 minutes')`, shop.ID).Scan(&id); err != nil {
			t.Fatalf("enqueue(): %v", err)
		}
	})
	// 3650 days is 87600 hours give or take the hour of a daylight-saving
	// change between now and then in the session's time zone. A POSIX
	// time zone whose yearly change falls between today's date and that
	// of 3650 days on (two or three days earlier in the year) makes the
	// two differ whatever today is: the limit is the hours, both ways.
	for _, shift := range []int{3600, -3600} {
		t.Run(fmt.Sprintf("limit is 87600 hours where 3650 days are it %+ds", shift), func(t *testing.T) {
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(e.ctx)
			zone := ""
			for n := 1; n <= 365 && zone == ""; n++ {
				z := fmt.Sprintf("AAA5BBB,J%d,J%d", n, (n+181)%365+1)
				var diff int
				if err := tx.QueryRow(e.ctx, `SELECT extract(epoch FROM (now() + interval '3650 days') - (now() + interval '87600 hours'))::int
					FROM set_config('TimeZone', $1, true)`, z).Scan(&diff); err != nil {
					t.Fatal(err)
				}
				if diff == shift {
					zone = z
				}
			}
			if zone == "" {
				t.Fatalf("no POSIX time zone AAA5BBB,Jn,Jm makes 3650 days %+ds more than 87600 hours", shift)
			}
			var id uuid.UUID
			if err := tx.QueryRow(e.ctx, `SELECT enqueue($1, 'plain', '{}', now() + interval '87599 hours 30 minutes')`, shop.ID).Scan(&id); err != nil {
				t.Fatalf("TimeZone %s: enqueue() 87600 hours less half an hour ahead: %v", zone, err)
			}
			err = tx.QueryRow(e.ctx, `SELECT enqueue($1, 'plain', '{}', now() + interval '87600 hours 30 minutes')`, shop.ID).Scan(&id)
			if err == nil {
				t.Fatalf("TimeZone %s: enqueue() accepted 87600 hours and half an hour ahead", zone)
			}
			if pe := fxPgError(t, err); pe.Code != "BH004" {
				t.Errorf("TimeZone %s: SQLSTATE %s (%s), want BH004", zone, pe.Code, pe.Message)
			}
		})
	}
}

// TestPayloadSizeCheckedOnWrite: the payload's size rule is checked when
// a payload is written, by any role and in replica mode too, and not when
// an UPDATE leaves the payload alone. As a CHECK constraint (0038) it was
// checked on every UPDATE, printing the whole payload to measure it at
// every claim, extend, nack, release and reclaim (0062). A row over the
// limit, written with the trigger disabled, shows which: its claim
// succeeds, and only a write of its payload is refused.
func TestPayloadSizeCheckedOnWrite(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	app := e.app("shop")
	_, con := e.appConsumer("hooks", "q")
	const big = `jsonb_build_object('x', repeat('a', 1100000))`
	wantRefused := func(t *testing.T, err error, constraint string) {
		t.Helper()
		if err == nil {
			t.Fatal("the write succeeded, want a check violation")
		}
		if pe := fxPgError(t, err); pe.Code != "23514" || pe.ConstraintName != constraint {
			t.Errorf("SQLSTATE %s, constraint %q (%s); want 23514, %q", pe.Code, pe.ConstraintName, pe.Message, constraint)
		}
	}
	tables := []struct {
		table, trigger, constraint, insert string
		args                               []any
	}{
		{"queue_messages", "queue_messages_payload_size", "queue_messages_payload_size_check",
			`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', ` + big + `) RETURNING id`,
			[]any{app.ID}},
		{"outbox", "outbox_payload_size", "outbox_payload_size_check",
			`INSERT INTO outbox (app_id, source_kind, trigger_id, payload) SELECT app_id, 'invoke', id, ` + big + `
			 FROM triggers WHERE id = $1 RETURNING id`,
			[]any{con.ID}},
	}
	for _, tc := range tables {
		t.Run(tc.table, func(t *testing.T) {
			_, err := e.pool.Exec(e.ctx, tc.insert, tc.args...)
			wantRefused(t, err, tc.constraint)

			conn, err := e.pool.Acquire(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Release()
			if _, err := conn.Exec(e.ctx, `SET session_replication_role = replica`); err != nil {
				t.Fatal(err)
			}
			_, err = conn.Exec(e.ctx, tc.insert, tc.args...)
			wantRefused(t, err, tc.constraint)
			if _, err := conn.Exec(e.ctx, `RESET session_replication_role`); err != nil {
				t.Fatal(err)
			}

			if _, err := e.pool.Exec(e.ctx, `ALTER TABLE `+tc.table+` DISABLE TRIGGER `+tc.trigger); err != nil {
				t.Fatal(err)
			}
			var id uuid.UUID
			err = e.pool.QueryRow(e.ctx, tc.insert, tc.args...).Scan(&id)
			if _, err := e.pool.Exec(e.ctx, `ALTER TABLE `+tc.table+` ENABLE ALWAYS TRIGGER `+tc.trigger); err != nil {
				t.Fatal(err)
			}
			if err != nil {
				t.Fatalf("insert with the trigger disabled: %v", err)
			}
			if _, err := e.pool.Exec(e.ctx, `UPDATE `+tc.table+` SET claim_token = gen_random_uuid(), claimed_at = now(),
				attempt = attempt + 1 WHERE id = $1`, id); err != nil {
				t.Errorf("a claim of a row over the limit: %v, want it to succeed (the payload is not written)", err)
			}
			_, err = e.pool.Exec(e.ctx, `UPDATE `+tc.table+` SET payload = payload || '{}' WHERE id = $1`, id)
			wantRefused(t, err, tc.constraint)
		})
	}
}

// TestDepthAndQueueList builds a known set of ready, delayed, in-flight
// and dead messages and checks depth(), depth_pending() and the
// queue_list view as Client.Queues returns it.
func TestDepthAndQueueList(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	other := e.app("other")

	// shop/orders. Tags name the rows; enqueued_at is set so that the
	// oldest ready message is known.
	e.exec(`
		INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after)
		SELECT $1, 'orders', jsonb_build_object('tag', tag), now() + enq, now() + del
		FROM (VALUES
		    ('ready-1',   interval '-1 hour',    NULL::interval),  -- ready for 1h: the oldest ready
		    ('ready-2',   interval '-10 minutes', NULL),
		    ('ready-3',   interval '-2 hours',   interval '-5 minutes'), -- ready since 5 minutes
		    ('ready-4',   interval '0',          NULL),
		    ('delayed-1', interval '-5 hours',   interval '1 hour'),
		    ('delayed-2', interval '0',          interval '1 day'),
		    ('claimed-1', interval '-3 hours',   NULL),
		    ('claimed-2', interval '-4 hours',   interval '-1 hour')
		) AS v(tag, enq, del)`, shop.ID)
	// A far-past deliver_after is ready too.
	e.exec(`UPDATE queue_messages SET deliver_after = '1900-01-01T00:00:00Z' WHERE payload->>'tag' = 'ready-4'`)
	// Claim two, as a dispatcher does.
	e.exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = attempt + 1
		WHERE payload->>'tag' IN ('claimed-1', 'claimed-2')`)
	deadLetter := func(app uuid.UUID, queue, source string) {
		e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
			VALUES (gen_random_uuid(), $3, $1, $2, '{}', now() - interval '1 day', 3, 3, 'boom')`, app, queue, source)
	}
	deadLetter(shop.ID, "orders", "queue")
	deadLetter(shop.ID, "orders", "queue")
	deadLetter(shop.ID, "orders", "invoke") // its consumer's: counted, as dead ls --queue lists it (0057)
	deadLetter(shop.ID, "graveyard", "queue")
	// orders has a paused consumer, idle an enabled one and no messages.
	orders, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.client.SetConsumerEnabled(e.ctx, "shop", orders.ID, false); err != nil {
		t.Fatal(err)
	}
	idle, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "idle"})
	if err != nil {
		t.Fatal(err)
	}
	// other/orders: same queue name in another app, 1 ready and 1 in flight.
	e.exec(`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '1'), ($1, 'orders', '2')`, other.ID)
	e.exec(`UPDATE queue_messages SET claim_token = gen_random_uuid(), claimed_at = now()
		WHERE app_id = $1 AND payload = '2'`, other.ID)

	depths := []struct {
		name           string
		app            uuid.UUID
		queue          string
		depth, pending int64
	}{
		{"shop/orders", shop.ID, "orders", 8, 4},
		{"shop/graveyard", shop.ID, "graveyard", 0, 0},
		{"shop/idle", shop.ID, "idle", 0, 0},
		{"shop/nonesuch", shop.ID, "nonesuch", 0, 0},
		{"other/orders", other.ID, "orders", 2, 1},
		{"unknown app", uuid.New(), "orders", 0, 0},
	}
	for _, d := range depths {
		t.Run("depth of "+d.name, func(t *testing.T) {
			if got := e.int64("SELECT depth($1, $2)", d.app, d.queue); got != d.depth {
				t.Errorf("depth = %d, want %d", got, d.depth)
			}
			if got := e.int64("SELECT depth_pending($1, $2)", d.app, d.queue); got != d.pending {
				t.Errorf("depth_pending = %d, want %d", got, d.pending)
			}
		})
	}

	t.Run("queue_list of shop", func(t *testing.T) {
		got, err := e.client.Queues(e.ctx, "shop")
		if err != nil {
			t.Fatal(err)
		}
		idleID, ordersID := idle.ID, orders.ID
		want := []bellhop.QueueInfo{
			{App: "shop", Queue: "graveyard", Dead: 1},
			{App: "shop", Queue: "idle", ConsumerID: &idleID, ConsumerEnabled: true},
			{App: "shop", Queue: "orders", Ready: 4, Delayed: 2, InFlight: 2, Dead: 3, ConsumerID: &ordersID, ConsumerEnabled: false},
		}
		if len(got) != len(want) {
			t.Fatalf("Queues(shop) = %+v, want %d rows", got, len(want))
		}
		for i := range want {
			g, w := got[i], want[i]
			if g.App != w.App || g.Queue != w.Queue || g.Ready != w.Ready || g.Delayed != w.Delayed ||
				g.InFlight != w.InFlight || g.Dead != w.Dead || g.ConsumerEnabled != w.ConsumerEnabled ||
				(g.ConsumerID == nil) != (w.ConsumerID == nil) || (g.ConsumerID != nil && *g.ConsumerID != *w.ConsumerID) {
				t.Errorf("row %d: got %+v, want %+v", i, g, w)
			}
		}
		// Oldest ready: ready-1, enqueued an hour before the setup.
		if o := got[2].OldestReady; o < time.Hour-time.Millisecond || o > time.Hour+time.Minute {
			t.Errorf("orders OldestReady = %s, want about 1h", o)
		}
		for _, q := range got[:2] {
			if q.OldestReady != 0 {
				t.Errorf("%s OldestReady = %s, want 0 (no ready message)", q.Queue, q.OldestReady)
			}
		}
	})

	t.Run("queue_list of every app", func(t *testing.T) {
		got, err := e.client.Queues(e.ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, q := range got {
			names = append(names, q.App+"/"+q.Queue)
			if q.App == "other" && (q.Ready != 1 || q.Delayed != 0 || q.InFlight != 1 || q.Dead != 0 || q.ConsumerID != nil) {
				t.Errorf("other/orders = %+v, want 1 ready, 1 in flight, nothing else", q)
			}
		}
		want := []string{"other/orders", "shop/graveyard", "shop/idle", "shop/orders"}
		if !slices.Equal(names, want) {
			t.Errorf("Queues(\"\") lists %q, want %q", names, want)
		}
	})
}
