package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// activeOthers counts the client sessions of the test's database, other
// than pool's own, that are running a statement (an autovacuum worker is
// not one).
const activeOthers = `SELECT count(*) FROM pg_stat_activity
	WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'`

// TestInterruptCancelsOnServer: a command whose statement waits (here
// `consumer rm`, behind a row lock another session holds) and is stopped
// by SIGINT cancels that statement on the server and says so, exit 1.
// It used to die by the signal, silent, leaving the statement to commit
// once it got its lock: the consumer was removed 13 s after the command
// "died" (found by the CLI review).
func TestInterruptCancelsOnServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	id, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	pool := db(t, dsn)
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, "SELECT 1 FROM triggers WHERE id = $1 FOR UPDATE", id); err != nil {
		t.Fatal(err)
	}
	p := start(t, []string{"DATABASE_URL=" + dsn}, "consumer", "rm", "--app", "shop", id)
	waitFor(t, 30*time.Second, "consumer rm waiting for the row lock", func() bool {
		return queryInt(t, pool, activeOthers+` AND wait_event_type = 'Lock'`) == 1
	})
	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 1 {
		t.Fatalf("consumer rm after SIGINT: exit %d, want 1", code)
	}
	if !strings.Contains(p.stderr(), "interrupted") {
		t.Errorf("consumer rm after SIGINT does not say it was interrupted:\n%s", p.stderr())
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// Nothing left running to remove it once the lock is free.
	waitFor(t, 10*time.Second, "no other session running a statement", func() bool {
		return queryInt(t, pool, activeOthers) == 0
	})
	if n := queryInt(t, pool, "SELECT count(*) FROM triggers WHERE id = $1", id); n != 1 {
		t.Errorf("the interrupted consumer rm removed the consumer once the lock was free")
	}
}

// TestInterruptedStreamEnqueuesNothing: `enqueue -` stopped by SIGINT
// while it waits for its next line ends at once, says that nothing was
// enqueued, and enqueued nothing; and it holds no transaction open while
// it waits for lines it has not got (the CLI review: a slow stream sat
// idle in a transaction from its start, and idle_in_transaction_session_
// timeout ended it, blamed on the lines read by then). Before, the read
// held the command until the next line came, or the signal killed it
// with nothing said. A line cut short by the stop is not blamed as a bad
// line (exit 2, found by the diff review).
func TestInterruptedStreamEnqueuesNothing(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	cmd := exec.Command(binary, "enqueue", "--app", "shop", "--queue", "orders", "-")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close() })
	// The command's sessions are those begun after this.
	var since time.Time
	if err := pool.QueryRow(context.Background(), "SELECT clock_timestamp()").Scan(&since); err != nil {
		t.Fatal(err)
	}
	p := startCmd(t, []string{"DATABASE_URL=" + dsn}, cmd)
	// The second line is cut short: at the stop, the part read of it is
	// neither a bad line nor a message. It is longer than a pipe holds
	// (64 KiB), so the write returns only once the command reads stdin,
	// which it does after its app lookup: the signal then finds it
	// waiting for the rest of the line. Waiting for its session to be
	// idle after the lookup was not enough (CI saw the signal cancel the
	// lookup): pgx prepares the statement first, and the session is idle
	// between the prepare and the run, with the statement's text.
	cut := append([]byte("{\"n\":1}\n{\"pad\":\""), bytes.Repeat([]byte("x"), 256<<10)...)
	if _, err := stdin.Write(cut); err != nil {
		t.Fatal(err)
	}
	// Connected, the app checked, and waiting for a line: no session of
	// its is idle in a transaction meanwhile. Checked in a session of the
	// command's (that of `app create` above can still be listed, idle
	// after the same lookup, for a moment after its process exited).
	waitFor(t, 30*time.Second, "the command idle after checking the app", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
			  AND state LIKE 'idle%' AND position('LEFT JOIN principals' IN query) > 0 AND backend_start > $1`, since) >= 1
	})
	// Client backends only: an autovacuum worker, in the test's fresh
	// database, has a transaction too (CI saw one).
	var inTx []string
	rows, err := pool.Query(context.Background(), `SELECT format('%s %s %s xact %s: %s', pid, application_name, state, xact_start, left(query, 120))
		FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
		  AND state LIKE 'idle in transaction%'`)
	if err == nil {
		inTx, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(inTx) != 0 {
		t.Errorf("%d sessions idle in a transaction while the stream waits for its first batch:\n%s", len(inTx), strings.Join(inTx, "\n"))
	}
	p.signal(os.Interrupt)
	if code := p.wait(10 * time.Second); code != 1 {
		t.Fatalf("enqueue - after SIGINT: exit %d, want 1", code)
	}
	if !regexp.MustCompile(`read stdin at line \d+: context canceled; nothing was enqueued.*interrupted`).MatchString(p.stderr()) {
		t.Errorf("enqueue - after SIGINT does not say that nothing was enqueued and that it was interrupted:\n%s", p.stderr())
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 0 {
		t.Errorf("%d messages enqueued by an interrupted stream", n)
	}
}

// TestNestedSignalContextLogsTheStop: run gives every command a
// signalContext, and `bellhop run` makes its own inside it, to log the
// stop. When the outer one heard the signal first and cancelled, the inner
// one returned without a word: CI saw a SIGINT stop `bellhop run` with no
// "stopping gracefully" line. Here the outer context is already cancelled
// by a signal when the inner one starts, as that race left it.
//
// The line is written by the time stop returns: the command returns as
// soon as its context is cancelled, and the process exited before the
// line was written (CI again: exit 0 and an empty stderr).
func TestNestedSignalContextLogsTheStop(t *testing.T) {
	outer, cancel := context.WithCancelCause(context.Background())
	cancel(stopSignal{os.Interrupt})
	var logs syncbuf.Buffer
	ctx, stop := signalContext(outer, zerolog.New(&logs))
	<-ctx.Done()
	stop()
	if !strings.Contains(logs.String(), `"signal":"interrupt","message":"stopping gracefully`) {
		t.Fatalf("no stop logged by the time stop returned, after the outer context's cancel by SIGINT; log: %q", logs.String())
	}
	var s stopSignal
	if !errors.As(context.Cause(ctx), &s) || s.sig != os.Interrupt {
		t.Errorf("the inner context's cause is %v, want the stop by SIGINT", context.Cause(ctx))
	}
}
