package notify_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/notify"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// counting is a notify.Handler that counts connects.
type counting struct{ connects atomic.Int32 }

func (h *counting) HandleEvent(notify.Event) {}
func (h *counting) Connected()               { h.connects.Add(1) }

// syncBuffer is a log sink safe for the listener's goroutines.
type syncBuffer = syncbuf.Buffer

// run starts l and stops it when t ends.
func run(t *testing.T, l *notify.Listener) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestListenerUsesConfiguredDialer: the listener dials through the
// ConnConfig's DialFunc (a cloud connector's or a tunnel's, with a
// placeholder host), as the pool does. It used to replace it with its own
// dialer, dialled the placeholder for ever, and every message waited for
// the fallback poll.
func TestListenerUsesConfiguredDialer(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	real := cfg.DialFunc
	var dials atomic.Int32
	// What the connector stands in for; only its dialer knows the way.
	network, addr := "unix", cfg.Host+"/.s.PGSQL."+strconv.Itoa(int(cfg.Port))
	if !strings.HasPrefix(cfg.Host, "/") {
		network, addr = "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
	}
	cfg.DialFunc = func(ctx context.Context, _, _ string) (net.Conn, error) {
		dials.Add(1)
		if _, ok := ctx.Deadline(); !ok {
			t.Error("the listener's dial has no deadline")
		}
		return real(ctx, network, addr)
	}
	cfg.Host, cfg.Port = "127.0.0.1", 1
	cfg.Fallbacks = nil
	h := &counting{}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.Nop(), ReconnectDelay: 50 * time.Millisecond})
	run(t, l)
	waitUntil(t, "the listener connected through the configured dialer", l.Connected)
	if dials.Load() == 0 {
		t.Error("connected without calling the configured dialer")
	}
}

// TestHeartbeatOfOldConnection: a heartbeat sent before a reconnect, which
// the new connection can never hear, does not make the listener tear the
// new, healthy connection down as hung.
func TestHeartbeatOfOldConnection(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	h := &counting{}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.Nop(),
		ReconnectDelay: 50 * time.Millisecond, HeartbeatTimeout: time.Second})
	run(t, l)
	waitUntil(t, "the first connect", func() bool { return h.connects.Load() == 1 })
	// Sent, but before the reconnect: lost with the connection.
	l.HeartbeatSent(l.ExpectHeartbeat())
	l.Restart()
	waitUntil(t, "the reconnect", func() bool { return h.connects.Load() == 2 })
	// Past the heartbeat's timeout, with a margin, checked by polling. The
	// timeout is 1 s, not less: Restart must tear the old connection down
	// within it, and a loaded machine has taken 300 ms to.
	deadline := time.Now().Add(2500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if n := l.Stats().HungRestarts; n != 0 {
			t.Fatalf("%d hung restart(s) of the new connection, for a heartbeat of the old one", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := h.connects.Load(); n != 2 {
		t.Errorf("%d connects, want 2", n)
	}
}

// sendHeartbeat sends token on Channel from a connection of its own, as
// the dispatcher's statements do.
func sendHeartbeat(t *testing.T, dsn, token string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), "SELECT pg_notify($1, $2)", notify.Channel, "h:"+token); err != nil {
		t.Fatal(err)
	}
}

// TestDeafUntilHeard: a listener that misses its heartbeats while it has
// never heard one (as through transaction pooling, where LISTEN lands on
// another session) is reported deaf from the second miss, not the first,
// and no longer once a heartbeat comes back.
func TestDeafUntilHeard(t *testing.T) {
	dsn := pgtest.ConnString(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	h := &counting{}
	// A second, not less: the heartbeat sent at the end must come back in
	// time on a loaded machine, or a third miss fails the count.
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.Nop(),
		ReconnectDelay: 50 * time.Millisecond, HeartbeatTimeout: time.Second})
	run(t, l)
	// miss expects a first heartbeat, as the dispatcher's scan after a
	// connect does, never sends it, and waits for the reconnect the miss
	// forces.
	miss := func(n uint64) {
		t.Helper()
		waitUntil(t, "connected", l.Connected)
		connects := h.connects.Load()
		token := l.FirstHeartbeat()
		if token == "" {
			t.Fatalf("FirstHeartbeat() = \"\" after %d misses and none heard, want a token", n-1)
		}
		l.HeartbeatSent(token)
		waitUntil(t, fmt.Sprintf("missed heartbeat %d", n), func() bool { return l.Stats().HungRestarts == n })
		waitUntil(t, "the reconnect", func() bool { return h.connects.Load() > connects })
	}
	miss(1)
	if err := l.Deaf(); err != nil {
		t.Errorf("after one missed heartbeat, Deaf() = %v, want nil", err)
	}
	miss(2)
	if err := l.Deaf(); !errors.Is(err, notify.ErrDeaf) {
		t.Fatalf("after two missed heartbeats and none heard, Deaf() = %v, want ErrDeaf", err)
	}
	if !l.Stats().Deaf {
		t.Error("Stats().Deaf false while Deaf() reports ErrDeaf")
	}
	waitUntil(t, "connected", l.Connected)
	if tok := l.FirstHeartbeat(); tok != "" {
		t.Errorf("FirstHeartbeat() = %q once deaf, want \"\": a deaf listener would reconnect every HeartbeatTimeout", tok)
	}
	waitUntil(t, "connected", l.Connected)
	sendHeartbeat(t, dsn, l.ExpectHeartbeat())
	waitUntil(t, "the heartbeat heard", func() bool { return l.Deaf() == nil })
	if l.Stats().Deaf {
		t.Error("Stats().Deaf still true once a heartbeat came back")
	}
	if n := l.Stats().HungRestarts; n != 2 {
		t.Errorf("%d hung restarts, want 2: the heartbeat sent was missed", n)
	}
}

// TestFirstHeartbeatUntilHeard: FirstHeartbeat asks for a heartbeat while
// none has been heard, and not once one has.
func TestFirstHeartbeatUntilHeard(t *testing.T) {
	dsn := pgtest.ConnString(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.Nop()})
	run(t, l)
	waitUntil(t, "connected", l.Connected)
	token := l.FirstHeartbeat()
	if token == "" {
		t.Fatal("FirstHeartbeat() = \"\" on a listener that has heard nothing, want a token")
	}
	sendHeartbeat(t, dsn, token)
	waitUntil(t, "the heartbeat heard", func() bool { return l.Stats().Notifications == 1 })
	if tok := l.FirstHeartbeat(); tok != "" {
		t.Errorf("FirstHeartbeat() = %q after a heartbeat was heard, want \"\"", tok)
	}
	if n := l.Stats().HungRestarts; n != 0 {
		t.Errorf("%d hung restarts, want 0", n)
	}
}

// TestHeartbeatTimedFromSend: a heartbeat's deadline starts when it is
// reported sent, not when its token is made, so a slow statement carrying
// it (the fallback poll, or the scan after a connect) is not taken for a
// listener that cannot hear.
func TestHeartbeatTimedFromSend(t *testing.T) {
	for _, c := range []struct {
		name   string
		expect func(*notify.Listener) string
		// again is what a second call returns while the first token is
		// outstanding: the poll's is the same token, a first heartbeat
		// is not asked twice.
		again func(token string) string
	}{
		{"poll", (*notify.Listener).ExpectHeartbeat, func(token string) string { return token }},
		{"first", (*notify.Listener).FirstHeartbeat, func(string) string { return "" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := fastWatchdog(t)
			token := c.expect(l)
			if token == "" {
				t.Fatal("no token from a connected listener that has heard nothing")
			}
			if got, want := c.expect(l), c.again(token); got != want {
				t.Errorf("second call = %q while %q is outstanding, want %q", got, token, want)
			}
			// Five timeouts without HeartbeatSent: no miss.
			for end := time.Now().Add(5 * watchdogTimeout); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
				if n := l.Stats().HungRestarts; n != 0 {
					t.Fatalf("%d missed heartbeats before the first was reported sent", n)
				}
			}
			l.HeartbeatSent(token)
			waitUntil(t, "the miss, once sent", func() bool { return l.Stats().HungRestarts == 1 })
		})
	}
}

// TestForgetKeepsSentHeartbeat: a failed send does not cancel the wait for
// the same token that an earlier statement sent, so failing polls cannot
// keep a hung listener in place; a token that was never sent is forgotten.
func TestForgetKeepsSentHeartbeat(t *testing.T) {
	l := fastWatchdog(t)
	never := l.ExpectHeartbeat()
	l.ForgetHeartbeat(never)
	token := l.ExpectHeartbeat()
	if token == never {
		t.Fatalf("ExpectHeartbeat() = %q again after it was forgotten unsent, want a new token", token)
	}
	l.HeartbeatSent(token)
	if again := l.ExpectHeartbeat(); again != token {
		t.Fatalf("ExpectHeartbeat() = %q while %q is on its way, want the same", again, token)
	}
	l.ForgetHeartbeat(token) // the second send failed
	waitUntil(t, "the miss of the heartbeat sent", func() bool { return l.Stats().HungRestarts == 1 })
}

// watchdogTimeout is fastWatchdog's HeartbeatTimeout.
const watchdogTimeout = 100 * time.Millisecond

// fastWatchdog runs a connected listener whose heartbeats time out after
// watchdogTimeout.
func fastWatchdog(t *testing.T) *notify.Listener {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.Nop(),
		ReconnectDelay: 50 * time.Millisecond, HeartbeatTimeout: watchdogTimeout})
	run(t, l)
	waitUntil(t, "connected", l.Connected)
	return l
}

// TestGarbledLeaseNotificationsRateLimited: malformed notifications on the
// lease channel, whose name its listener's session shows to anyone who
// can read pg_stat_activity, are counted, and logged at most once a
// minute, as on the main channel.
func TestGarbledLeaseNotificationsRateLimited(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	h := &counting{}
	const channel = "bellhop_l_test"
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.New(&logs),
		LeaseChannel: channel, OnLease: func(notify.Lease) {}})
	run(t, l)
	waitUntil(t, "the listener connected", l.Connected)
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	const sent = 50
	for range sent {
		if _, err := conn.Exec(context.Background(), `SELECT pg_notify($1, 'garbage')`, channel); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, "every malformed notification counted", func() bool { return l.Stats().Garbled == sent })
	if n := strings.Count(logs.String(), "malformed notification"); n != 1 {
		t.Errorf("%d log lines for %d malformed notifications, want 1:\n%s", n, sent, logs.String())
	}
}

// TestLeaseChannelNotLogged: an error that pgxlisten reports for the
// lease channel names it ("listen \"bellhop_l_...\": ..."), and such
// errors are logged at warn; the name, known only to its dispatcher and
// bellhop_offers, is replaced. The connection's transaction is left
// aborted, so that whichever LISTEN runs first fails (pgxlisten's order
// varies with its map's).
func TestLeaseChannelNotLogged(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	const channel = "bellhop_l_0123456789abcdef"
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs),
		ReconnectDelay: 50 * time.Millisecond, LeaseChannel: channel, OnLease: func(notify.Lease) {},
		OnConnect: func(ctx context.Context, conn *pgx.Conn) error {
			if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
				return err
			}
			_, _ = conn.Exec(ctx, "SELECT 1/0")
			return nil
		}})
	run(t, l)
	waitUntil(t, "a failed LISTEN on the lease channel logged", func() bool {
		return strings.Contains(logs.String(), `listen \"(the lease channel)\"`)
	})
	if strings.Contains(logs.String(), channel) {
		t.Errorf("the lease channel's name was logged:\n%s", logs.String())
	}
}

// TestLeaseChannelHiddenFromActivity: once connected, the listener's
// session does not show a LISTEN on the lease channel as its statement in
// pg_stat_activity, which members of pg_read_all_stats (pg_monitor) can
// read for every session: it showed pgxlisten's last LISTEN, on the lease
// channel whenever that came last in pgxlisten's map order, and such a
// role could then listen on it and read every leased payload (found by
// review). Six connects, so that the order comes out both ways.
func TestLeaseChannelHiddenFromActivity(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const channel = "bellhop_l_0123456789abcdef0123456789abcdef"
	for i := range 6 {
		l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.Nop(),
			LeaseChannel: channel, OnLease: func(notify.Lease) {}})
		lctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- l.Run(lctx) }()
		waitUntil(t, "the listener connected", l.Connected)
		var shown []string
		err := conn.QueryRow(ctx, `SELECT coalesce(array_agg(query), '{}') FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'bellhop-listener'`).Scan(&shown)
		cancel()
		if rerr := <-done; rerr != nil {
			t.Errorf("Run: %v", rerr)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(shown) != 1 {
			t.Fatalf("connect %d: %d listener sessions in pg_stat_activity, want 1: %q", i, len(shown), shown)
		}
		if strings.Contains(shown[0], channel) || !strings.Contains(shown[0], "bellhop listener: listening") {
			t.Fatalf("connect %d: the listener's session shows %q, want the cover statement, not the lease channel", i, shown[0])
		}
		// The server ends a closed session a moment later.
		waitUntil(t, "the listener's session gone", func() bool {
			var n int
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = 'bellhop-listener'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 0
		})
	}
}

// TestLeaseChannelNotInStatements: pg_stat_statements keeps a LISTEN's
// text as it was, where members of pg_read_all_stats read it: the
// listener's session turns utility tracking off where its role may
// (sql/listener_session.sql), and a role that may not still listens, its
// LISTEN recorded, unless the operator turns tracking off for the role
// (docs/lease-at-insert.md). A cluster of its own, with the extension
// loaded, as tests' servers do not load it.
func TestLeaseChannelNotInStatements(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
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
	admin, err := pgx.Connect(ctx, c.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	for _, q := range []string{
		"CREATE EXTENSION pg_stat_statements",
		"CREATE ROLE plain LOGIN", "CREATE ROLE tuned LOGIN",
		"ALTER ROLE tuned SET pg_stat_statements.track_utility = off",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	listen := func(user, channel string) {
		t.Helper()
		cfg, err := pgx.ParseConfig(c.ConnString("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		if user != "" {
			cfg.User = user
		}
		l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.Nop(),
			LeaseChannel: channel, OnLease: func(notify.Lease) {}})
		lctx, lcancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- l.Run(lctx) }()
		waitUntil(t, "the listener of "+channel+" connected", l.Connected)
		lcancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	recorded := func(channel string) bool {
		t.Helper()
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_statements WHERE query LIKE '%' || $1 || '%'", channel).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	const super, plain, tuned = "bellhop_l_5u9e7", "bellhop_l_91a1n", "bellhop_l_7u2ed"
	listen("", super)
	listen("plain", plain)
	listen("tuned", tuned)
	if recorded(super) {
		t.Errorf("a superuser listener's LISTEN on the lease channel is in pg_stat_statements")
	}
	if !recorded(plain) {
		t.Errorf("a plain role's LISTEN is not in pg_stat_statements: the extension records no LISTEN, and the test shows nothing")
	}
	if recorded(tuned) {
		t.Errorf("the LISTEN of a role with pg_stat_statements.track_utility off is in pg_stat_statements")
	}
}

// TestLeaseChannelCoverUnanswered: the statement that hides the lease
// channel's name is part of the set-up: one that gets no answer is given
// up at SetupTimeout, as a LISTEN is, and the listener listens on the next
// connection rather than stay on one that shows the name; one that fails
// (here the connection breaks as it is sent) says so, and the same
// follows.
func TestLeaseChannelCoverUnanswered(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hang  bool
		wants string
	}{
		{"no answer", true, "did not get its LISTEN in place in time"},
		{"broken", false, "could not run the statement that hides its lease channel's name from pg_stat_activity; retrying every"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
			if err != nil {
				t.Fatal(err)
			}
			var dials atomic.Int32
			isCover := func(p []byte) bool { return strings.Contains(string(p), "bellhop listener: listening") }
			if tc.hang {
				silentDialer(cfg, &dials, func(n int32) bool { return n == 1 }, isCover)
			} else {
				real := cfg.DialFunc
				cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
					c, err := real(ctx, network, addr)
					if err != nil || dials.Add(1) != 1 {
						return c, err
					}
					return &breakConn{Conn: c, when: isCover}, nil
				}
			}
			var logs syncBuffer
			h := &counting{}
			const channel = "bellhop_l_0123456789abcdef"
			l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.New(&logs),
				ReconnectDelay: 50 * time.Millisecond, SetupTimeout: time.Second,
				LeaseChannel: channel, OnLease: func(notify.Lease) {}})
			run(t, l)
			waitUntil(t, "the second connection to listen", l.Connected)
			if n := dials.Load(); n < 2 || h.connects.Load() != 1 {
				t.Errorf("%d connections dialled and %d listened; want at least 2 and 1 (the first never ran its cover statement)", n, h.connects.Load())
			}
			if !strings.Contains(logs.String(), tc.wants) {
				t.Errorf("the log does not say why the first connection was replaced (%q):\n%s", tc.wants, logs.String())
			}
			if strings.Contains(logs.String(), channel) {
				t.Errorf("the lease channel's name was logged:\n%s", logs.String())
			}
		})
	}
}

// breakConn closes its connection when when first says so of a write,
// failing that write: a connection that breaks as a statement is sent.
type breakConn struct {
	net.Conn
	when func(p []byte) bool
}

func (c *breakConn) Write(p []byte) (int, error) {
	if c.when(p) {
		_ = c.Conn.Close()
		return 0, errors.New("connection broken by the test")
	}
	return c.Conn.Write(p)
}

// swallowConn passes its traffic on until swallow first says so of a
// write, and from then on drops every write unsent: a server that stops
// answering mid-set-up, its kernel still acknowledging. A deadline set
// on it (pgx's, when its context ends) still ends a read.
type swallowConn struct {
	net.Conn
	swallow  func(p []byte) bool
	silenced atomic.Bool
}

func (c *swallowConn) Write(p []byte) (int, error) {
	if c.silenced.Load() || c.swallow(p) {
		c.silenced.Store(true)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// silentDialer dials cfg's server, and makes the connections for which
// silent(n) holds (n counts from 1) swallowConns with swallow.
func silentDialer(cfg *pgx.ConnConfig, dials *atomic.Int32, silent func(n int32) bool, swallow func([]byte) bool) {
	real := cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		n := dials.Add(1)
		c, err := real(ctx, network, addr)
		if err != nil || !silent(n) {
			return c, err
		}
		return &swallowConn{Conn: c, swallow: swallow}, nil
	}
}

// TestSetupTimeoutBoundsConnect: a server that accepts the connection but
// never answers its start-up (a hung process, a proxy that lost its
// upstream) is given up after SetupTimeout, and tried again. The connect
// had no bound but the dial's: the listener waited in its first connect
// for as long as the server kept the socket open (found by review: one
// attempt in 20s).
func TestSetupTimeoutBoundsConnect(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	silentDialer(cfg, &dials, func(int32) bool { return true }, func([]byte) bool { return true })
	var logs syncBuffer
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs),
		ReconnectDelay: 50 * time.Millisecond, SetupTimeout: 300 * time.Millisecond})
	run(t, l)
	waitUntil(t, "a third connection attempt", func() bool { return dials.Load() >= 3 })
	if l.Connected() {
		t.Error("connected through a server that never answered")
	}
	if !strings.Contains(logs.String(), "no answer within 300ms (SetupTimeout)") {
		t.Errorf("the log does not say the set-up ran out of time:\n%s", logs.String())
	}
}

// TestSetupTimeoutBoundsListen: a connection whose LISTEN is never
// answered is replaced once SetupTimeout has passed since its connect, and
// the next one listens. The heartbeat watches a connection only once it
// listens, so the listener used to wait on that LISTEN for ever.
func TestSetupTimeoutBoundsListen(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	silentDialer(cfg, &dials, func(n int32) bool { return n == 1 }, func(p []byte) bool {
		// Not "bellhop-listener", the start-up's application_name.
		return strings.Contains(strings.ToLower(string(p)), `listen "`)
	})
	var logs syncBuffer
	h := &counting{}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.New(&logs),
		ReconnectDelay: 50 * time.Millisecond, SetupTimeout: time.Second})
	run(t, l)
	waitUntil(t, "the second connection to listen", func() bool { return l.Connected() })
	// Dials: the silenced one, pgx's cancel request for its LISTEN, and
	// the one that listens.
	if n := dials.Load(); n < 2 || h.connects.Load() != 1 {
		t.Errorf("%d connections dialled and %d listened; want at least 2 and 1 (the first never answered its LISTEN)", n, h.connects.Load())
	}
	if !strings.Contains(logs.String(), "did not get its LISTEN in place in time") {
		t.Errorf("the log does not say why the first connection was replaced:\n%s", logs.String())
	}
}

// TestConnectFailuresThrottled: a listener that cannot connect (nothing
// listens on its port) says so, "could not connect the listener", in full
// at warn the first time and then at most once every 30s, the rest at
// debug. Each failed connect was logged at warn, one every ReconnectDelay
// (about 1,800 an hour), as "listener connection lost", though no
// connection had been made.
func TestConnectFailuresThrottled(t *testing.T) {
	// Port 1 on loopback: every connect is refused at once. A port freed
	// by a listener of our own could be taken by a parallel test's server.
	cfg, err := pgx.ParseConfig("postgres://bellhop@127.0.0.1:1/bellhop?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	var logs syncBuffer
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs).Level(zerolog.DebugLevel),
		ReconnectDelay: 10 * time.Millisecond})
	run(t, l)
	// A failed connect is logged before the next one is dialled.
	waitUntil(t, "ten connection attempts", func() bool { return dials.Load() >= 10 })
	var warn, debug int
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		switch {
		case strings.Contains(line, "listener connection lost"):
			t.Errorf("a failed connect logged as a connection lost: %s", line)
		case !strings.Contains(line, "could not connect the listener; retrying every 10ms"):
		case strings.Contains(line, `"level":"warn"`):
			warn++
			if !strings.Contains(line, "connection refused") {
				t.Errorf("the first failure not logged in full: %s", line)
			}
		case strings.Contains(line, `"level":"debug"`):
			debug++
		}
	}
	if warn != 1 || debug < 8 {
		t.Errorf("%d warn and %d debug lines for %d failed connects, want 1 warn and the rest at debug:\n%s", warn, debug, dials.Load(), logs.String())
	}
}

// failListen is an OnConnect hook that leaves the connection's transaction
// aborted, so that every LISTEN on it fails, as on a server in recovery
// (a hot standby refuses LISTEN with SQLSTATE 25006), and counts the
// connects.
func failListen(connects *atomic.Int32) func(context.Context, *pgx.Conn) error {
	return func(ctx context.Context, conn *pgx.Conn) error {
		connects.Add(1)
		if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
			return err
		}
		_, _ = conn.Exec(ctx, "SELECT 1/0")
		return nil
	}
}

// TestListenFailuresThrottled: a listener that connects but cannot LISTEN
// says so, "could not listen", in full at warn the first time and then at
// most once every 30s, the rest at debug, as for a connect that fails; so
// does one whose OnConnect fails. Each was logged at warn as "listener
// connection lost", one every ReconnectDelay (about 1,800 an hour against a
// hot standby).
func TestListenFailuresThrottled(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hook  func(connects *atomic.Int32) func(context.Context, *pgx.Conn) error
		cause string // in the first line
	}{
		{"LISTEN fails", failListen, "current transaction is aborted"},
		{"OnConnect fails", func(connects *atomic.Int32) func(context.Context, *pgx.Conn) error {
			return func(context.Context, *pgx.Conn) error {
				connects.Add(1)
				return errors.New("no lease key (test)")
			}
		}, "no lease key (test)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
			if err != nil {
				t.Fatal(err)
			}
			var connects atomic.Int32
			var logs syncBuffer
			l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs).Level(zerolog.DebugLevel),
				ReconnectDelay: 10 * time.Millisecond, OnConnect: tc.hook(&connects)})
			run(t, l)
			// The failure is logged before the next connect: the ninth
			// connect means eight set-ups failed and were logged.
			waitUntil(t, "nine connects", func() bool { return connects.Load() >= 9 })
			var warn, debug int
			for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
				switch {
				case strings.Contains(line, "listener connection lost"):
					t.Errorf("a failed set-up logged as a connection lost: %s", line)
				case !strings.Contains(line, "the listener connected but could not listen; retrying every 10ms"):
				case strings.Contains(line, `"level":"warn"`):
					warn++
					if !strings.Contains(line, tc.cause) {
						t.Errorf("the first failure not logged in full: %s", line)
					}
				case strings.Contains(line, `"level":"debug"`):
					debug++
				}
			}
			if warn != 1 || debug < 7 || l.Connected() {
				t.Errorf("%d warn and %d debug lines for %d connects (connected %v), want 1 warn and the rest at debug:\n%s",
					warn, debug, connects.Load(), l.Connected(), logs.String())
			}
		})
	}
}

// TestFailedListenDisarmsSetupTimer: a connection whose LISTEN fails is
// gone, and the next connect waits for ReconnectDelay even when that is
// longer than SetupTimeout. The set-up timer stayed armed: it fired,
// logged that the connection "did not get its LISTEN in place in time" and
// reconnected at once.
func TestFailedListenDisarmsSetupTimer(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	// Long enough for a connect, the session's set-up and OnConnect on a
	// loaded machine: with 200ms, CI's set-up took nearly all of it, the
	// timer fired before the LISTEN failed, as it should then, and the
	// test counted that reconnect.
	const setup = time.Second
	var connects atomic.Int32
	var logs syncBuffer
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs),
		ReconnectDelay: time.Hour, SetupTimeout: setup, OnConnect: failListen(&connects)})
	run(t, l)
	waitUntil(t, "the failed LISTEN logged", func() bool { return strings.Contains(logs.String(), "could not listen") })
	// Past the set-up timer's end (at most setup after the connect began,
	// before the failure), checked by polling.
	deadline := time.Now().Add(2 * setup)
	for time.Now().Before(deadline) {
		if n := connects.Load(); n != 1 {
			t.Fatalf("%d connects within %s of a failed LISTEN, with ReconnectDelay an hour; want 1:\n%s", n, 2*setup, logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if strings.Contains(logs.String(), "in place in time") {
		t.Errorf("the set-up timer fired after the failed LISTEN:\n%s", logs.String())
	}
}

// TestIdleSessionTimeoutOff: an idle_session_timeout set for the database
// (or a role, PostgreSQL 14 and later) does not end the listener's
// session. Receiving notifications does not count as activity, so the
// server ended it every timeout ("terminating connection due to
// idle-session timeout", SQLSTATE 57P05), and each time the listener was
// away, and the dispatcher not ready, for ReconnectDelay, and reloaded
// everything (review: 3 connects in 8s at 1s).
func TestIdleSessionTimeoutOff(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	const timeout = 300 * time.Millisecond
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	_, err = admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s SET idle_session_timeout = %d",
		pgx.Identifier{cfg.Database}.Sanitize(), timeout.Milliseconds()))
	admin.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The setting is in force for a new session.
	check, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	var got string
	err = check.QueryRow(ctx, "SHOW idle_session_timeout").Scan(&got)
	check.Close(ctx)
	if err != nil || got != timeout.String() {
		t.Fatalf("a new session's idle_session_timeout = %q (%v), want %s", got, err, timeout)
	}

	var logs syncBuffer
	h := &counting{}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.New(&logs),
		ReconnectDelay: 50 * time.Millisecond})
	run(t, l)
	waitUntil(t, "connected", l.Connected)
	// Five timeouts, checked by polling.
	for end := time.Now().Add(5 * timeout); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if s := l.Stats(); s.Connects != 1 || !s.Connected {
			t.Fatalf("%d connects, connected %v, within %s with idle_session_timeout %s; want 1 and true:\n%s",
				s.Connects, s.Connected, 5*timeout, timeout, logs.String())
		}
	}
	if strings.Contains(logs.String(), "connection lost") {
		t.Errorf("the listener's connection was lost:\n%s", logs.String())
	}
}

// notifyFrom sends each payload on channel, each in a transaction of its
// own, from a connection of its own.
func notifyFrom(t *testing.T, dsn, channel string, payloads ...string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	for _, p := range payloads {
		if _, err := conn.Exec(context.Background(), "SELECT pg_notify($1, $2)", channel, p); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLeftoverListenDropped: a session that already listens on another
// channel when the listener gets it (a session-pooling PgBouncer whose
// server_reset_query no longer runs DISCARD ALL) stops listening there:
// its notifications, for which the listener has no handler, do not reach
// it. pgxlisten reported each as an error, and the listener took that for
// a lost connection (TestUnhandledNotificationKeepsConnection).
func TestLeftoverListenDropped(t *testing.T) {
	dsn := pgtest.ConnString(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	// What the pooler hands over: a session that listens already.
	cfg.AfterConnect = func(ctx context.Context, pc *pgconn.PgConn) error {
		_, err := pc.Exec(ctx, "LISTEN leftover").ReadAll()
		return err
	}
	var logs syncBuffer
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: &counting{}, Logger: zerolog.New(&logs)})
	run(t, l)
	waitUntil(t, "connected", l.Connected)
	notifyFrom(t, dsn, "leftover", "x")
	// Committed after the leftover one: heard after it, had it been heard.
	sendHeartbeat(t, dsn, l.ExpectHeartbeat())
	waitUntil(t, "the heartbeat heard", func() bool { return l.Stats().Notifications == 1 })
	if s := l.Stats(); s.Ignored != 0 || !s.Connected || s.Connects != 1 {
		t.Errorf("Stats() = %+v; want no notification ignored, connected, 1 connect: the session still listened on the leftover channel\n%s",
			s, logs.String())
	}
}

// TestUnhandledNotificationKeepsConnection: a notification on a channel
// the listener has no handler for (OnConnect listened there) is counted
// as ignored, logged once, and leaves the connection as it is: connected,
// and watched by the heartbeat. pgxlisten reports it ("missing handler:
// leftover") as it does a lost connection, and the listener marked a live
// connection disconnected for good: not ready, and never again checked by
// the heartbeat, so that a later hang went unnoticed.
func TestUnhandledNotificationKeepsConnection(t *testing.T) {
	dsn := pgtest.ConnString(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	h := &counting{}
	l := notify.New(notify.Config{ConnConfig: cfg, Handler: h, Logger: zerolog.New(&logs),
		ReconnectDelay: 50 * time.Millisecond, HeartbeatTimeout: watchdogTimeout,
		OnConnect: func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, "LISTEN leftover")
			return err
		}})
	run(t, l)
	waitUntil(t, "connected", l.Connected)
	const sent = 3
	notifyFrom(t, dsn, "leftover", "1", "2", "3")
	// Another's heartbeat, committed after them: heard after them.
	sendHeartbeat(t, dsn, "0123456789abcdef")
	waitUntil(t, "the heartbeat after them heard", func() bool { return l.Stats().Notifications == 1 })
	if s := l.Stats(); !s.Connected || s.Connects != 1 || s.Ignored != sent {
		t.Fatalf("after %d notifications on a channel with no handler, Stats() = %+v; want connected, 1 connect, %d ignored:\n%s",
			sent, s, sent, logs.String())
	}
	if strings.Contains(logs.String(), "connection lost") {
		t.Errorf("an ignored notification logged as a connection lost:\n%s", logs.String())
	}
	var warn int
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "missing handler: leftover") && strings.Contains(line, `"level":"warn"`) {
			warn++
		}
	}
	if warn != 1 {
		t.Errorf("%d warn lines for %d ignored notifications, want 1, the rest at debug:\n%s", warn, sent, logs.String())
	}
	// The heartbeat still watches the connection: a heartbeat never sent
	// is missed, and the connection replaced.
	token := l.FirstHeartbeat()
	if token == "" {
		t.Fatal("FirstHeartbeat() = \"\" on a connected listener that has heard none")
	}
	l.HeartbeatSent(token)
	waitUntil(t, "the missed heartbeat", func() bool { return l.Stats().HungRestarts == 1 })
	waitUntil(t, "the reconnect", func() bool { return h.connects.Load() == 2 })
}
