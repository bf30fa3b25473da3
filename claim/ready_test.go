package claim_test

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	queries "github.com/bellhopq/bellhop/sql"
)

// readyRow is a message (or invoke delivery) written straight into its
// table: enqueued ago before now, and, unless zero, due due from now.
type readyRow struct {
	name     string
	ago, due time.Duration
	hasDue   bool
}

// insertRows writes rows for target and returns their ids by name.
func insertRows(t *testing.T, pool *pgxpool.Pool, target claim.Target, rows []readyRow) map[uuid.UUID]string {
	t.Helper()
	names := make(map[uuid.UUID]string)
	for _, r := range rows {
		var due *string
		if r.hasDue {
			s := fmt.Sprintf("%d milliseconds", r.due.Milliseconds())
			due = &s
		}
		var id uuid.UUID
		var err error
		if target.Source == claim.Invoke {
			err = pool.QueryRow(context.Background(), `
				INSERT INTO outbox (app_id, source_kind, trigger_id, payload, enqueued_at, deliver_after)
				VALUES ($1, 'invoke', $2, '{}', now() - $3 * interval '1 millisecond', now() + $4::interval)
				RETURNING id`, target.AppID, target.TriggerID, r.ago.Milliseconds(), due).Scan(&id)
		} else {
			err = pool.QueryRow(context.Background(), `
				INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after)
				VALUES ($1, $2, '{}', now() - $3 * interval '1 millisecond', now() + $4::interval)
				RETURNING id`, target.AppID, target.Queue, r.ago.Milliseconds(), due).Scan(&id)
		}
		if err != nil {
			t.Fatal(err)
		}
		names[id] = r.name
	}
	return names
}

// claimWays are the three statements that claim: one queue, several
// queues in one pass, and a consumer's invoke deliveries. Each claims up
// to max of target and returns the pass.
var claimWays = []struct {
	name   string
	source claim.Source
	pass   func(ctx context.Context, pool *pgxpool.Pool, target claim.Target, other uuid.UUID, max int) (claim.Pass, error)
}{
	{"claim_queue.sql", claim.Queue, func(ctx context.Context, pool *pgxpool.Pool, target claim.Target, _ uuid.UUID, max int) (claim.Pass, error) {
		return claim.ClaimPass(ctx, pool, target, max, claim.Busy{})
	}},
	{"claim_queues.sql", claim.Queue, func(ctx context.Context, pool *pgxpool.Pool, target claim.Target, other uuid.UUID, max int) (claim.Pass, error) {
		ps, err := claim.ClaimPasses(ctx, pool, []claim.Request{
			{Target: target, Max: max},
			{Target: claim.Target{Source: claim.Queue, AppID: target.AppID, Queue: "other", TriggerID: other}, Max: max},
		})
		if err != nil {
			return claim.Pass{}, err
		}
		return ps[0], nil
	}},
	{"claim_invoke.sql", claim.Invoke, func(ctx context.Context, pool *pgxpool.Pool, target claim.Target, _ uuid.UUID, max int) (claim.Pass, error) {
		return claim.ClaimPass(ctx, pool, target, max, claim.Busy{})
	}},
}

// TestClaimTakesWhatBecameReadyFirst: a claim takes the ready messages
// that became ready first, a delayed (or retried) one counting from its
// deliver_after (or its enqueued_at, if that is later: a time already
// past when it was written) and an immediate one from its enqueued_at; a
// message not yet due is neither taken nor in the way, however long ago
// it was enqueued.
func TestClaimTakesWhatBecameReadyFirst(t *testing.T) {
	for _, way := range claimWays {
		t.Run(way.name, func(t *testing.T) {
			ctx := context.Background()
			pool, client, appID := setup(t)
			var ids [2]uuid.UUID
			for i, q := range []string{"q", "other"} {
				c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: q})
				if err != nil {
					t.Fatal(err)
				}
				ids[i] = c.ID
			}
			target := claim.Target{Source: way.source, AppID: appID, Queue: "q", TriggerID: ids[0]}
			names := insertRows(t, pool, target, []readyRow{
				{name: "not due", ago: 40 * time.Minute, due: time.Hour, hasDue: true},
				{name: "immediate 5m", ago: 5 * time.Minute},
				{name: "due 3m ago", ago: 20 * time.Minute, due: -3 * time.Minute, hasDue: true},
				{name: "immediate 1m", ago: time.Minute},
				{name: "due 6m ago", ago: 30 * time.Minute, due: -6 * time.Minute, hasDue: true},
				// Enqueued now with a time already past (a catch-up
				// scheduler): ready now, behind every message before it.
				{name: "past-dated", due: -24 * time.Hour, hasDue: true},
			})
			for _, want := range [][]string{
				{"due 6m ago", "immediate 5m"},
				{"due 3m ago", "immediate 1m"},
				{"past-dated"},
				{},
			} {
				p, err := way.pass(ctx, pool, target, ids[1], 2)
				if err != nil {
					t.Fatal(err)
				}
				var got []string
				for _, m := range p.Messages {
					got = append(got, names[m.ID])
				}
				slices.Sort(got)
				slices.Sort(want)
				if !slices.Equal(got, want) {
					t.Fatalf("claimed %q, want %q", got, want)
				}
				if until := time.Until(p.NextDue); until < 50*time.Minute || until > 70*time.Minute {
					t.Errorf("next due in %s, want the not-due message's, in about an hour", until.Round(time.Second))
				}
			}
		})
	}
}

// rowsRemovedRE finds the rows an executed plan node read and dropped.
var rowsRemovedRE = regexp.MustCompile(`Rows Removed by Filter: (\d+)`)

// seqScanRE finds a plan node that reads a whole message table.
var seqScanRE = regexp.MustCompile(`Seq Scan on (queue_messages|outbox)`)

// TestClaimReadsNoDelayedHead: with 20,000 messages not yet due enqueued
// ahead of the ready ones (scheduled messages, or a consumer's backlog of
// retries during its outage), a claim pass's statements and the fallback
// poll, run with their generic plans as a pass runs them, read none of
// them: no plan node drops more than a few rows, and none, executed or
// not, scans a message table. Walking the seed's dispatch index, which holds
// delayed messages too, each claim read and dropped all 20,000.
func TestClaimReadsNoDelayedHead(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q"})
	if err != nil {
		t.Fatal(err)
	}
	const delayed = 20000
	for _, head := range []string{`
		INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after)
		SELECT $1, 'q', '{}', now() - interval '1 hour' + g * interval '1 ms', now() + interval '1 day'
		FROM generate_series(1, $3) g WHERE $2::uuid IS NOT NULL`, `
		INSERT INTO outbox (app_id, source_kind, trigger_id, payload, enqueued_at, deliver_after)
		SELECT $1, 'invoke', $2, '{}', now() - interval '1 hour' + g * interval '1 ms', now() + interval '1 day'
		FROM generate_series(1, $3) g`} {
		if _, err := pool.Exec(ctx, head, appID, c.ID, delayed); err != nil {
			t.Fatal(err)
		}
	}
	target := claim.Target{Source: claim.Queue, AppID: appID, Queue: "q", TriggerID: c.ID}
	insertRows(t, pool, target, []readyRow{{name: "a", ago: time.Minute}, {name: "b", ago: time.Minute, due: -time.Second, hasDue: true}})
	target.Source = claim.Invoke
	insertRows(t, pool, target, []readyRow{{name: "a", ago: time.Minute}, {name: "b", ago: time.Minute, due: -time.Second, hasDue: true}})
	if _, err := pool.Exec(ctx, `ANALYZE queue_messages; ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}

	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	app, queue, consumer := "'"+appID.String()+"'", "'q'", "'"+c.ID.String()+"'"
	for i, st := range []planCase{
		{name: "claim_queue.sql", sql: queries.ClaimQueue,
			args: []planArg{{"app_id", "uuid", app}, {"queue_name", "text", queue}, {"max_messages", "int", "10"}}},
		{name: "claim_queues.sql", sql: queries.ClaimQueues,
			args: []planArg{{"app_ids", "uuid[]", "'{" + appID.String() + "}'"}, {"queue_names", "text[]", "'{q}'"}, {"max_messages", "int[]", "'{10}'"}}},
		{name: "claim_invoke.sql", sql: queries.ClaimInvoke,
			args: []planArg{{"trigger_id", "uuid", consumer}, {"max_messages", "int", "10"}}},
		{name: "next_due_queue.sql", sql: queries.NextDueQueue,
			args: []planArg{{"app_id", "uuid", app}, {"queue_name", "text", queue}, {"owner", "uuid", "'" + uuid.NewString() + "'"},
				{"held", "bool", "true"}, {"lease_ms", "int", "30000"}, {"consumer_id", "uuid", consumer}}},
		{name: "next_due_queues.sql", sql: queries.NextDueQueues,
			args: []planArg{{"app_ids", "uuid[]", "'{" + appID.String() + "}'"}, {"queue_names", "text[]", "'{q}'"}, {"consumer_ids", "uuid[]", "'{" + c.ID.String() + "}'"},
				{"held", "bool[]", "'{true}'"}, {"owner", "uuid", "'" + uuid.NewString() + "'"}, {"lease_ms", "int", "30000"}}},
		{name: "next_due_invoke.sql", sql: queries.NextDueInvoke, args: []planArg{{"trigger_id", "uuid", consumer}}},
		// The fallback poll asks of every consumer whether its queue and
		// its invoke deliveries hold ready work, and stale ready work.
		{name: "poll.sql", sql: queries.Poll,
			args: []planArg{{"offer_ttl_ms", "bigint", "30000"}, {"owner", "uuid", "'" + uuid.NewString() + "'"}, {"offers", "uuid[]", "'{}'"},
				{"grace_ms", "bigint", "0"}, {"heartbeat", "text", "'x'"}, {"default_vt_secs", "int", "30"}}},
	} {
		t.Run(st.name, func(t *testing.T) {
			name := fmt.Sprintf("ready_plan_%d", i)
			_, values := prepare(t, conn.Conn(), name, st)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
				t.Fatal(err)
			}
			plan := explain(t, tx.Conn(), fmt.Sprintf("EXPLAIN (ANALYZE, COSTS OFF) EXECUTE %s (%s)", name, strings.Join(values, ", ")))
			if m := seqScanRE.FindString(plan); m != "" {
				t.Errorf("the plan has a %s, which would read the whole table where it runs:\n%s", m, plan)
			}
			for _, m := range rowsRemovedRE.FindAllStringSubmatch(plan, -1) {
				if n, _ := strconv.Atoi(m[1]); n > 10 {
					t.Errorf("a plan node dropped %d rows of the %d not yet due:\n%s", n, delayed, plan)
				}
			}
			if t.Failed() || testing.Verbose() {
				t.Logf("plan:\n%s", plan)
			}
		})
	}
}
