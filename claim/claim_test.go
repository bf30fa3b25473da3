package claim_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgtest"
	queries "github.com/bellhopq/bellhop/sql"
)

// setup returns a pool on a fresh database holding app "app" and a
// client on the pool.
func setup(t testing.TB) (*pgxpool.Pool, *bellhop.Client, uuid.UUID) {
	t.Helper()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	app, err := c.CreateApp(context.Background(), "app")
	if err != nil {
		t.Fatal(err)
	}
	return pool, c, app.ID
}

// TestClaimPlan: the claim-pass statements find messages through their
// partial indexes of ready and of delayed messages (0064), never by
// scanning the table, whether the
// server plans them with the values (a custom plan) or once for any
// values (the generic plan that ClaimPass asks for). Two shapes of data:
// messages spread over many queues, and one queue holding everything,
// where the planner expects a generic claim to lock a tenth of the table
// (LIMIT with a parameter) and a semi-join form of the claim hashed the
// whole table (4 times slower in BenchmarkClaim).
func TestClaimPlan(t *testing.T) {
	shapes := []struct {
		name           string
		queues, apps   int
		delayed, taken int // every delayed-th message is delayed, every taken-th in flight
	}{
		{name: "spread", queues: 20, apps: 2, delayed: 10, taken: 7},
		{name: "one queue", queues: 1, apps: 1, delayed: 100, taken: 50},
	}
	for _, shape := range shapes {
		t.Run(shape.name, func(t *testing.T) {
			ctx := context.Background()
			pool, client, appID := setup(t)
			other, err := client.CreateApp(ctx, "other")
			if err != nil {
				t.Fatal(err)
			}
			var consumers []uuid.UUID
			for q := range shape.queues {
				c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: fmt.Sprintf("q%d", q)})
				if err != nil {
					t.Fatal(err)
				}
				consumers = append(consumers, c.ID)
			}
			// 40,000 messages and 20,000 invoke deliveries.
			if _, err := pool.Exec(ctx, `
				INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after, claim_token, claimed_at, attempt)
				SELECT CASE WHEN g % $3 = 0 THEN $1::uuid ELSE $2::uuid END, 'q' || (g % $4), jsonb_build_object('g', g),
				       now() - g * interval '1 ms',
				       CASE WHEN g % $5 = 0 THEN now() + interval '1 hour' END,
				       CASE WHEN g % $6 = 0 THEN gen_random_uuid() END,
				       CASE WHEN g % $6 = 0 THEN now() END,
				       CASE WHEN g % $6 = 0 THEN 1 ELSE 0 END
				FROM generate_series(1, 40000) g`, appID, other.ID, shape.apps, shape.queues, shape.delayed, shape.taken); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `
				INSERT INTO outbox (app_id, source_kind, trigger_id, payload, enqueued_at, claim_token, claimed_at, attempt)
				SELECT $1::uuid, 'invoke', ($2::uuid[])[1 + g % cardinality($2::uuid[])], jsonb_build_object('g', g), now() - g * interval '1 ms',
				       CASE WHEN g % $3 = 0 THEN gen_random_uuid() END,
				       CASE WHEN g % $3 = 0 THEN now() END,
				       CASE WHEN g % $3 = 0 THEN 1 ELSE 0 END
				FROM generate_series(1, 20000) g`, appID, consumers, shape.taken); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `ANALYZE queue_messages; ANALYZE outbox`); err != nil {
				t.Fatal(err)
			}
			q := len(consumers) - 1
			app := "'" + appID.String() + "'"
			queue := fmt.Sprintf("'q%d'", q)
			consumer := "'" + consumers[q].String() + "'"
			// A combined pass for two queues: the last one, and one of the
			// other app's (in the one-queue shape, an empty one).
			apps := fmt.Sprintf("'{%s,%s}'", appID, other.ID)
			queues := fmt.Sprintf("'{q%d,q0}'", q)
			consumers2 := fmt.Sprintf("'{%s,%s}'", consumers[q], consumers[0])
			// Settling: one message of each table, by id and token.
			var qID, qToken, oID, oToken uuid.UUID
			if err := pool.QueryRow(ctx, `SELECT (SELECT id FROM queue_messages WHERE claim_token IS NOT NULL LIMIT 1),
				(SELECT claim_token FROM queue_messages WHERE claim_token IS NOT NULL LIMIT 1),
				(SELECT id FROM outbox WHERE claim_token IS NOT NULL LIMIT 1),
				(SELECT claim_token FROM outbox WHERE claim_token IS NOT NULL LIMIT 1)`).Scan(&qID, &qToken, &oID, &oToken); err != nil {
				t.Fatal(err)
			}
			ids := func(u uuid.UUID) string { return "'{" + u.String() + "}'" }
			settle := []planArg{{"q_ids", "uuid[]", ids(qID)}, {"q_tokens", "uuid[]", ids(qToken)}}
			outbox := []planArg{{"o_ids", "uuid[]", ids(oID)}, {"o_tokens", "uuid[]", ids(oToken)}}
			pkeys := []string{"queue_messages_pkey", "outbox_pkey"}
			checkPlans(t, pool, []planCase{
				{name: "claim_queue.sql", sql: queries.ClaimQueue, indexes: []string{"idx_queue_messages_ready", "idx_queue_messages_delayed", "queue_messages_pkey"},
					args: []planArg{{"app_id", "uuid", app}, {"queue_name", "text", queue}, {"max_messages", "int", "10"}}},
				{name: "claim_queues.sql", sql: queries.ClaimQueues, indexes: []string{"idx_queue_messages_ready", "idx_queue_messages_delayed", "queue_messages_pkey"},
					args: []planArg{{"app_ids", "uuid[]", apps}, {"queue_names", "text[]", queues}, {"max_messages", "int[]", "'{10,10}'"}}},
				{name: "claim_invoke.sql", sql: queries.ClaimInvoke, indexes: []string{"idx_outbox_ready", "idx_outbox_delayed", "outbox_pkey"},
					args: []planArg{{"trigger_id", "uuid", consumer}, {"max_messages", "int", "10"}}},
				{name: "next_due_queue.sql", sql: queries.NextDueQueue, indexes: []string{"idx_queue_messages_ready", "idx_queue_messages_delayed"},
					args: []planArg{{"app_id", "uuid", app}, {"queue_name", "text", queue}, {"owner", "uuid", "'" + uuid.NewString() + "'"},
						{"held", "bool", "true"}, {"lease_ms", "int", "30000"}, {"consumer_id", "uuid", consumer}}},
				{name: "next_due_queues.sql", sql: queries.NextDueQueues, indexes: []string{"idx_queue_messages_ready", "idx_queue_messages_delayed"},
					args: []planArg{{"app_ids", "uuid[]", apps}, {"queue_names", "text[]", queues}, {"consumer_ids", "uuid[]", consumers2},
						{"held", "bool[]", "'{true,false}'"}, {"owner", "uuid", "'" + uuid.NewString() + "'"}, {"lease_ms", "int", "30000"}}},
				{name: "next_due_invoke.sql", sql: queries.NextDueInvoke, indexes: []string{"idx_outbox_ready", "idx_outbox_delayed"},
					args: []planArg{{"trigger_id", "uuid", consumer}}},
				{name: "ack.sql", sql: queries.Ack, indexes: pkeys, args: slices.Concat(settle, outbox)},
				{name: "nack.sql", sql: queries.Nack, indexes: pkeys, args: slices.Concat(
					settle, []planArg{{"q_delays_ms", "bigint[]", "'{1000}'"}, {"q_holds_ms", "bigint[]", "'{0}'"}},
					outbox, []planArg{{"o_delays_ms", "bigint[]", "'{1000}'"}, {"o_holds_ms", "bigint[]", "'{0}'"}})},
				{name: "dead_letter.sql", sql: queries.DeadLetter, indexes: pkeys, args: slices.Concat(settle,
					[]planArg{{"q_errors", "text[]", "'{boom}'"}, {"q_holds_ms", "bigint[]", "'{0}'"}},
					outbox, []planArg{{"o_errors", "text[]", "'{boom}'"}, {"o_queue_names", "text[]", "'{q}'"}, {"o_holds_ms", "bigint[]", "'{0}'"}})},
				// Its sort is of the queues to wake, at most one per message.
				{name: "release.sql", sql: queries.Release, indexes: pkeys, sorts: true, args: slices.Concat(
					settle, []planArg{{"q_holds_ms", "bigint[]", "'{0}'"}}, outbox, []planArg{{"o_holds_ms", "bigint[]", "'{0}'"}})},
			})
		})
	}
}

// planCase is a statement whose plans checkPlans checks.
type planCase struct {
	name, sql string
	indexes   []string  // indexes every plan must use
	sorts     bool      // whether a plan may sort
	args      []planArg // every @name of sql, in the order PREPARE numbers them
}

// planArg is one named argument of a planCase.
type planArg struct{ name, typ, value string }

// checkPlans checks that each statement's plans, with literal values, as
// a custom plan and as a generic plan, use its indexes, never scan a
// table and (unless allowed) never sort.
func checkPlans(t *testing.T, pool *pgxpool.Pool, statements []planCase) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	defer conn.Exec(ctx, "RESET plan_cache_mode; DEALLOCATE ALL")
	for i, st := range statements {
		name := fmt.Sprintf("claim_plan_%d", i)
		literal, values := prepare(t, conn.Conn(), name, st)
		explainExecute := fmt.Sprintf("EXPLAIN EXECUTE %s (%s)", name, strings.Join(values, ", "))
		for _, c := range []struct{ name, mode, explain string }{
			{"literal values", "auto", "EXPLAIN " + literal},
			{"prepared, custom plan", "force_custom_plan", explainExecute},
			{"prepared, generic plan", "force_generic_plan", explainExecute},
		} {
			t.Run(st.name+"/"+c.name, func(t *testing.T) {
				if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+c.mode); err != nil {
					t.Fatal(err)
				}
				plan := explain(t, conn.Conn(), c.explain)
				for _, index := range st.indexes {
					if !strings.Contains(plan, index) {
						t.Errorf("plan does not use %s:\n%s", index, plan)
					}
				}
				if strings.Contains(plan, "Seq Scan") {
					t.Errorf("plan scans a table:\n%s", plan)
				}
				// Each index returns its walk's order: a sort below its
				// LIMIT would read every ready message of the queue to
				// claim the first few. A claim sorts only the candidates
				// of its two walks (ready_at), at most twice its LIMIT.
				for _, line := range strings.Split(plan, "\n") {
					if _, key, ok := strings.Cut(line, "Sort Key: "); ok && !st.sorts && !strings.HasSuffix(key, ".ready_at") {
						t.Errorf("plan sorts instead of reading the index in order:\n%s", plan)
						break
					}
				}
				if t.Failed() || testing.Verbose() {
					t.Logf("plan:\n%s", plan)
				}
			})
		}
	}
}

// prepare prepares st's statement as name, and returns it with st's
// literal values in place of its arguments, and those values in the
// order of the prepared statement's parameters.
func prepare(t *testing.T, conn *pgx.Conn, name string, st planCase) (literal string, values []string) {
	t.Helper()
	literal, prepared := st.sql, st.sql
	var types []string
	for n, a := range st.args {
		if !strings.Contains(st.sql, "@"+a.name) {
			t.Fatalf("%s has no @%s", st.name, a.name)
		}
		literal = strings.ReplaceAll(literal, "@"+a.name, a.value)
		prepared = strings.ReplaceAll(prepared, "@"+a.name, fmt.Sprintf("$%d", n+1))
		types = append(types, a.typ)
		values = append(values, a.value)
	}
	if strings.Contains(literal, "@") {
		t.Fatalf("%s: named argument left in:\n%s", st.name, literal)
	}
	if _, err := conn.Exec(context.Background(), fmt.Sprintf("PREPARE %s (%s) AS %s", name, strings.Join(types, ", "), prepared)); err != nil {
		t.Fatalf("%s: prepare: %v", st.name, err)
	}
	return literal, values
}

func explain(t *testing.T, conn *pgx.Conn, sql string) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), sql, pgx.QueryExecModeSimpleProtocol)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return strings.Join(lines, "\n")
}

// TestClaimPassGenericPlans: a claim pass and a settlement run their
// statements with their generic plans, planned once per session rather
// than on every call, and the setting ends with their transactions.
func TestClaimPassGenericPlans(t *testing.T) {
	ctx := context.Background()
	shared, client, appID := setup(t)
	c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q"})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(shared.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // every pass and the checks below on one session
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	targets := []claim.Target{
		{Source: claim.Queue, AppID: appID, Queue: "q", TriggerID: c.ID},
		{Source: claim.Invoke, AppID: appID, TriggerID: c.ID},
	}
	const passes = 8 // more than the 5 custom plans the server tries first
	for i := range passes {
		if _, err := client.Enqueue(ctx, "app", "q", []byte(fmt.Sprintf(`{"n":%d}`, i)), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
		for _, tg := range targets {
			p, err := claim.ClaimPass(ctx, pool, tg, 1, claim.Busy{Owner: uuid.New(), Mark: i%2 == 0, Lease: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			if tg.Source == claim.Queue {
				if len(p.Messages) != 1 {
					t.Fatalf("pass %d claimed %d messages, want 1", i, len(p.Messages))
				}
				applied, err := claim.Write(ctx, pool, []claim.Outcome{{Message: &p.Messages[0], Verdict: claim.Ack}})
				if err != nil || !applied.Has(&p.Messages[0]) {
					t.Fatalf("ack of pass %d: applied %v, %v", i, applied, err)
				}
			}
		}
		// A combined pass, for q and a queue with nothing in it.
		busy := claim.Busy{Owner: uuid.New(), Lease: time.Minute}
		if _, err := claim.ClaimPasses(ctx, pool, []claim.Request{
			{Target: targets[0], Max: 1, Busy: busy}, {Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: "empty"}, Max: 1, Busy: busy},
		}); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := pool.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements`)
	if err != nil {
		t.Fatal(err)
	}
	watched := []struct{ name, sql string }{
		{"claim_queue.sql", queries.ClaimQueue}, {"next_due_queue.sql", queries.NextDueQueue},
		{"claim_queues.sql", queries.ClaimQueues}, {"next_due_queues.sql", queries.NextDueQueues},
		{"claim_invoke.sql", queries.ClaimInvoke}, {"next_due_invoke.sql", queries.NextDueInvoke},
		{"busy_mark.sql", queries.BusyMark}, {"ack.sql", queries.Ack},
	}
	type stats struct{ generic, custom int64 }
	seen := map[string]stats{}
	for rows.Next() {
		var stmt string
		var s stats
		if err := rows.Scan(&stmt, &s.generic, &s.custom); err != nil {
			t.Fatal(err)
		}
		for _, want := range watched {
			// pgx sends the text with $n for @name; the comments lead both.
			if strings.HasPrefix(stmt, want.sql[:strings.Index(want.sql, "\n")]) {
				seen[want.name] = s
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, w := range watched {
		name := w.name
		s, ok := seen[name]
		switch {
		case !ok:
			t.Errorf("%s: not among the session's prepared statements", name)
		case s.custom != 0 || s.generic == 0:
			t.Errorf("%s: %d generic and %d custom plans, want only generic ones", name, s.generic, s.custom)
		}
	}
	var mode string
	if err := pool.QueryRow(ctx, "SHOW plan_cache_mode").Scan(&mode); err != nil {
		t.Fatal(err)
	}
	if mode != "auto" {
		t.Errorf("plan_cache_mode after the passes is %q, want auto: it leaked out of the claim pass", mode)
	}
}

// TestClaimPassesReportBusyKeyWithoutRow: a combined pass
// (next_due_queues.sql) reports a queue whose busy key another session
// holds, with no queue_busy row, as a foreign lease ending Lease from now,
// as a one-queue pass does: a dispatcher that took the key and died, or
// hung, before writing its row leaves producers silent, and only this
// tells the others to watch the queue. The queue beside it, whose key is
// free, and a key the passing dispatcher says it holds itself, report
// none.
func TestClaimPassesReportBusyKeyWithoutRow(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	var targets []claim.Target
	for _, q := range []string{"held", "free"} {
		c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		targets = append(targets, claim.Target{Source: claim.Queue, AppID: appID, Queue: q, TriggerID: c.ID})
	}
	other, err := pgx.Connect(ctx, pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	var held bool
	err = other.QueryRow(ctx, queries.BusyHold, pgx.NamedArgs{
		"app_id": appID, "queue_name": "held", "owner": uuid.New(), "idle_ms": int64(0), "holding": false,
	}).Scan(new(bool), &held, new(int64))
	if err != nil || !held {
		t.Fatalf("hold the busy key: held %v, %v", held, err)
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM queue_busy").Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("%d queue_busy rows (%v); the test needs none", rows, err)
	}

	const lease = time.Minute
	for _, selfHeld := range []bool{false, true} {
		before := time.Now()
		busy := claim.Busy{Owner: uuid.New(), Lease: lease}
		ps, err := claim.ClaimPasses(ctx, pool, []claim.Request{
			{Target: targets[0], Max: 1, Busy: claim.Busy{Owner: busy.Owner, Lease: lease, Held: selfHeld}},
			{Target: targets[1], Max: 1, Busy: busy},
		})
		if err != nil {
			t.Fatal(err)
		}
		got := ps[0].ForeignLease
		switch {
		case selfHeld && !got.IsZero():
			t.Errorf("key held by the passing dispatcher itself: foreign lease %v, want none", got)
		case !selfHeld && (got.Before(before.Add(lease-5*time.Second)) || got.After(time.Now().Add(lease+5*time.Second))):
			t.Errorf("key held by another session: foreign lease %v (%s from the pass), want about %s from the pass", got, got.Sub(before), lease)
		}
		if f := ps[1].ForeignLease; !f.IsZero() {
			t.Errorf("free key (held %v beside it): foreign lease %v, want none", selfHeld, f)
		}
	}
}

// TestInvokePassReportsReadyLeft: an invoke pass (next_due_invoke.sql)
// says whether ready, unclaimed deliveries of its consumer remain after
// the claim, as the lane needs to look again for rows a dying claim would
// leave unannounced, and to stop looking once none remain. One left
// beside a full claim counts, and so does one another transaction holds
// locked, which the claim skips; delayed deliveries, claimed ones and
// another consumer's ready ones do not.
func TestInvokePassReportsReadyLeft(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	var cons []bellhop.Consumer
	for _, q := range []string{"q", "other"} {
		c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		cons = append(cons, c)
	}
	invoke := func(c bellhop.Consumer, opts bellhop.EnqueueOptions) uuid.UUID {
		t.Helper()
		id, err := client.InvokeAsync(ctx, c.ID, []byte(`1`), opts)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	target := claim.Target{Source: claim.Invoke, AppID: appID, TriggerID: cons[0].ID}
	pass := func(what string, wantMsgs int, wantLeft bool) {
		t.Helper()
		p, err := claim.ClaimPass(ctx, pool, target, 1, claim.Busy{})
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Messages) != wantMsgs || p.ReadyLeft != wantLeft {
			t.Fatalf("%s: claimed %d, ReadyLeft %v; want %d, %v", what, len(p.Messages), p.ReadyLeft, wantMsgs, wantLeft)
		}
	}
	// Never ready during the test, whatever else happens.
	invoke(cons[0], bellhop.EnqueueOptions{Delay: time.Hour})
	invoke(cons[1], bellhop.EnqueueOptions{})
	invoke(cons[0], bellhop.EnqueueOptions{})
	invoke(cons[0], bellhop.EnqueueOptions{})
	pass("two ready, one slot", 1, true)
	pass("the last ready one", 1, false)

	locked := invoke(cons[0], bellhop.EnqueueOptions{})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox WHERE id = $1 FOR UPDATE`, locked); err != nil {
		t.Fatal(err)
	}
	pass("the one ready delivery locked by another transaction", 0, true)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pass("the delivery, once free", 1, false)
}
