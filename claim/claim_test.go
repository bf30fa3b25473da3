package claim_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	queries "github.com/bellhopq/bellhop/sql"
)

// setup returns a pool on a fresh database holding app "app" and a
// client on the pool.
func setup(t *testing.T) (*pgxpool.Pool, *bellhop.Client, uuid.UUID) {
	t.Helper()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	app, err := c.CreateApp(context.Background(), "app")
	if err != nil {
		t.Fatal(err)
	}
	return pool, c, app.ID
}

// TestClaimPlan: the claim statements find ready messages through their
// dispatch partial indexes, never by scanning the table, whether the
// server plans them with the values (a custom plan) or once for any
// values (the generic plan a cached prepared statement can switch to).
func TestClaimPlan(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	other, err := client.CreateApp(ctx, "other")
	if err != nil {
		t.Fatal(err)
	}
	var consumers []uuid.UUID
	for q := range 20 {
		c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: fmt.Sprintf("q%d", q)})
		if err != nil {
			t.Fatal(err)
		}
		consumers = append(consumers, c.ID)
	}
	// 40,000 messages over two apps and 20 queues: a tenth delayed, a
	// seventh in flight; and 20,000 invoke deliveries over 20 consumers.
	if _, err := pool.Exec(ctx, `
		INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after, claim_token, claimed_at, attempt)
		SELECT CASE WHEN g % 2 = 0 THEN $1::uuid ELSE $2::uuid END, 'q' || (g % 20), jsonb_build_object('g', g),
		       now() - g * interval '1 ms',
		       CASE WHEN g % 10 = 0 THEN now() + interval '1 hour' END,
		       CASE WHEN g % 7 = 0 THEN gen_random_uuid() END,
		       CASE WHEN g % 7 = 0 THEN now() END,
		       CASE WHEN g % 7 = 0 THEN 1 ELSE 0 END
		FROM generate_series(1, 40000) g`, appID, other.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox (app_id, source_kind, trigger_id, payload, enqueued_at, claim_token, claimed_at, attempt)
		SELECT $1::uuid, 'invoke', ($2::uuid[])[1 + g % 20], jsonb_build_object('g', g), now() - g * interval '1 ms',
		       CASE WHEN g % 7 = 0 THEN gen_random_uuid() END,
		       CASE WHEN g % 7 = 0 THEN now() END,
		       CASE WHEN g % 7 = 0 THEN 1 ELSE 0 END
		FROM generate_series(1, 20000) g`, appID, consumers); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE queue_messages; ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}

	statements := []struct {
		name, sql, index string
		types            string            // PREPARE's parameter types, in $n order
		params           map[string]string // @name -> $n
		values           map[string]string // @name -> literal
	}{
		{
			name: "claim_queue.sql", sql: queries.ClaimQueue, index: "idx_queue_messages_dispatch",
			types:  "uuid, text, int",
			params: map[string]string{"@app_id": "$1", "@queue_name": "$2", "@max_messages": "$3"},
			values: map[string]string{"@app_id": "'" + appID.String() + "'", "@queue_name": "'q7'", "@max_messages": "10"},
		},
		{
			name: "claim_invoke.sql", sql: queries.ClaimInvoke, index: "idx_outbox_dispatch",
			types:  "uuid, int",
			params: map[string]string{"@trigger_id": "$1", "@max_messages": "$2"},
			values: map[string]string{"@trigger_id": "'" + consumers[7].String() + "'", "@max_messages": "10"},
		},
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	defer conn.Exec(ctx, "RESET plan_cache_mode; DEALLOCATE ALL")
	for i, st := range statements {
		literal := substitute(t, st.sql, st.values)
		prepared := substitute(t, st.sql, st.params)
		var args []string
		for _, k := range sortedByParam(st.params) {
			args = append(args, st.values[k])
		}
		name := fmt.Sprintf("claim_plan_%d", i)
		if _, err := conn.Exec(ctx, fmt.Sprintf("PREPARE %s (%s) AS %s", name, st.types, prepared)); err != nil {
			t.Fatalf("%s: prepare: %v", st.name, err)
		}
		explainExecute := fmt.Sprintf("EXPLAIN EXECUTE %s (%s)", name, strings.Join(args, ", "))
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
				if !strings.Contains(plan, st.index) {
					t.Errorf("plan does not use %s:\n%s", st.index, plan)
				}
				if strings.Contains(plan, "Seq Scan") {
					t.Errorf("plan scans a table:\n%s", plan)
				}
				// The index returns enqueued_at order: a sort would read
				// every ready message of the queue to claim the first few.
				if strings.Contains(plan, "Sort") {
					t.Errorf("plan sorts instead of reading the index in order:\n%s", plan)
				}
				if t.Failed() || testing.Verbose() {
					t.Logf("plan:\n%s", plan)
				}
			})
		}
	}
}

// substitute replaces every @name of sql by its value, and checks that
// no named argument is left.
func substitute(t *testing.T, sql string, values map[string]string) string {
	t.Helper()
	for k, v := range values {
		if !strings.Contains(sql, k) {
			t.Fatalf("statement has no %s", k)
		}
		sql = strings.ReplaceAll(sql, k, v)
	}
	if strings.Contains(sql, "@") {
		t.Fatalf("named argument left in:\n%s", sql)
	}
	return sql
}

// sortedByParam returns the keys of params in $n order.
func sortedByParam(params map[string]string) []string {
	keys := make([]string, len(params))
	for k, v := range params {
		var n int
		fmt.Sscanf(v, "$%d", &n)
		keys[n-1] = k
	}
	return keys
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
