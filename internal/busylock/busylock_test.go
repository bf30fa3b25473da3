package busylock_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/busylock"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// fixture is a migrated database with one app and queue "q".
type fixture struct {
	dsn   string
	admin *pgx.Conn
	key   busylock.Key
	// notified is notifies' listener, opened on its first call and kept
	// for the test: tests that call notifies in a loop would otherwise
	// pile up a session per call.
	notified *pgx.Conn
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	var app uuid.UUID
	if err := admin.QueryRow(ctx, "INSERT INTO apps (name) VALUES ('app') RETURNING id").Scan(&app); err != nil {
		t.Fatal(err)
	}
	return &fixture{dsn: dsn, admin: admin, key: busylock.Key{AppID: app, Queue: "q"}}
}

func (f *fixture) holder(t *testing.T, idle time.Duration) *busylock.Holder {
	return f.holderOf(t, uuid.New(), idle)
}

// holderOf is a holder for the dispatcher named owner. Its connection is
// closed when the test ends, and the holder is kept reachable until then:
// once a test no longer refers to it, the garbage collector could
// otherwise finalize its socket, ending the session and its keys while
// the test still relies on them.
func (f *fixture) holderOf(t *testing.T, owner uuid.UUID, idle time.Duration) *busylock.Holder {
	h := busylock.New(func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, f.dsn) }, owner, idle, zerolog.Nop())
	t.Cleanup(func() {
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		h.Run(ended) // closes the connection
	})
	return h
}

// listen returns a connection listening on the bellhop channel, closed
// when the test ends.
func (f *fixture) listen(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	listener, err := pgx.Connect(ctx, f.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { listener.Close(context.Background()) })
	if _, err := listener.Exec(ctx, "LISTEN bellhop"); err != nil {
		t.Fatal(err)
	}
	return listener
}

// sent returns, in order, the payloads starting with prefix that listener
// received before a sentinel that sent sends now: notifications arrive in
// commit order, so these are all that were committed before.
func (f *fixture) sent(t *testing.T, listener *pgx.Conn, prefix string) []string {
	t.Helper()
	ctx := context.Background()
	if _, err := f.admin.Exec(ctx, "SELECT pg_notify('bellhop', 'h:sentinel')"); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var got []string
	for {
		n, err := listener.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("waiting for the sentinel (got %q so far): %v", got, err)
		}
		if n.Payload == "h:sentinel" {
			return got
		}
		if strings.HasPrefix(n.Payload, prefix) {
			got = append(got, n.Payload)
		}
	}
}

// notifies inserts one message into queue "q" under the given isolation
// level, and reports whether the notify trigger announced it.
func (f *fixture) notifies(t *testing.T, iso pgx.TxIsoLevel) bool {
	t.Helper()
	ctx := context.Background()
	if f.notified == nil {
		f.notified = f.listen(t)
	}
	// sent reads up to its own sentinel, so nothing of an earlier call is
	// left to be read as this one's.
	listener := f.notified
	tx, err := f.admin.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := json.Marshal(map[string]int{"a": 1})
	if _, err := tx.Exec(ctx, "INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, $2, $3)",
		f.key.AppID, f.key.Queue, payload); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := f.sent(t, listener, "q:")
	return len(got) == 1 && got[0] == "q:"+f.key.AppID.String()+":"+f.key.Queue
}

func TestTriggerSkipsWhileKeyHeld(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	h := f.holder(t, 10*time.Second)
	isolations := []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable}
	for _, iso := range isolations {
		if !f.notifies(t, iso) {
			t.Fatalf("%s producer, no mark: no notification", iso)
		}
	}
	if ok, err := h.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("Hold = %v, %v; want true", ok, err)
	}
	if !h.Held(f.key) {
		t.Fatal("Held = false after a successful Hold")
	}
	// Lock state is not MVCC: every isolation level sees the mark.
	for _, iso := range isolations {
		if f.notifies(t, iso) {
			t.Errorf("%s producer notified while the queue's key is held", iso)
		}
	}
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	if ok, err := h.Release(ctx, other); err != nil || !ok {
		t.Errorf("Release of a key never held = %v, %v; want confirmed", ok, err)
	}
	if ok, err := h.Release(ctx, f.key); err != nil || !ok {
		t.Fatalf("Release = %v, %v; want confirmed", ok, err)
	}
	if h.Held(f.key) {
		t.Fatal("Held = true after Release")
	}
	if !f.notifies(t, pgx.ReadCommitted) {
		t.Error("no notification after the key was released")
	}
}

// A dispatcher that takes a key tells the others in the same statement, so
// that they watch it even if it dies before writing its queue_busy row. A
// failed or repeated Hold sends nothing.
func TestHoldAnnouncesTheKey(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	listener := f.listen(t)
	oa, ob := uuid.New(), uuid.New()
	a, b := f.holderOf(t, oa, 10*time.Second), f.holderOf(t, ob, 10*time.Second)
	steps := []struct {
		name string
		do   func() (bool, error)
		want bool
	}{
		{"a.Hold", func() (bool, error) { return a.Hold(ctx, f.key) }, true},
		{"a.Hold again", func() (bool, error) { return a.Hold(ctx, f.key) }, true},
		{"b.Hold while a holds", func() (bool, error) { return b.Hold(ctx, f.key) }, false},
		{"a.Release", func() (bool, error) { return a.Release(ctx, f.key) }, true},
		{"b.Hold", func() (bool, error) { return b.Hold(ctx, f.key) }, true},
	}
	for _, s := range steps {
		if ok, err := s.do(); err != nil || ok != s.want {
			t.Fatalf("%s = %v, %v; want %v", s.name, ok, err, s.want)
		}
	}
	want := []string{
		"b:" + f.key.AppID.String() + ":" + oa.String() + ":" + f.key.Queue,
		"b:" + f.key.AppID.String() + ":" + ob.String() + ":" + f.key.Queue,
	}
	got := f.sent(t, listener, "")
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("notifications = %q; want %q", got, want)
	}
}

// The trigger decides per row (migrations/0043_notify_when.sql): a
// multi-row INSERT announces each queue once, and only the queues no
// dispatcher holds; a statement that fails after a row was checked leaves
// the producer's session holding no busy key, which would otherwise keep
// every dispatcher from marking the queue until the producer disconnects.
func TestTriggerMultiRowStatements(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	listener := f.listen(t)
	// announced runs one INSERT on the producer's connection and returns
	// the message notifications sent before it returned, in order (not
	// Hold's "b:"), and its error.
	announced := func(insert string, args ...any) ([]string, error) {
		t.Helper()
		_, err := f.admin.Exec(ctx, insert, args...)
		return f.sent(t, listener, "q:"), err
	}
	q := "q:" + f.key.AppID.String() + ":q"
	r := "q:" + f.key.AppID.String() + ":r"
	const both = `INSERT INTO queue_messages (app_id, queue_name, payload)
		SELECT $1, n, '{}' FROM unnest(ARRAY['q', 'q', 'r', 'q', 'r']) AS n`

	got, err := announced(both, f.key.AppID)
	if err != nil || len(got) != 2 || got[0] != q || got[1] != r {
		t.Errorf("5 rows to q and r, no key held: notifications %q, %v; want [%q %q]", got, err, q, r)
	}

	got, err = announced(`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'q', '{}'), ($2, 'q', '{}')`,
		f.key.AppID, uuid.New())
	if err == nil || len(got) != 0 {
		t.Fatalf("INSERT with an unknown app: notifications %q, error %v; want none and an error", got, err)
	}
	var keys int
	err = f.admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&keys)
	if err != nil || keys != 0 {
		t.Fatalf("the producer's session holds %d advisory locks after its INSERT failed (%v); want 0", keys, err)
	}

	h := f.holder(t, 10*time.Second)
	if ok, err := h.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("Hold after the failed INSERT = %v, %v; want true", ok, err)
	}
	got, err = announced(both, f.key.AppID)
	if err != nil || len(got) != 1 || got[0] != r {
		t.Errorf("5 rows to q and r, q's key held: notifications %q, %v; want [%q]", got, err, r)
	}
}

func TestOneHolderPerKey(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	a, b := f.holder(t, 10*time.Second), f.holder(t, 10*time.Second)
	for i := range 2 { // a second Hold by the same holder is a no-op
		if ok, err := a.Hold(ctx, f.key); err != nil || !ok {
			t.Fatalf("a.Hold #%d = %v, %v; want true", i+1, ok, err)
		}
	}
	if ok, err := b.Hold(ctx, f.key); err != nil || ok {
		t.Fatalf("b.Hold while a holds = %v, %v; want false", ok, err)
	}
	if ok, err := a.Release(ctx, f.key); err != nil || !ok {
		t.Fatalf("a.Release = %v, %v", ok, err)
	}
	// One release undoes both of a's Holds: the key is free.
	if ok, err := b.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("b.Hold after a released = %v, %v; want true", ok, err)
	}
}

// TestConcurrentHoldsTakeTheKeyOnce: two lanes of one queue (an operator's
// SQL can give a queue two consumers) that call Hold together both find
// the key not yet held, and the second waits its turn while the first
// takes it. The lock is re-entrant and a Release unlocks once, so a second
// take used to leave the session holding the key after the one Release:
// with no marks left, the session untimed and without keep-alives, until
// the process exited, and the queue's producers silent all that while.
func TestConcurrentHoldsTakeTheKeyOnce(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	// The first Hold connects; it waits there until the second has passed
	// the unlocked Held check and waits for its turn.
	connecting, connect := make(chan struct{}), make(chan struct{})
	h := busylock.New(func(ctx context.Context) (*pgx.Conn, error) {
		close(connecting)
		<-connect
		return pgx.Connect(ctx, f.dsn)
	}, uuid.New(), time.Minute, zerolog.Nop())
	t.Cleanup(func() {
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		h.Run(ended)
	})
	type result struct {
		ok  bool
		err error
	}
	held := make(chan result, 2)
	hold := func() {
		ok, err := h.Hold(ctx, f.key)
		held <- result{ok, err}
	}
	go hold()
	<-connecting
	go hold()
	deadline := time.Now().Add(5 * time.Second)
	for !waitingForTurn() {
		if time.Now().After(deadline) {
			close(connect)
			t.Fatal("the second Hold did not wait for its turn within 5s")
		}
		time.Sleep(time.Millisecond)
	}
	close(connect)
	for i := range 2 {
		if r := <-held; r.err != nil || !r.ok {
			t.Fatalf("concurrent Hold #%d = %v, %v; want true", i+1, r.ok, r.err)
		}
	}
	if ok, err := h.Release(ctx, f.key); err != nil || !ok {
		t.Fatalf("Release = %v, %v; want confirmed", ok, err)
	}
	var sessions int
	if err := f.admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND granted
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1::uuid::text || ':' || $2::text, 1650814062)`,
		f.key.AppID, f.key.Queue).Scan(&sessions); err != nil {
		t.Fatal(err)
	}
	if sessions != 0 {
		t.Fatalf("%d sessions hold the busy key after the one Release; want none", sessions)
	}
	if !f.notifies(t, pgx.ReadCommitted) {
		t.Error("a producer did not notify after the Release")
	}
}

// waitingForTurn reports whether a goroutine is in Hold, past its unlocked
// Held check, waiting for the lock connection's mutex.
func waitingForTurn() bool {
	buf := make([]byte, 1<<22)
	for g := range strings.SplitSeq(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "busylock.(*Holder).Hold(") && strings.Contains(g, "sync.(*Mutex).Lock(") &&
			!strings.Contains(g, "busylock.(*Holder).Held(") {
			return true
		}
	}
	return false
}

// TestSilentHolderLosesItsMarks: without keep-alives the server ends the
// session after idle, which frees the key; the holder learns of it on its
// next use, and reports the release as unconfirmed.
func TestSilentHolderLosesItsMarks(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	h := f.holder(t, 500*time.Millisecond) // no Run: no keep-alives
	if ok, err := h.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("Hold = %v, %v", ok, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !f.notifies(t, pgx.ReadCommitted) {
		if time.Now().After(deadline) {
			t.Fatal("the silent session kept its key for 5s; idle_session_timeout is 500ms")
		}
	}
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	if _, err := h.Hold(ctx, other); err == nil {
		t.Fatal("Hold on the timed-out session succeeded")
	}
	if h.Held(f.key) {
		t.Error("Held = true after the session was lost")
	}
	if ok, err := h.Release(ctx, f.key); err != nil || ok {
		t.Errorf("Release after the session was lost = %v, %v; want unconfirmed, no error", ok, err)
	}
	// The holder reconnects on the next Hold.
	if ok, err := h.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("Hold after reconnecting = %v, %v", ok, err)
	}
}

// TestKeepAlivesKeepMarks: with Run, the session outlives many idle
// timeouts; when Run ends, the marks end with the connection.
func TestKeepAlivesKeepMarks(t *testing.T) {
	f := newFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // if the test fails before it cancels
	// A second, not less: a keep-alive (every idle/3) that takes longer
	// than idle is given up and the connection dropped, with its marks,
	// and at 300ms a loaded machine under -race could take that long.
	const idle = time.Second
	h := f.holder(t, idle)
	done := make(chan struct{})
	go func() { h.Run(ctx); close(done) }()
	if ok, err := h.Hold(ctx, f.key); err != nil || !ok {
		t.Fatalf("Hold = %v, %v", ok, err)
	}
	until := time.Now().Add(5 * idle)
	for time.Now().Before(until) {
		if f.notifies(t, pgx.ReadCommitted) {
			t.Fatal("the key was lost although keep-alives ran")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of its cancel")
	}
	// The server frees the key when the closed session's backend exits,
	// a moment after Run closed the connection: poll for it.
	deadline := time.Now().Add(5 * time.Second)
	for !f.notifies(t, pgx.ReadCommitted) {
		if time.Now().After(deadline) {
			t.Fatal("the key outlived Run by 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := h.Hold(context.Background(), f.key); err == nil {
		t.Error("Hold after Run returned succeeded")
	}
}

// TestHeldDoesNotWaitForTheConnection: Held, which every claim pass asks,
// answers while a Hold waits on the lock connection (here for a connect
// that never completes; on a dead path, for a statement's answer), rather
// than stalling every lane for as long as that lasts.
func TestHeldDoesNotWaitForTheConnection(t *testing.T) {
	key := busylock.Key{AppID: uuid.New(), Queue: "q"}
	connecting := make(chan struct{})
	h := busylock.New(func(ctx context.Context) (*pgx.Conn, error) {
		close(connecting)
		<-ctx.Done()
		return nil, ctx.Err()
	}, uuid.New(), time.Second, zerolog.Nop())
	ctx, cancel := context.WithCancel(context.Background())
	held := make(chan error, 1)
	go func() {
		_, err := h.Hold(ctx, key)
		held <- err
	}()
	<-connecting
	answer := make(chan bool, 1)
	go func() { answer <- h.Held(key) }()
	select {
	case ok := <-answer:
		if ok {
			t.Error("Held = true for a key whose Hold has not finished")
		}
	case <-time.After(5 * time.Second):
		t.Error("Held did not answer within 5s while a Hold waited on the connection")
	}
	cancel()
	if err := <-held; err == nil {
		t.Error("Hold succeeded without a connection")
	}
}

// TestHoldEndedWaitingItsTurn: a Hold whose context ends while it waits
// for its turn on the lock connection (behind a statement of another
// lane, or a keep-alive) fails without dropping the connection, which
// would end every key the dispatcher holds.
func TestHoldEndedWaitingItsTurn(t *testing.T) {
	f := newFixture(t)
	h := f.holder(t, time.Minute)
	if ok, err := h.Hold(context.Background(), f.key); err != nil || !ok {
		t.Fatalf("Hold = %v, %v", ok, err)
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	if _, err := h.Hold(ended, other); !errors.Is(err, context.Canceled) {
		t.Fatalf("Hold with an ended context = %v, want context.Canceled", err)
	}
	if !h.Held(f.key) {
		t.Error("Held = false for the key held before: the connection was dropped")
	}
	if f.notifies(t, pgx.ReadCommitted) {
		t.Error("a producer of the held queue notified: the session lost its key")
	}
}

// TestReleaseEndedWaitingItsTurn: a Release whose context ended before its
// statement was sent (as when it waits its turn on the lock connection
// past its deadline; here it has ended before the call, which both
// Release's own check and pgx's refusal to send on an ended context catch)
// sends nothing, so it leaves the
// session and its keys as they were: it fails unconfirmed, the key stays
// held (Held says so, and a later Release gives it back, confirmed), and
// every other queue's key stays held too. It used to drop the connection,
// and with it every other queue's key, so that their producers notified
// again and their lanes settled as after a lost key.
func TestReleaseEndedWaitingItsTurn(t *testing.T) {
	f := newFixture(t)
	h := f.holder(t, time.Minute)
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	for _, k := range []busylock.Key{f.key, other} {
		if ok, err := h.Hold(context.Background(), k); err != nil || !ok {
			t.Fatalf("Hold(%s) = %v, %v", k.Queue, ok, err)
		}
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	if ok, err := h.Release(ended, other); ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("Release with an ended context = %v, %v; want unconfirmed, context.Canceled", ok, err)
	}
	if !h.Held(f.key) {
		t.Error("Held = false for another queue's key: the connection was dropped")
	}
	if f.notifies(t, pgx.ReadCommitted) {
		t.Error("a producer of the other held queue notified: the session lost its key")
	}
	if !h.Held(other) {
		t.Fatal("Held = false for the key whose release was never sent")
	}
	if ok, err := h.Release(context.Background(), other); !ok || err != nil {
		t.Fatalf("Release again = %v, %v; want confirmed", ok, err)
	}
	if !h.Held(f.key) {
		t.Error("Held = false for the key still held after the second release")
	}
}

// TestReleaseOnKilledSessionDrops: a Release that fails on a session the
// server has ended drops the connection, although it may fail before its
// statement was sent: the session is gone, so every key it held counts as
// lost (unconfirmed), not as still held. Release keeps the connection only
// when nothing was sent on a live one.
func TestReleaseOnKilledSessionDrops(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	h := f.holder(t, time.Minute)
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	for _, k := range []busylock.Key{f.key, other} {
		if ok, err := h.Hold(ctx, k); err != nil || !ok {
			t.Fatalf("Hold(%s) = %v, %v", k.Queue, ok, err)
		}
	}
	var killed int
	if err := f.admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND datname = current_database() AND backend_type = 'client backend'`).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("killed %d sessions, %v; want the lock session", killed, err)
	}
	// Its backend has exited.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left int
		if err := f.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE pid <> pg_backend_pid() AND datname = current_database() AND backend_type = 'client backend'`).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the killed lock session's backend still there after 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if ok, err := h.Release(ctx, other); ok || err == nil {
		t.Fatalf("Release on a killed session = %v, %v; want an error, unconfirmed", ok, err)
	}
	if h.Held(f.key) || h.Held(other) {
		t.Fatal("keys still held after a release on a killed session: the dead connection was kept")
	}
	if ok, err := h.Release(ctx, f.key); ok || err != nil {
		t.Errorf("Release of a key of the killed session = %v, %v; want unconfirmed (lost), no error", ok, err)
	}
}

// TestHoldWithLostAnswer: a Hold whose statement reached the server but
// whose answer never came back (a dead path) fails, and the key its
// statement took stays with the dropped session's backend until the server
// ends that session; producers skip their notifications meanwhile. Release
// must then report the release unconfirmed, so that the lane waits until
// the key is free before it relies on producers announcing again. It used
// to confirm it, and a lane went idle while nobody announced.
func TestHoldWithLostAnswer(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(f.dsn)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		first *severable // the lock connection; later dials are pgx's cancel requests
	)
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { c.Close() })
		s := &severable{Conn: c}
		mu.Lock()
		if first == nil {
			first = s
		}
		mu.Unlock()
		return s, nil
	}
	const idle = 2 * time.Second // the silent session's idle_session_timeout
	h := busylock.New(func(ctx context.Context) (*pgx.Conn, error) { return pgx.ConnectConfig(ctx, cfg) }, uuid.New(), idle, zerolog.Nop())
	// A first hold prepares the statement, so that the next one is a
	// single write: Bind, Execute, Sync.
	warm := busylock.Key{AppID: f.key.AppID, Queue: "warm"}
	if ok, err := h.Hold(ctx, warm); err != nil || !ok {
		t.Fatalf("Hold = %v, %v", ok, err)
	}
	if ok, err := h.Release(ctx, warm); err != nil || !ok {
		t.Fatalf("Release = %v, %v", ok, err)
	}
	mu.Lock()
	first.sever()
	mu.Unlock()
	hctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if _, err := h.Hold(hctx, f.key); err == nil {
		t.Fatal("Hold succeeded although its answer was lost")
	}
	if f.notifies(t, pgx.ReadCommitted) {
		t.Fatal("a producer notified: the lost Hold did not take the key, so this test shows nothing")
	}
	if h.Held(f.key) {
		t.Error("Held = true after a failed Hold")
	}
	if ok, err := h.Release(ctx, f.key); err != nil || ok {
		t.Errorf("Release after a Hold whose answer was lost = %v, %v; want unconfirmed, no error", ok, err)
	}
	// What the lane then waits for: the server ends the silent session
	// after idle, and with it the key.
	deadline := time.Now().Add(idle + 10*time.Second)
	for !f.notifies(t, pgx.ReadCommitted) {
		if time.Now().After(deadline) {
			t.Fatalf("the silent session kept the key for %s; its idle_session_timeout is %s", idle+10*time.Second, idle)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// severable is a connection whose path can go dead as a partition leaves
// it: once severed, the server gets the client's next write and nothing
// after it, the client gets nothing back, and the socket stays open (the
// test closes it) so that the server does not learn of it.
type severable struct {
	net.Conn
	mu      sync.Mutex
	severed bool // sever was called
	sent    bool // the one write after it went through
}

func (c *severable) sever() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.severed = true
}

func (c *severable) Write(b []byte) (int, error) {
	c.mu.Lock()
	drop := c.severed && c.sent
	if c.severed {
		c.sent = true
	}
	c.mu.Unlock()
	if drop {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

// Read drops what comes once severed, until the deadline pgx sets or the
// close.
func (c *severable) Read(b []byte) (int, error) {
	for {
		n, err := c.Conn.Read(b)
		c.mu.Lock()
		severed := c.severed
		c.mu.Unlock()
		if !severed || err != nil {
			return n, err
		}
	}
}

// Close ends the client's side only: reads fail from now on.
func (c *severable) Close() error {
	c.mu.Lock()
	severed := c.severed
	c.mu.Unlock()
	if !severed {
		return c.Conn.Close()
	}
	return c.Conn.SetDeadline(time.Unix(1, 0))
}

// TestRefusedHoldLeavesSessionUntimed: a Hold refused because another
// dispatcher holds the key leaves a session that holds no key without an
// idle_session_timeout, since the holder sends keep-alives only while it
// holds keys. It used to arm the timeout all the same: the server ended
// the silent session after idle (a FATAL in its log), the next Hold
// failed, and the key, which this holder never had, was counted as lost,
// so that the lane's settle waited, checking every 20 ms, for as long as
// the other dispatcher held it. A session that holds other keys keeps its
// timeout when refused: a hung dispatcher must still lose them.
func TestRefusedHoldLeavesSessionUntimed(t *testing.T) {
	f := newFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const idle = 300 * time.Millisecond
	other := busylock.Key{AppID: f.key.AppID, Queue: "other"}
	// The other dispatcher, which holds "other" throughout.
	a := f.holder(t, time.Minute)
	if ok, err := a.Hold(ctx, other); err != nil || !ok {
		t.Fatalf("a.Hold(other) = %v, %v; want true", ok, err)
	}

	t.Run("no keys", func(t *testing.T) {
		var pid atomic.Uint32
		b := busylock.New(func(ctx context.Context) (*pgx.Conn, error) {
			c, err := pgx.Connect(ctx, f.dsn)
			if err == nil {
				pid.Store(c.PgConn().PID())
			}
			return c, err
		}, uuid.New(), idle, zerolog.Nop())
		run, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { b.Run(run); close(done) }() // keep-alives, as a dispatcher runs them
		defer func() { stop(); <-done }()
		if ok, err := b.Hold(ctx, other); err != nil || ok {
			t.Fatalf("b.Hold(other) while a holds it = %v, %v; want false", ok, err)
		}
		first := pid.Load()
		// The server would end the session idle after the Hold: make sure
		// it lives on for several times that.
		until := time.Now().Add(5 * idle)
		for time.Now().Before(until) {
			var alive bool
			if err := f.admin.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)", first).Scan(&alive); err != nil {
				t.Fatal(err)
			}
			if !alive {
				t.Fatalf("the session refused a key, holding none, ended within %s; idle_session_timeout is %s", 5*idle, idle)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if ok, err := b.Hold(ctx, other); err != nil || ok {
			t.Errorf("b.Hold(other) again, %s later = %v, %v; want false, no error", 5*idle, ok, err)
		}
		if pid.Load() != first {
			t.Error("b reconnected: its session was lost")
		}
		if ok, err := b.Release(ctx, other); err != nil || !ok {
			t.Errorf("b.Release(other), never held = %v, %v; want confirmed", ok, err)
		}
	})

	t.Run("other keys held", func(t *testing.T) {
		// No Run: a hung dispatcher. Its second Hold must come within
		// its idle_session_timeout of the first, which a loaded machine
		// could miss at 300ms: the session would end and the Hold fail.
		const idle = time.Second
		c := f.holder(t, idle)
		if ok, err := c.Hold(ctx, f.key); err != nil || !ok {
			t.Fatalf("c.Hold = %v, %v; want true", ok, err)
		}
		if ok, err := c.Hold(ctx, other); err != nil || ok {
			t.Fatalf("c.Hold(other) while a holds it = %v, %v; want false", ok, err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for !f.notifies(t, pgx.ReadCommitted) {
			if time.Now().After(deadline) {
				t.Fatalf("the silent session kept its key for 5s after a refused Hold; idle_session_timeout is %s", idle)
			}
		}
	})
}
