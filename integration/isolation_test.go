package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// TestDispatcherSessionsReadCommitted: on a database whose default
// isolation is REPEATABLE READ or SERIALIZABLE, every session a dispatcher
// opens still runs READ COMMITTED. Its claims, settles and reclaims lock
// rows and then act on what they read: under the database's default they
// would fail with serialization errors, or act on a snapshot taken before
// the lock. Each session's setting is read as it connects, by a hook on
// the connection config, which the pool, the listener and the busy-mark
// connection all copy.
func TestDispatcherSessionsReadCommitted(t *testing.T) {
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			var db string
			if err := e.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
				t.Fatal(err)
			}
			if _, err := e.pool.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db}.Sanitize()+
				` SET default_transaction_isolation = '`+level+`'`); err != nil {
				t.Fatal(err)
			}
			// The premise: a new session takes the database's default.
			conn, err := pgx.Connect(ctx, e.dsn)
			if err != nil {
				t.Fatal(err)
			}
			var iso string
			err = conn.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&iso)
			conn.Close(ctx)
			if err != nil || iso != level {
				t.Fatalf("a new session's transaction_isolation is %q (%v), want %q", iso, err, level)
			}

			var mu sync.Mutex
			sessions := map[string][]string{} // each session's isolation, by application_name
			e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 1})
			rec := &recorder{}
			mux := bellhop.NewMux()
			mux.Handle("app", "orders", rec)
			startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, func(pc *pgxpool.Config) {
				pc.ConnConfig.AfterConnect = func(ctx context.Context, c *pgconn.PgConn) error {
					res, err := c.Exec(ctx, `SHOW transaction_isolation`).ReadAll()
					if err != nil {
						return err
					}
					mu.Lock()
					defer mu.Unlock()
					name := c.ParameterStatus("application_name")
					sessions[name] = append(sessions[name], string(res[0].Rows[0][0]))
					return nil
				}
			})
			// A backlog, so that the queue is marked busy too.
			msgs := make([]bellhop.NewMessage, 20)
			for i := range msgs {
				msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: []byte(`{}`)}
			}
			if _, err := e.client.EnqueueMany(ctx, "app", msgs); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "every message delivered and acked", func() bool {
				return rec.n.Load() == int32(len(msgs)) && e.count(t, `SELECT count(*) FROM queue_messages`) == 0
			})

			mu.Lock()
			defer mu.Unlock()
			t.Logf("sessions' isolation by application_name: %v", sessions)
			if len(sessions["bellhop-dispatcher"]) == 0 {
				t.Fatalf("no pool session seen (%v): the hook did not run, and the test proves nothing", sessions)
			}
			for name, levels := range sessions {
				for _, l := range levels {
					if l != "read committed" {
						t.Errorf("a %s session runs %s, want read committed", name, l)
					}
				}
			}
		})
	}
}
