package bellhop_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/migrations"
)

// TestAppKeyCheckKeepsItsPlan: PostgreSQL checks queue_messages' foreign
// key with one saved plan per session, and plans it again whenever it runs
// under another search_path than it was planned under. Before migration
// 0067 a leased message checked it under the producer's search_path (its
// INSERT) and then under bellhop_lease_message's (the lease's UPDATE):
// two plans per message, 40 for 20; enqueue() alternating with plain
// INSERTs planned it at each switch, 19 times for 20. Checked at COMMIT,
// every check runs under the session's own search_path and the plan is
// kept: PostgreSQL's first five custom plans and a generic one.
// pg_stat_statements counts the plans, on a cluster of the test's own
// (the extension must be loaded at start, and its counts are the whole
// server's).
func TestAppKeyCheckKeepsItsPlan(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := statementsServer(ctx, t)
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		t.Fatal(err)
	}
	// One session, so that one plan cache serves every check; the key's
	// checks run nested, under SPI, counted only with track = all.
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["pg_stat_statements.track"] = "all"
	cfg.ConnConfig.RuntimeParams["pg_stat_statements.track_planning"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	app, err := client.CreateApp(ctx, "shop")
	if err != nil {
		t.Fatal(err)
	}
	con, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	exec := func(t *testing.T, sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	cases := []struct {
		name    string
		send    func(t *testing.T, i int)
		leasing bool
	}{
		{"a leased message per Client.Enqueue", func(t *testing.T, _ int) {
			// An offer before each message, as a leasing dispatcher leaves
			// one: the producer's commit leases the message under it.
			exec(t, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
				VALUES (gen_random_uuid(), $1, 'orders', $2, 'bellhop_l_test', now() + interval '1 hour', $3)`,
				app.ID, leaseOwner, con.ID)
			if _, err := client.Enqueue(ctx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{}); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"enqueue() between plain INSERTs", func(t *testing.T, i int) {
			if i%2 == 0 {
				exec(t, `SELECT enqueue($1, 'orders', '{}')`, app.ID)
			} else {
				exec(t, `INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '{}')`, app.ID)
			}
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			exec(t, "DELETE FROM queue_messages")
			if tc.leasing {
				// The lease key and the offers' owner key, held as a
				// leasing dispatcher's listener holds them.
				keys, err := pgx.Connect(ctx, dsn)
				if err != nil {
					t.Fatal(err)
				}
				defer keys.Close(context.Background())
				if _, err := keys.Exec(ctx, `SELECT pg_advisory_lock_shared(1650814063, 0),
					pg_advisory_lock_shared(hashtextextended($1::text, 1650814064))`, leaseOwner); err != nil {
					t.Fatal(err)
				}
			}
			exec(t, "SELECT pg_stat_statements_reset()")
			for i := range n {
				tc.send(t, i)
			}
			var calls, plans, leased int64
			if err := admin.QueryRow(ctx, `SELECT coalesce(sum(calls), 0), coalesce(sum(plans), 0)
				FROM pg_stat_statements WHERE query LIKE '%FROM ONLY "public"."apps" x%FOR KEY SHARE OF x'`).Scan(&calls, &plans); err != nil {
				t.Fatal(err)
			}
			if err := admin.QueryRow(ctx, `SELECT count(claim_token) FROM queue_messages`).Scan(&leased); err != nil {
				t.Fatal(err)
			}
			want := int64(0)
			if tc.leasing {
				want = n
			}
			if leased != want {
				t.Fatalf("%d messages leased, want %d", leased, want)
			}
			// Each message's INSERT checks the key, and a lease's UPDATE
			// of a row its own transaction inserted checks it again.
			if calls < n {
				t.Fatalf("pg_stat_statements saw %d checks of the key for %d messages: it does not count them", calls, n)
			}
			if plans > 8 {
				t.Errorf("%d plans of the key's check in %d checks for %d messages, want at most 8", plans, calls, n)
			}
		})
	}
}

// leaseOwner is the owner of the offers TestAppKeyCheckKeepsItsPlan
// writes.
var leaseOwner = uuid.MustParse("8e1d4c5a-0c4f-4a53-9a3e-5d2f0b7c1e01")

// statementsServer starts a cluster that loads pg_stat_statements,
// migrates its postgres database, and returns a connection string for it.
func statementsServer(ctx context.Context, t *testing.T) string {
	t.Helper()
	c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{
		"fsync": "off", "shared_preload_libraries": "pg_stat_statements"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop cluster: %v", err)
		}
	})
	dsn := c.ConnString("postgres")
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := migrations.Migrate(ctx, conn); err != nil {
		t.Fatal(err)
	}
	return dsn
}

// TestPlainInsertAppCheckedAtCommit: a plain INSERT naming no app fails at
// COMMIT, since migration 0067, and at the statement under SET
// CONSTRAINTS ... IMMEDIATE; neither stores anything.
func TestPlainInsertAppCheckedAtCommit(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	e.app("shop")
	const insert = `INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '{}')`
	wantKeyError := func(when string, err error) {
		t.Helper()
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "23503" || pe.ConstraintName != "queue_messages_app_id_fkey" {
			t.Fatalf("%s: %v, want SQLSTATE 23503 on queue_messages_app_id_fkey", when, err)
		}
	}

	tx, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(e.ctx)
	if _, err := tx.Exec(e.ctx, insert, uuid.New()); err != nil {
		t.Fatalf("INSERT: %v, want the key checked at COMMIT", err)
	}
	wantKeyError("COMMIT", tx.Commit(e.ctx))

	tx2, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(e.ctx)
	if _, err := tx2.Exec(e.ctx, "SET CONSTRAINTS public.queue_messages_app_id_fkey IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	_, err = tx2.Exec(e.ctx, insert, uuid.New())
	wantKeyError("INSERT under SET CONSTRAINTS IMMEDIATE", err)
	if err := tx2.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.int64("SELECT count(*) FROM queue_messages"); n != 0 {
		t.Errorf("%d messages stored, want none", n)
	}
}

// TestEnqueueAppDeletedMeanwhile: an Enqueue that meets a deletion of its
// app in progress waits for it (the statement locks the app's row) and,
// once it commits, returns ErrUnknownApp, not the foreign key's raw
// SQLSTATE 23503 from its COMMIT, where the key is checked (0067).
func TestEnqueueAppDeletedMeanwhile(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	app := e.app("shop")
	del, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer del.Rollback(e.ctx)
	if _, err := del.Exec(e.ctx, "DELETE FROM apps WHERE id = $1", app.ID); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{})
		done <- err
	}()
	// The Enqueue waits for the delete's lock on the app's row.
	e.waitForLock(`%WITH app AS%`, done, "the Enqueue returned before the delete committed", "the Enqueue never waited for the delete")
	if err := del.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}
	err = <-done
	if !errors.Is(err, bellhop.ErrUnknownApp) {
		t.Fatalf("Enqueue: %v, want ErrUnknownApp", err)
	}
	if n := e.int64("SELECT count(*) FROM queue_messages"); n != 0 {
		t.Errorf("%d messages stored, want none", n)
	}
}

// TestEnqueueTxHoldsOffAppDelete: a producer's transaction that has
// enqueued with EnqueueTx holds a deletion of its app off until it ends,
// as it did when the key was checked at the statement: its COMMIT
// succeeds, and the deletion then takes its messages with the app. With
// the key checked at COMMIT (0067) and no lock before, the deletion
// committed first and the producer's COMMIT failed with 23503.
func TestEnqueueTxHoldsOffAppDelete(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	app := e.app("shop")
	tx, err := e.pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(e.ctx)
	if _, err := e.client.EnqueueTx(e.ctx, tx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted := make(chan error, 1)
	go func() {
		_, err := e.pool.Exec(e.ctx, "DELETE FROM apps WHERE id = $1", app.ID)
		deleted <- err
	}()
	e.waitForLock(`DELETE FROM apps%`, deleted, "the app was deleted while a transaction that enqueued to it was open",
		"the delete never waited for the producer's transaction")
	if err := tx.Commit(e.ctx); err != nil {
		t.Fatalf("the producer's COMMIT: %v", err)
	}
	if err := <-deleted; err != nil {
		t.Fatalf("delete: %v", err)
	}
	if n := e.int64("SELECT count(*) FROM queue_messages"); n != 0 {
		t.Errorf("%d messages left after their app was deleted, want none", n)
	}
}

// waitForLock polls until a session of the test's database whose
// statement is LIKE query waits for a lock. It fails saying early if done
// reports first (the statement ended without waiting), and never at
// the deadline.
func (e *fxEnv) waitForLock(query string, done <-chan error, early, never string) {
	e.t.Helper()
	deadline := time.Now().Add(fxTimeout / 2)
	for {
		var waiting int
		if err := e.pool.QueryRow(e.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1`, query).Scan(&waiting); err != nil {
			e.t.Fatal(err)
		}
		if waiting > 0 {
			return
		}
		select {
		case err := <-done:
			e.t.Fatalf("%s (%v)", early, err)
		default:
		}
		if time.Now().After(deadline) {
			e.t.Fatal(never)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
