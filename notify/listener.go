// Package notify keeps one dedicated LISTEN connection on Channel and turns
// notifications into wake-ups.
//
// It wraps github.com/jackc/pgxlisten, adding what a dispatcher needs on
// top: payload parsing that tolerates hostile input, a connected flag for
// readiness, a few seconds' reconnect delay, a "connected" hook on every
// (re)connect (pgxlisten's backlog handler, which runs after LISTEN, so
// nothing committed in between is missed), a session that no
// idle_session_timeout ends and that listens on nothing else, and a
// heartbeat watchdog that tears down a listener that has stopped
// receiving, and reports one that has never received (Deaf).
//
// The package is importable, since the repository's layout puts it at the
// top level, but it is a part of the dispatcher in package bellhop, not an
// API of its own: its names and payload formats change with the
// migrations and with package bellhop, and no release keeps them. Use
// package bellhop.
package notify

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/logthrottle"
	queries "github.com/bellhopq/bellhop/sql"
)

// Handler receives what the listener hears. Both methods run on the
// listener's goroutine and must return at once: route, don't work.
type Handler interface {
	// HandleEvent is called for every well-formed notification except
	// heartbeats (h:), which the listener keeps, ours and any other's.
	HandleEvent(Event)
	// Connected is called after every connect and reconnect, once LISTEN
	// is in place. Work committed while the listener was away has sent
	// notifications nobody heard, so the handler should look everywhere.
	Connected()
}

// Config configures a Listener.
type Config struct {
	// ConnConfig is copied for every connection. It must reach PostgreSQL
	// directly or through a session-mode pooler: LISTEN does not work
	// through PgBouncer's transaction mode.
	ConnConfig *pgx.ConnConfig
	// BeforeConnect, if set, is called with each connection's copy of
	// ConnConfig before it connects, as pgxpool calls its own: where a
	// caller's pool sets credentials per connection (a rotated password,
	// a cloud IAM token), the listener needs them too. An error fails the
	// connect, and the listener tries again after ReconnectDelay. The
	// copy it gets has application_name bellhop-listener, which it may
	// change; the listener's dialer keep-alive is applied after it.
	BeforeConnect func(ctx context.Context, cfg *pgx.ConnConfig) error
	// AfterConnect, if set, runs on every new connection as soon as it is
	// made, as pgxpool runs its own, before the listener sets up its
	// session (so that a hook that sets idle_session_timeout or LISTENs
	// cannot undo that set-up) and before OnConnect. An error drops the
	// connection, as OnConnect's does.
	AfterConnect func(ctx context.Context, conn *pgx.Conn) error
	Handler      Handler
	Logger       zerolog.Logger
	// ReconnectDelay is the pause between a lost connection and the next
	// attempt. Default 2s (pgxlisten's own default is one minute).
	ReconnectDelay time.Duration
	// HeartbeatTimeout is how long a heartbeat may take to come back,
	// from the commit that sent it, before the connection is considered
	// hung and replaced. Default 5s.
	HeartbeatTimeout time.Duration
	// LeaseChannel, if set, is also listened on, and its notifications,
	// parsed by ParseLease, go to OnLease (on the listener's goroutine:
	// route, don't work). Handler.Connected runs once both channels are
	// listened on. The name is kept out of the log: only the dispatcher
	// and bellhop_offers know it.
	LeaseChannel string
	OnLease      func(Lease)
	// OnConnect, if set, runs on every new connection before LISTEN (and
	// after the listener has turned idle_session_timeout off and dropped
	// any LISTEN the session came with: sql/listener_session.sql), to set
	// up session state that must live and die with the listener (a
	// leasing dispatcher's lease key). An error drops the connection, and
	// the listener tries again after ReconnectDelay.
	OnConnect func(ctx context.Context, conn *pgx.Conn) error
	// SetupTimeout bounds a connection's set-up: BeforeConnect,
	// connecting and authenticating, AfterConnect, OnConnect, the LISTENs and, with a LeaseChannel,
	// the statement that follows them (sql/listener_cover.sql). A server that accepts
	// the connection but never answers (a hung process, a proxy that lost
	// its upstream) would otherwise hold the listener in its set-up for
	// ever, since the heartbeat only watches a connection once it
	// listens. Default twice HeartbeatTimeout, at least 10s.
	SetupTimeout time.Duration
}

// Stats are counters for metrics.
type Stats struct {
	Connected     bool
	Connects      uint64 // successful connects, the first included
	Notifications uint64 // well-formed notifications received
	Garbled       uint64 // malformed notifications ignored
	HungRestarts  uint64 // reconnects forced by a missed heartbeat
	Ignored       uint64 // notifications on a channel with no handler (one OnConnect listens on), and handler errors
	Deaf          bool   // Deaf reports an error
}

// Listener is one LISTEN connection with its supervisor. Create it with New.
type Listener struct {
	cfg     Config
	restart chan struct{}

	connected     atomic.Bool
	connects      atomic.Uint64
	notifications atomic.Uint64
	garbled       atomic.Uint64
	hungRestarts  atomic.Uint64
	ignored       atomic.Uint64
	// ignoreLog bounds the lines about ignored notifications.
	ignoreLog *logthrottle.Throttle
	// conn is the connection handed to pgxlisten last, nil while none is.
	// pgxlisten closes it before it reports the error that ended it, and
	// reports other errors while it is open (logError).
	conn atomic.Pointer[pgx.Conn]
	// beatHeard is set once one of our heartbeats has come back, on any
	// connection.
	beatHeard atomic.Bool

	// connectFailed is set while the last connect failed (logError), and
	// connectLog bounds those lines and those of a set-up that failed
	// once connected (OnConnect, a LISTEN): pgxlisten reports each
	// failure, one every ReconnectDelay while the database is away or
	// refuses LISTEN (a hot standby, SQLSTATE 25006).
	connectFailed atomic.Bool
	connectLog    *logthrottle.Throttle
	// coverFailed holds why the statement after the LISTENs
	// (HandleBacklog) failed on the connection being set up, for
	// logError's line; connect clears it.
	coverFailed atomic.Pointer[error]

	mu          sync.Mutex
	pendingBeat string
	// pendingArmed is set once pendingBeat's deadline runs.
	pendingArmed   bool
	lastGarbledLog time.Time
	// listened counts the channels listened on since the last connect.
	listened atomic.Int32
	// setups counts connects; setupTimer, under mu, restarts the one in
	// set-up if its LISTENs are not in place within SetupTimeout.
	setups     atomic.Uint64
	setupTimer *time.Timer
}

// New returns a Listener; call Run to start it.
func New(cfg Config) *Listener {
	if cfg.ReconnectDelay <= 0 {
		cfg.ReconnectDelay = 2 * time.Second
	}
	if cfg.HeartbeatTimeout <= 0 {
		cfg.HeartbeatTimeout = 5 * time.Second
	}
	if cfg.SetupTimeout <= 0 {
		cfg.SetupTimeout = max(10*time.Second, 2*cfg.HeartbeatTimeout)
	}
	return &Listener{cfg: cfg, restart: make(chan struct{}, 1), connectLog: logthrottle.New(1, connectLogInterval),
		ignoreLog: logthrottle.New(1, ignoreLogInterval)}
}

// Run listens until ctx is done, reconnecting after every failure. It
// returns nil after ctx is cancelled, or an error if it cannot start.
func (l *Listener) Run(ctx context.Context) error {
	if l.cfg.ConnConfig == nil || l.cfg.Handler == nil {
		return errors.New("notify: ConnConfig and Handler are required")
	}
	for {
		lctx, cancel := context.WithCancel(ctx)
		pl := &pgxlisten.Listener{
			Connect:        l.connect,
			LogError:       l.logError,
			ReconnectDelay: l.cfg.ReconnectDelay,
		}
		pl.Handle(Channel, handler{l})
		if l.cfg.LeaseChannel != "" {
			pl.Handle(l.cfg.LeaseChannel, leaseHandler{handler{l}})
		}
		done := make(chan error, 1)
		go func() { done <- pl.Listen(lctx) }()

		select {
		case <-ctx.Done():
			cancel()
			<-done
			l.connected.Store(false)
			return nil
		case <-l.restart:
			cancel()
			<-done
			l.connected.Store(false)
		case err := <-done:
			cancel()
			l.connected.Store(false)
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

// Connected reports whether LISTEN is in place right now.
func (l *Listener) Connected() bool { return l.connected.Load() }

// deafAfter is how many heartbeats must be missed, with none ever heard,
// before Deaf reports the listener deaf. One is not enough: a first
// heartbeat can be lost to a slow start.
const deafAfter = 2

// needsSession is what a listener that hears no heartbeat most likely
// lacks.
const needsSession = "LISTEN needs a session of its own, so give the dispatcher a direct connection or a session-pooling PgBouncer, not transaction pooling"

// ErrDeaf is what Deaf returns.
var ErrDeaf = errors.New("listener has heard none of its heartbeats: " + needsSession)

// Deaf returns ErrDeaf once deafAfter heartbeats have been missed while
// none has ever come back, and nil from the moment one does. It is how a
// listener that connects but can never hear (LISTEN through PgBouncer's
// transaction pooling) looks, where Connected alone says all is well.
func (l *Listener) Deaf() error {
	if !l.beatHeard.Load() && l.hungRestarts.Load() >= deafAfter {
		return ErrDeaf
	}
	return nil
}

// Stats returns the listener's counters.
func (l *Listener) Stats() Stats {
	return Stats{
		Connected:     l.connected.Load(),
		Connects:      l.connects.Load(),
		Notifications: l.notifications.Load(),
		Garbled:       l.garbled.Load(),
		HungRestarts:  l.hungRestarts.Load(),
		Ignored:       l.ignored.Load(),
		Deaf:          l.Deaf() != nil,
	}
}

// Restart drops the current connection and connects again at once.
func (l *Listener) Restart() {
	select {
	case l.restart <- struct{}{}:
	default:
	}
}

// ExpectHeartbeat returns a token for the caller to send as "h:<token>"
// on Channel, and to report sent with HeartbeatSent once the statement
// that sent it has committed. If the listener does not hear it back within
// HeartbeatTimeout of that report, the connection is presumed hung and
// replaced: timing it from the commit, not from the call, keeps a slow
// statement from being taken for a hung listener. While a token is still
// outstanding, the same token is returned again and a deadline already
// running stands: were each send to start a fresh wait, callers sending
// more often than HeartbeatTimeout (a short fallback poll) would keep a
// hung listener alive for ever. A caller whose send failed calls
// ForgetHeartbeat, and so does one whose send got no answer at all (its
// notification was rolled back with the cancelled statement); that one
// may Restart the listener too, whose connection is likely on the same
// dead path. Sends must not overlap: a failed one forgets the token
// that another, still on its way, carries too, and that one then goes
// unchecked.
func (l *Listener) ExpectHeartbeat() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pendingLocked()
}

// FirstHeartbeat returns a token to send as "h:<token>" on Channel right
// after the listener has connected (the dispatcher's scan after each
// connect), or "" when none is wanted: once one has been heard, once
// deafAfter have been missed, or while another is on its way. So a
// listener that can never hear is deaf within about deafAfter ×
// HeartbeatTimeout of starting, not deafAfter fallback polls, and a deaf
// one is not kept reconnecting every HeartbeatTimeout. As with
// ExpectHeartbeat, the caller reports the send with HeartbeatSent or its
// failure with ForgetHeartbeat.
func (l *Listener) FirstHeartbeat() string {
	if !l.connected.Load() || l.beatHeard.Load() || l.hungRestarts.Load() >= deafAfter {
		return ""
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pendingBeat != "" {
		return ""
	}
	return l.pendingLocked()
}

// HeartbeatSent starts the deadline of token, from ExpectHeartbeat or
// FirstHeartbeat, now that its notification is committed, unless it runs
// already.
func (l *Listener) HeartbeatSent(token string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pendingBeat == token {
		l.armLocked(token)
	}
}

// pendingLocked returns the outstanding token, making one if there is
// none.
func (l *Listener) pendingLocked() string {
	if l.pendingBeat == "" {
		var b [16]byte
		_, _ = rand.Read(b[:])
		l.pendingBeat = hex.EncodeToString(b[:])
		l.pendingArmed = false
	}
	return l.pendingBeat
}

// clearLocked drops the outstanding token.
func (l *Listener) clearLocked() {
	l.pendingBeat = ""
	l.pendingArmed = false
}

// armLocked starts token's deadline, unless it runs already.
func (l *Listener) armLocked(token string) {
	if l.pendingArmed {
		return
	}
	l.pendingArmed = true
	time.AfterFunc(l.cfg.HeartbeatTimeout, func() {
		// connected is read under mu, as HandleBacklog sets it: read
		// after, it could be a new connection's, which this token's
		// miss must not condemn.
		l.mu.Lock()
		missed := l.pendingBeat == token && l.connected.Load()
		if l.pendingBeat == token {
			l.clearLocked()
		}
		l.mu.Unlock()
		if missed {
			l.hungRestarts.Add(1)
			ev := l.cfg.Logger.Warn().Stringer("timeout", l.cfg.HeartbeatTimeout)
			if !l.beatHeard.Load() {
				// What a connection that cannot LISTEN looks like: its
				// LISTEN succeeded on a server session that is not the
				// one the listener then waits on.
				ev = ev.Str("hint", "no heartbeat has ever come back: "+needsSession)
			}
			ev.Msg("listener did not receive its heartbeat; reconnecting")
			l.Restart()
		}
	})
}

// ForgetHeartbeat cancels the wait for token after its send failed. A
// token that an earlier statement sent (HeartbeatSent) is still on its
// way, and stays awaited.
func (l *Listener) ForgetHeartbeat(token string) {
	l.mu.Lock()
	if l.pendingBeat == token && !l.pendingArmed {
		l.clearLocked()
	}
	l.mu.Unlock()
}

// setUp readies a new connection: the caller's AfterConnect, then the
// listener's session (idle_session_timeout off, and no LISTEN but
// pgxlisten's: sql/listener_session.sql), then OnConnect.
func (l *Listener) setUp(ctx context.Context, conn *pgx.Conn) error {
	if l.cfg.AfterConnect != nil {
		if err := l.cfg.AfterConnect(ctx, conn); err != nil {
			return fmt.Errorf("AfterConnect: %w", err)
		}
	}
	if _, err := conn.Exec(ctx, queries.ListenerSession); err != nil {
		return fmt.Errorf("set up the listener's session: %w", err)
	}
	if l.cfg.OnConnect != nil {
		return l.cfg.OnConnect(ctx, conn)
	}
	return nil
}

func (l *Listener) connect(ctx context.Context) (*pgx.Conn, error) {
	l.connected.Store(false)
	l.listened.Store(0)
	l.coverFailed.Store(nil)
	l.conn.Store(nil)
	setup := l.setups.Add(1)
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, l.cfg.SetupTimeout)
	defer cancel()
	cfg := l.cfg.ConnConfig.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["application_name"] = "bellhop-listener"
	if l.cfg.BeforeConnect != nil {
		if err := l.cfg.BeforeConnect(cctx, cfg); err != nil {
			l.connectFailed.Store(true)
			return nil, fmt.Errorf("BeforeConnect: %w", err)
		}
	}
	cfg.DialFunc = keepAliveDial(cfg.DialFunc)
	// pgx buffers notifications only when OnNotification is nil, and
	// pgxlisten relies on that buffer.
	cfg.OnNotification = nil
	conn, err := pgx.ConnectConfig(cctx, cfg)
	// A failed session set-up or OnConnect is a failed set-up, as a failed
	// LISTEN is, not a failed connect (logError).
	l.connectFailed.Store(err != nil)
	if err == nil {
		err = l.setUp(cctx, conn)
		if err != nil {
			_ = conn.Close(ctx)
			conn = nil
		}
	}
	if err != nil {
		if cctx.Err() != nil && ctx.Err() == nil {
			err = fmt.Errorf("no answer within %s (SetupTimeout): %w", l.cfg.SetupTimeout, err)
		}
		return nil, err
	}
	// pgxlisten LISTENs next, on its own context: what is left of the
	// set-up's time bounds that too.
	// The timer is disarmed (setupFailed) if a LISTEN fails: that
	// connection is gone, and the next comes after ReconnectDelay, which
	// the timer would otherwise cut short when longer than SetupTimeout.
	// It checks under mu that it is still the one armed, in case it fires
	// as it is stopped.
	l.mu.Lock()
	l.stopSetupTimerLocked()
	var timer *time.Timer
	timer = time.AfterFunc(l.cfg.SetupTimeout-time.Since(start), func() {
		l.mu.Lock()
		armed := l.setupTimer == timer
		l.mu.Unlock()
		if armed && l.setups.Load() == setup && l.listened.Load() < l.channels() && ctx.Err() == nil {
			l.cfg.Logger.Warn().Stringer("setup_timeout", l.cfg.SetupTimeout).
				Msg("listener connection did not get its LISTEN in place in time; reconnecting")
			l.Restart()
		}
	})
	l.setupTimer = timer
	l.mu.Unlock()
	l.conn.Store(conn)
	return conn, nil
}

// stopSetupTimerLocked disarms the set-up timer, if one is armed. l.mu
// must be held.
func (l *Listener) stopSetupTimerLocked() {
	if l.setupTimer != nil {
		l.setupTimer.Stop()
		l.setupTimer = nil
	}
}

// channels is how many channels a connection listens on.
func (l *Listener) channels() int32 {
	if l.cfg.LeaseChannel != "" {
		return 2
	}
	return 1
}

// keepAliveDial wraps the configured dialer (a cloud connector's, a
// tunnel's: the pool and the listener must reach the server the same way)
// with a 10s limit, and sets TCP keepalive so that a dead network path is
// noticed in about 25s instead of the kernel's two hours; SetupTimeout
// and then the heartbeat cover a hung server.
func keepAliveDial(dial pgconn.DialFunc) pgconn.DialFunc {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if tc, ok := conn.(*net.TCPConn); ok {
			_ = tc.SetKeepAliveConfig(net.KeepAliveConfig{
				Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3,
			})
		}
		return conn, nil
	}
}

func (l *Listener) logError(ctx context.Context, err error) {
	if errors.Is(err, context.Canceled) || ctx.Err() != nil {
		return
	}
	text := err.Error()
	if c := l.cfg.LeaseChannel; c != "" {
		// pgxlisten's errors name the channel it failed to listen on; the
		// lease channel's name is kept out of the log (Config.LeaseChannel).
		text = strings.ReplaceAll(text, c, "(the lease channel)")
	}
	// pgxlisten closes the connection before it reports the error that
	// ended it (a failed connect, a failed LISTEN, a failed wait for
	// notifications). An error reported while the connection is open
	// left it in place: a notification on a channel with no handler
	// ("missing handler: ..."), or a handler's error (ours return none).
	// Taken for a lost connection, it marked a live one disconnected for
	// good, which also kept the heartbeat from watching it.
	if c := l.conn.Load(); c != nil && !c.IsClosed() {
		n := l.ignored.Add(1)
		l.ignoreLog.Event(&l.cfg.Logger, zerolog.WarnLevel, 1).Str("error", text).Uint64("ignored_total", n).
			Msgf("ignoring a notification the listener has no use for; the connection stays (logged at most once every %s; held_back counts the ones not logged)",
				ignoreLogInterval)
		return
	}
	l.connected.Store(false)
	// No listening connection was made: nothing was lost. The first
	// failure of a connect or a set-up is logged in full, then one every
	// connectLogInterval, the others at debug.
	what := ""
	switch {
	case l.connectFailed.Load():
		what = "could not connect the listener"
	case l.listened.Load() < l.channels():
		// Connected, but OnConnect, a LISTEN or the statement after them
		// failed (a server in recovery refuses LISTEN): each connect
		// fails the same way, and the next comes after ReconnectDelay,
		// not SetupTimeout.
		l.setupFailed()
		what = "the listener connected but could not listen"
		if cerr := l.coverFailed.Load(); cerr != nil {
			// The error pgxlisten reports is the closed connection's.
			what = "the listener connected but could not run the statement that hides its lease channel's name from pg_stat_activity"
			text = (*cerr).Error()
		}
	default:
		l.cfg.Logger.Warn().Str("error", text).Stringer("reconnect_delay", l.cfg.ReconnectDelay).Msg("listener connection lost")
		return
	}
	l.connectLog.Event(&l.cfg.Logger, zerolog.WarnLevel, 1).Str("error", text).Stringer("reconnect_delay", l.cfg.ReconnectDelay).
		Msgf("%s; retrying every %s (logged at most once every %s; held_back counts the failures not logged)",
			what, l.cfg.ReconnectDelay, connectLogInterval)
}

// setupFailed disarms the set-up timer of a connection whose set-up
// failed.
func (l *Listener) setupFailed() {
	l.mu.Lock()
	l.stopSetupTimerLocked()
	l.mu.Unlock()
}

// connectLogInterval is how often a listener that cannot connect says so.
const connectLogInterval = 30 * time.Second

// ignoreLogInterval is how often a listener that ignores notifications
// says so: whoever can send on a channel could otherwise flood the log.
const ignoreLogInterval = time.Minute

func (l *Listener) receive(payload string) {
	ev, err := Parse(payload)
	if err != nil {
		l.discard("bellhop", err)
		return
	}
	l.notifications.Add(1)
	if ev.Kind == KindHeartbeat {
		l.mu.Lock()
		if l.pendingBeat == ev.Token {
			l.clearLocked()
			l.beatHeard.Store(true)
		}
		l.mu.Unlock()
		return
	}
	l.cfg.Handler.HandleEvent(ev)
}

// discard counts a malformed notification, and logs one at most once a
// minute: whoever can send on a channel could otherwise flood the log.
func (l *Listener) discard(channel string, err error) {
	n := l.garbled.Add(1)
	l.mu.Lock()
	logIt := time.Since(l.lastGarbledLog) > time.Minute
	if logIt {
		l.lastGarbledLog = time.Now()
	}
	l.mu.Unlock()
	if logIt {
		l.cfg.Logger.Warn().Err(err).Str("channel", channel).Uint64("garbled_total", n).
			Msg("ignoring a malformed notification (logged at most once a minute)")
	}
}

// handler adapts Listener to pgxlisten's Handler and BacklogHandler.
type handler struct{ l *Listener }

func (h handler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h.l.receive(n.Payload)
	return nil
}

// HandleBacklog runs after every LISTEN; once every channel is listened
// on, it marks the connection live and lets the dispatcher catch up on
// what it could not hear. With a lease channel, it first runs a statement
// that replaces the LISTEN naming it in pg_stat_activity
// (sql/listener_cover.sql); if that fails, it closes the connection
// rather than leave the name shown, and the listener connects again.
// pgxlisten calls it from one goroutine, one channel after the other.
func (h handler) HandleBacklog(ctx context.Context, _ string, conn *pgx.Conn) error {
	l := h.l
	if l.listened.Load()+1 < l.channels() {
		l.listened.Add(1)
		return nil
	}
	if l.cfg.LeaseChannel != "" {
		// Counted as set-up until it is done, the last LISTEN not yet
		// counted: the set-up timer bounds it, and logError takes the
		// closed connection for a failed set-up, whose lines it throttles.
		// A cover error cannot name the channel: it names no channel.
		if _, err := conn.Exec(ctx, queries.ListenerCover); err != nil {
			l.coverFailed.Store(&err) // logged by logError, once the close is reported
			_ = conn.Close(ctx)
			return nil
		}
	}
	l.listened.Add(1)
	// A heartbeat sent before LISTEN was in place, on the lost connection
	// or on this one, never comes back; it must not condemn this one.
	h.l.mu.Lock()
	h.l.clearLocked()
	h.l.connected.Store(true)
	h.l.mu.Unlock()
	h.l.connects.Add(1)
	h.l.cfg.Logger.Info().Msg("listening for notifications")
	h.l.cfg.Handler.Connected()
	return nil
}

// leaseHandler receives the lease channel's notifications.
type leaseHandler struct{ handler }

func (h leaseHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	l := h.l
	lease, err := ParseLease(n.Payload)
	if err != nil {
		l.discard("lease", ErrGarbled)
		return nil
	}
	l.notifications.Add(1)
	if l.cfg.OnLease != nil {
		l.cfg.OnLease(lease)
	}
	return nil
}
