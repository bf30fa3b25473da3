package bellhop

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestClosedConnMarksPoolStale: a pool connection the pool finds closed
// when it drops it (a statement found it ended by the server, or broken)
// has every connection idle since then pinged before use, and only those;
// one the pool drops itself, still open (lifetime, idle time, Reset),
// changes nothing. The pool's sessions can end while the listener's stays
// (pg_terminate_backend, idle_session_timeout), and unpinged, each dead
// connection failed a statement in turn.
func TestClosedConnMarksPoolStale(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	var userHook int
	cfg.BeforeClose = func(*pgx.Conn) { userHook++ }
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
		PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	pc := d.poolCfg
	conn, err := pgx.ConnectConfig(ctx, pc.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// A connection idle for a second: since before anything below.
	pinged := func(idle time.Duration) bool {
		return pc.ShouldPing(ctx, pgxpool.ShouldPingParams{Conn: conn, IdleDuration: idle})
	}
	if pinged(time.Second) {
		t.Fatal("a connection idle for 1s is pinged before anything made the pool suspect")
	}
	pc.BeforeClose(conn) // open: dropped by the pool itself
	if pinged(time.Second) {
		t.Error("a connection the pool dropped while open made the idle ones suspect")
	}
	closed, err := pgx.ConnectConfig(ctx, pc.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	if err := closed.Close(ctx); err != nil {
		t.Fatal(err)
	}
	pc.BeforeClose(closed)
	if !pinged(time.Second) {
		t.Error("after a connection was found closed, one idle since before is not pinged")
	}
	if pinged(0) {
		t.Error("after a connection was found closed, one released since is pinged")
	}
	if !pinged(2 * time.Minute) {
		t.Error("a connection idle for over a minute is not pinged")
	}
	if userHook != 2 {
		t.Errorf("the caller's BeforeClose ran %d times, want 2", userHook)
	}
}

// TestConnLost: which claim errors the lane retries at once (a session
// ended or a connection broken under the statement) and which it backs
// off from (no connection to be had, a slow server, any other error).
func TestConnLost(t *testing.T) {
	// Sessions refused, as pgx reports them: a dial refused (a net.Error)
	// and the server's FATAL for a database not there, each inside a
	// ConnectError, which the server being away explains.
	ctx := context.Background()
	_, refused := pgx.Connect(ctx, "postgres://bellhop@127.0.0.1:1/none?connect_timeout=5")
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Database = "bellhop_no_such_database"
	_, noDatabase := pgx.ConnectConfig(ctx, cfg)
	for _, err := range []error{refused, noDatabase} {
		if _, ok := errors.AsType[*pgconn.ConnectError](err); !ok {
			t.Fatalf("want a ConnectError, got %T: %v", err, err)
		}
	}
	// A session ended by the server, as a claim's batch then reports it
	// (over TCP a FATAL, which may come inside pgx's
	// ErrPreprocessingBatch; over a unix socket a refused write).
	victim, err := pgx.Connect(ctx, pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close(ctx)
	admin, err := pgx.Connect(ctx, pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, victim.PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the terminated backend gone", func() bool {
		var gone bool
		if err := admin.QueryRow(ctx, `SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, victim.PgConn().PID()).Scan(&gone); err != nil {
			t.Fatal(err)
		}
		return gone
	})
	b := &pgx.Batch{}
	b.Queue(`SELECT $1::int`, 1)
	terminated := victim.SendBatch(ctx, b).Close()
	if terminated == nil {
		t.Fatal("a batch on a terminated session succeeded")
	}
	fatal := &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P01"}
	localized := &pgconn.PgError{Severity: "SCHWERWIEGEND", SeverityUnlocalized: "FATAL", Code: "57P05"}
	broken := &net.OpError{Op: "write", Net: "unix", Err: syscall.EPIPE}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"terminated backend", fmt.Errorf("claim a/q: %w", fatal), true},
		{"localized severity", localized, true},
		{"broken pipe", fmt.Errorf("write failed: %w", broken), true},
		{"unexpected EOF", fmt.Errorf("receive message failed: %w", io.ErrUnexpectedEOF), true},
		{"statement error", &pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "42P01"}, false},
		{"terminated session", fmt.Errorf("claim a/q: plan mode: %w", terminated), true},
		{"end of file", io.EOF, true},
		{"dial refused", refused, false},
		{"no such database", noDatabase, false},
		{"timed out", fmt.Errorf("claim: %w", context.DeadlineExceeded), false},
		{"stopped", context.Canceled, false},
		{"timeout on the wire", &net.OpError{Op: "read", Net: "tcp", Err: timeoutErr{}}, false},
		{"other", errors.New("cannot encode"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := connLost(tt.err); got != tt.want {
				t.Errorf("connLost(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

// TestReadyAfterPoolSessionsEnd: /readyz's check, when the pool's
// sessions have ended and the listener's has not (as when the server's
// idle_session_timeout, below the probe's period, ends them between
// checks), takes a dead connection and fails once; it is tried again, on
// a connection the pool now pings, rather than answering 503 for a
// database that is there.
func TestReadyAfterPoolSessionsEnd(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	const conns = 4
	cfg.MinConns, cfg.MaxConns = conns, conns
	cfg.ConnConfig.RuntimeParams["application_name"] = "bellhop-ready-test"
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
		PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	const sessions = `FROM pg_stat_activity WHERE application_name = 'bellhop-ready-test' AND datname = current_database()`
	count := func(where string) int {
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) `+sessions+` AND `+where).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	runUntilCleanup(t, d, nil)
	// Not Ready, whose check would pass and be reused for a second:
	// started, listening, and every pool session idle for a while, so
	// that the start-up's statements are over and none meets a dead
	// connection before the check does.
	eventually(t, "the dispatcher running and listening", func() bool { return d.running.Load() && d.listener.Connected() })
	eventually(t, "the pool's sessions quiet", func() bool {
		return count(`state = 'idle' AND state_change < now() - interval '300 milliseconds'`) == conns
	})
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) `+sessions); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the pool's backends gone", func() bool { return count("true") == 0 })
	stale := d.stale.Load()
	if err := d.Ready(ctx); err != nil {
		t.Errorf("Ready after the pool's sessions ended = %v; want nil, the database is there", err)
	}
	if d.stale.Load() == stale {
		t.Fatal("no statement met a dead connection: the test proves nothing")
	}
}
