package bellhop

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/backoff"
	"github.com/bellhopq/bellhop/internal/busylock"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/probe"
	"github.com/bellhopq/bellhop/internal/timeout"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
	"github.com/bellhopq/bellhop/notify"
	"github.com/bellhopq/bellhop/reclaim"
	queries "github.com/bellhopq/bellhop/sql"
)

// Dispatcher defaults.
const (
	// DefaultPollInterval is the fallback poll's period. The poll only
	// catches what a lost notification missed; listener outages are
	// caught up on reconnect, delayed messages have timers and expired
	// leases have the reclaim timer. A minute keeps an idle dispatcher at
	// one statement per minute, and bounds the delay of a message whose
	// notification was lost.
	DefaultPollInterval = time.Minute
	// DefaultShutdownGrace is how long a stopping dispatcher lets
	// in-flight handlers finish before it cancels them and releases
	// their messages (see Dispatcher.Run).
	DefaultShutdownGrace = 10 * time.Second
	// StopBudget is the time a stop gives all of its writes once its
	// handlers are done, ending no later than the stop's bound (see
	// Dispatcher.Run): the offers' withdrawal, while the handlers'
	// outcomes (and the releases the withdrawal adds) are written in the
	// background; then the rest of the outcomes, the wake-up of the other
	// dispatchers, the busy marks' deletion and the last last_fired_at
	// update, in that order. Once it
	// has run out (a frozen server, a failover seen from the old side),
	// the write under way is cancelled and the others are skipped: an
	// outcome not written leaves its message to come back after its lease,
	// offers and busy marks expire by themselves, the other dispatchers
	// find the retries this one had timed at their fallback poll, and
	// last_fired_at misses the stop's last second.
	StopBudget = 5 * time.Second
	// DefaultBusyLease: see DispatcherConfig.BusyLease.
	DefaultBusyLease = 2 * time.Second
	// DefaultBusyWindow: see DispatcherConfig.BusyWindow.
	DefaultBusyWindow = 4 * time.Millisecond
	// DefaultStatementTimeout: see DispatcherConfig.StatementTimeout. The
	// largest claim statements measured, of about 7,400 messages, took
	// about 400 ms on a 2-core VM (docs/benchmarks-history.md); a pass
	// asks for at most 10,000 (a consumer's largest in-flight limit). The
	// control loop's statements read at most a row per consumer. A reclaim
	// pass reads the leases older than the shortest visibility timeout,
	// about 0.3 s for 100,000 on a 2-core VM (BENCHMARKS.md), and gets
	// twice the time after a pass that ran out of it.
	DefaultStatementTimeout = 10 * time.Second
)

// DispatcherConfig configures a Dispatcher. Zero fields take defaults.
type DispatcherConfig struct {
	// Resolver picks the Handler for each consumer. Required.
	Resolver Resolver
	// Logger receives the dispatcher's log lines, with the fields
	// app_id, queue, message_id and attempt where they apply. The zero
	// Logger discards them all, errors included: set one.
	Logger zerolog.Logger
	// Observer, if set, is told about deliveries, for metrics. A nil
	// pointer is refused: its methods would run on the dispatcher's
	// goroutines, where a panic ends the process.
	Observer Observer
	// PollInterval: see DefaultPollInterval. At least 100ms: each poll
	// is a statement, however idle the dispatcher. There is no upper
	// limit, but a longer one is slower to catch a lost notification
	// and a listener that hears nothing (the poll carries its heartbeat).
	PollInterval time.Duration
	// ReconnectDelay is the listener's pause between reconnects (2s, at
	// least 50ms).
	ReconnectDelay time.Duration
	// HeartbeatTimeout bounds how long a heartbeat may take to reach the
	// listener, counted from the commit of the statement that sent it,
	// before the listener is reconnected (5s, at least 100ms). The
	// fallback poll sends one, and so does the scan after a connect or a
	// new consumer, until one has been heard or two have been missed.
	HeartbeatTimeout time.Duration
	// ShutdownGrace: see DefaultShutdownGrace; at most 12h, the longest
	// visibility timeout. A stop takes at most
	// max(ShutdownGrace, min(StatementTimeout, 5s)) + StopBudget, 15s
	// with the defaults, unless a handler ignores its context's end
	// (Dispatcher.Run says how).
	ShutdownGrace time.Duration
	// DefaultVisibilityTimeout applies to leases on queues that have no
	// consumer (30s); whole seconds, 1s to 12h, as a consumer's.
	DefaultVisibilityTimeout time.Duration
	// BusyLease is the lease of a busy mark (2s): while the dispatcher
	// finds a queue busy (see BusyWindow), producers of that queue skip
	// their notification and its commit lock (docs/busy-marks.md). The
	// mark producers see is an advisory lock on a connection of the
	// dispatcher's own; it ends with the dispatcher, or, if the dispatcher
	// hangs, after BusyLease of silence (idle_session_timeout). Other
	// dispatchers look again every BusyLease while a mark lasts. 10ms to
	// 1h, and at least four times BusyWindow.
	BusyLease time.Duration
	// BusyWindow (4ms) decides when a queue counts as busy: when a claim
	// pass fills the consumer's free slots, or when it finds messages
	// less than BusyWindow after the previous pass that found some (a
	// steady stream). A busy queue is marked, and the dispatcher polls it
	// every BusyWindow/4 instead of waiting for notifications, until it
	// has found nothing for a whole BusyWindow. Messages further apart
	// than BusyWindow (an idle queue) are announced one by one, with no
	// polling. Longer windows mark more often at lower rates, and poll
	// more slowly.
	BusyWindow time.Duration
	// DisableBusyMarks keeps this dispatcher from marking any queue busy,
	// so that its producers notify every message, for comparison; there
	// is no other reason to set it. It still watches the marks of other
	// dispatchers on the database that do not set it, whose producers
	// stay silent while they last.
	DisableBusyMarks bool
	// LeaseAtInsert lets producers lease new messages to this dispatcher
	// in their own transaction (docs/lease-at-insert.md): a queue that has
	// gone idle leaves an offer, the next producer's trigger leases its
	// message under the offer's token and sends the message, payload
	// included, on a channel whose name only this dispatcher and the
	// bellhop_offers table know, and the handler starts without a claim
	// round trip. Producers of idle queues then pay for the lease's write.
	// A lease whose notification is lost is found by its token on the next
	// reconnect or poll, or comes back after its visibility timeout.
	LeaseAtInsert bool
	// StatementTimeout (10s, at least 100ms) bounds each claim pass, the
	// statements a lane runs around its passes (its queue's busy key and mark,
	// its offers for leasing at INSERT), each reclaim pass (of at most
	// reclaim.DefaultBatch leases of each kind), and each step of the
	// dispatcher's control loop: a fallback poll (with the lease lookups it
	// leads to), a consumer reload, the scan for work after the listener
	// reconnects, the once-a-second update of the consumers' last_fired_at. A
	// statement that has not answered by then, stuck behind a lock or on a
	// connection to a server that no longer answers, is cancelled (pgx closes
	// its connection and sends the server a cancel request) and handled as any
	// failure of it is: a claim is tried again after a pause, a poll at the
	// next poll (a poll that got no answer also drops the pool's
	// connections and reconnects the listener: a dead path hangs the
	// listener too; a scan that got none only forgets its heartbeat), a
	// reload or a reclaim pass backing off; a failed scan wakes
	// every queue; a failed busy key statement drops the lock connection, so
	// that producers notify again; an offer not made is made again
	// (docs/guarantees.md). Without it, two stuck claim passes would hold
	// every queue of the dispatcher, since it has at most two out at once (see
	// claim.Combiner), one stuck lane statement would stop its lane, one stuck
	// reclaim pass would leave crashed consumers' messages leased, and one
	// stuck poll would stop the polls, and with them the listener's heartbeat
	// and the reclaimer's news of other dispatchers' leases, until the kernel
	// gave up on the connection (about 15 minutes for one whose server
	// vanished). Not bounded by it: outcome writes, which have their own
	// (10s a try, retried until their leases end while no connection can
	// be made but for a refusal for good, 5 tries otherwise:
	// claim.Completer); lease renewals (Message.ExtendLease), which run on
	// the context the handler passes, whose own context ends with the
	// lease; the lock connection's keep-alives, bounded
	// by BusyLease; the tidying up after a consumer is removed, bounded by 5s;
	// and the start-up, which Run's context bounds.
	StatementTimeout time.Duration
}

// newPool is pgxpool.NewWithConfig, with its panic for a config that
// pgxpool.ParseConfig did not make (which NewDispatcher cannot tell)
// returned as an error.
func newPool(cfg *pgxpool.Config) (p *pgxpool.Pool, err error) {
	defer func() {
		if r := recover(); r != nil {
			p, err = nil, fmt.Errorf("%v (make the pool config with pgxpool.ParseConfig): %w", r, ErrInvalidOptions)
		}
	}()
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// checkSigns refuses negative durations, which would otherwise be taken
// for "the default" or for an hour-long mistake.
func (c *DispatcherConfig) checkSigns() error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{
		{"PollInterval", c.PollInterval}, {"ReconnectDelay", c.ReconnectDelay},
		{"HeartbeatTimeout", c.HeartbeatTimeout}, {"ShutdownGrace", c.ShutdownGrace},
		{"DefaultVisibilityTimeout", c.DefaultVisibilityTimeout},
		{"BusyLease", c.BusyLease}, {"BusyWindow", c.BusyWindow},
		{"StatementTimeout", c.StatementTimeout},
	} {
		if f.d < 0 {
			return fmt.Errorf("bellhop: DispatcherConfig.%s (%s) must not be negative (0 takes the default): %w", f.name, f.d, ErrInvalidOptions)
		}
	}
	return nil
}

// Outcome is what became of a delivery.
type Outcome string

// Outcomes reported to an Observer. The first four were written; the
// last two are deliveries whose outcome could not be, so that every
// delivery is counted.
const (
	Acked        Outcome = "acked"
	Nacked       Outcome = "nacked"
	DeadLettered Outcome = "dead_lettered"
	Released     Outcome = "released"
	// LeaseLost: the lease was gone before the outcome was written (it
	// ran out and the message was reclaimed, or delivered again), so the
	// outcome changed nothing; or a retried write found it gone, and then
	// the first try may have recorded it. Either way the message may be
	// delivered again, except an invoke delivery that RemoveConsumer
	// deleted with its consumer, which also ends as LeaseLost: nothing
	// delivers it again. The outcome does not tell which.
	LeaseLost Outcome = "lease_lost"
	// WriteFailed: every try to write the outcome failed: the database
	// was away until the lease ended (claim.Completer retries until then),
	// a stop's StopBudget ran out, or each of a few tries failed with an
	// error that no outage explains, no answer in time from a server it
	// was connected to included (a slow server, a row lock). The message is
	// delivered again after its lease, unless a try recorded it before its
	// answer was lost.
	WriteFailed Outcome = "write_failed"
)

// Observer receives dispatcher events. Methods are called from many
// goroutines, the dispatcher's own, and must not block or panic: a panic
// there is not recovered, and ends the process.
type Observer interface {
	// Delivered is called as a handler starts on m.
	Delivered(m *Message)
	// Settled is called once for every delivery, when its outcome has been
	// written (Acked, Nacked, DeadLettered, Released) or could not be
	// (LeaseLost, WriteFailed); handled is how long the handler ran.
	Settled(m *Message, o Outcome, handled time.Duration)
	// Polled is called after every fallback poll that could read the
	// database (a failed one is logged and retried) with the number of idle
	// queues it found holding work ready for a second or more (missed
	// notifications, or a retry whose due time only a dispatcher that died
	// or could not wake the others knew; work that came due just now is
	// woken but not counted, since a timer may be taking it at that
	// moment).
	Polled(missed int)
	// Reclaimed is called after a reclaim pass that changed something.
	Reclaimed(released, deadLettered int64)
	// Finished is called when a delivery no longer occupies a slot: its
	// handler returned and its outcome was queued for writing.
	Finished(m *Message)
}

// FailureObserver is an Observer that is also told when one of the
// dispatcher's own statements fails, so that a dispatcher that cannot
// claim (its role lost a grant, say) shows in metrics and not only in its
// logs: failed claims are logged at most once every 10 s, and /readyz
// still passes, since the database answers. When DispatcherConfig.Observer
// implements it, Failed is called, as Observer's methods are, for every
// failure, logged or not, except those the stop causes.
type FailureObserver interface {
	Observer
	// Failed is called after a statement of kind op failed. The
	// dispatcher tries it again: a claim, a reclaim pass or a reload
	// backing off, a poll at the next, an offer when its lane is next
	// idle.
	Failed(op Operation)
}

// Operation names a kind of statement the dispatcher runs on its own, for
// FailureObserver.
type Operation string

// Operations reported to a FailureObserver.
const (
	// OpClaim: a lane's claim, or its check of the busy lock before it
	// goes idle.
	OpClaim Operation = "claim"
	// OpPoll: the fallback poll, or the scan for work after the listener
	// (re)connects.
	OpPoll Operation = "poll"
	// OpReclaim: a pass of the reclaim of expired leases.
	OpReclaim Operation = "reclaim"
	// OpReload: a reload of the consumers.
	OpReload Operation = "reload"
	// OpOffer: with LeaseAtInsert, an offer of a queue's next message to
	// this dispatcher (its INSERT into bellhop_offers). The queue is then
	// claimed after notifications as without LeaseAtInsert, and offered
	// again when its lane is next idle.
	OpOffer Operation = "offer"
)

// failed tells the Observer, if it is a FailureObserver, that a statement
// of kind op failed.
func (d *Dispatcher) failed(op Operation) {
	if fo, ok := d.cfg.Observer.(FailureObserver); ok {
		fo.Failed(op)
	}
}

// Dispatcher delivers messages to handlers. Create it with NewDispatcher
// and start it with Run. A Dispatcher made otherwise (its zero value, say)
// does not run: Run returns an error wrapping ErrInvalidOptions, Ready
// reports it, and ListenerStats and LeaseStats return zeros.
type Dispatcher struct {
	ran atomic.Bool // Run was called
	// outcomeBatch is the Completer's largest batch, a quarter of its
	// queue (0: 500); tests make it small.
	outcomeBatch int
	ended        atomic.Bool // Run's context has ended, or Run has returned
	// startErr is why Run could not start, for Ready.
	startErr atomic.Pointer[error]
	// pool is db once Run has made it, for Ready, which may run
	// concurrently with Run's start.
	pool atomic.Pointer[pgxpool.Pool]
	// ping is Ready's database check, shared by its concurrent callers and
	// reused for a second after it succeeds: /readyz answers anyone who
	// reaches its port, and each check holds one of the pool's
	// connections, which the lanes' claims need.
	ping    *probe.Probe
	cfg     DispatcherConfig
	poolCfg *pgxpool.Config
	// simpleProtocol: some connection of the pool is in pgx's simple
	// protocol mode, in which a leasing dispatcher hides arguments
	// (offers.go, hidden).
	simpleProtocol atomic.Bool
	// running: Run has started (its consumers loaded); Ready waits for it.
	running  atomic.Bool
	db       *pgxpool.Pool
	log      zerolog.Logger
	listener *notify.Listener
	// stale is when the pool's idle connections last came under
	// suspicion (markStale), as time since created (monotonic, unlike a
	// wall-clock time), for the pool's ShouldPing; 0 until then.
	created time.Time
	stale   atomic.Int64
	reclaim *reclaim.Reclaimer
	// marks holds the busy keys producers test; nil with DisableBusyMarks.
	marks    *busylock.Holder
	complete *claim.Completer
	claims   *claim.Combiner

	reload chan bool // true: also wake the lanes that may have missed notifications

	mu      sync.RWMutex
	lanes   map[uuid.UUID]*consumerLanes // by consumer id
	byQueue map[queueKey]*lane
	// tidying holds the queue lanes stopped while the dispatcher runs
	// until they have given up their busy mark and offers: a new lane of
	// the same queue shares both keys, and waits (lane.after).
	tidying map[queueKey]*lane
	// panicked holds, by consumer id, the Resolver's panic logged
	// (resolve): logged again only when it changes, not on every reload;
	// forgotten once the consumer resolves, or is gone. Only
	// loadConsumers touches it, on one goroutine at a time, and resolve
	// runs outside mu.
	panicked map[uuid.UUID]string
	// holding keeps, by consumer id, the lanes of a consumer that a
	// reload stopped serving (the Resolver returned nil, or panicked)
	// while deliveries of theirs still hold slots: should a later reload
	// serve the consumer again, its new lanes count those slots against
	// MaxInFlight, as a moved consumer's do, and the slots freed wake
	// them (lane.heir). An entry is forgotten once its slots are all free
	// (Dispatcher.slotsDrained), or when its consumer is served again.
	holding map[uuid.UUID]*consumerLanes
	// handing holds the queues and invoke outboxes to hand over to every
	// dispatcher (handOverLater), for handLoop, which runs while
	// handRunning is set and handers counts; owed holds those for the
	// stop's hand-over (handOver) once the stop has begun. Keyed by
	// handTarget.
	handing     map[claim.Target]bool
	handRunning bool
	owed        map[claim.Target]bool
	handers     sync.WaitGroup

	// handlers is the parent context of every handler's context; it is
	// cancelled when a stop's grace period runs out.
	handlers context.Context
	inFlight sync.WaitGroup
	lanesRun sync.WaitGroup // lane goroutines
	stopped  bool           // under mu: no lanes may start
	stopping chan struct{}  // closed with stopped set

	lastFired   map[uuid.UUID]bool
	lastFiredMu sync.Mutex

	// claimFailLog bounds the lanes' "claim failed" lines: when the
	// database is away, every lane with work fails.
	claimFailLog *logthrottle.Throttle
	// offerFailLog bounds the lanes' "could not make an offer" lines at
	// warn; the rest go to debug.
	offerFailLog *logthrottle.Throttle

	// owner names this dispatcher's busy marks and offers.
	owner uuid.UUID
	// leaseChannel receives leases made at INSERT (offers.go); empty
	// unless LeaseAtInsert.
	leaseChannel string
	offers       offerBook
}

type queueKey struct {
	app   uuid.UUID
	queue string
}

type consumerLanes struct {
	queue, invoke *lane
	cancel        context.CancelFunc // the lanes' context
}

// stop stops both lanes; no lane goroutine of theirs starts afterwards
// except, with tidy, one that gives up the queue's busy mark and offers.
// Both learn tidy before their shared context is cancelled: a goroutine
// of the invoke lane that saw the queue lane's cancel first exited
// untidied, and, running still set, its stop started none, so a retry
// time only its timer knew was never handed over.
func (cl *consumerLanes) stop(tidy bool) {
	cl.queue.setTidy(tidy)
	cl.invoke.setTidy(tidy)
	cl.queue.stop(cl.cancel, tidy)
	cl.invoke.stop(cl.cancel, tidy)
}

// defaultConnectTimeout bounds each connection attempt of a dispatcher
// whose pool config sets no connect timeout.
const defaultConnectTimeout = 10 * time.Second

// NewDispatcher returns a Dispatcher with its own pool, made from poolCfg,
// which must come from pgxpool.ParseConfig, and connections outside the
// pool, one for LISTEN and, unless DisableBusyMarks, one for the busy
// locks, made from its ConnConfig as the pool makes its own: poolCfg's
// BeforeConnect and AfterConnect run for them too; BeforeConnect finds
// their application_name set, to bellhop-listener or bellhop-busy-locks
// (the pool's connections get bellhop-dispatcher unless poolCfg names one);
// AfterConnect runs on the listener's before it sets up its session; the
// pool's BeforeClose runs for the pool's connections only. Its connections
// get a connect timeout of 10s unless poolCfg's ConnConfig sets a positive
// one (connect_timeout in the connection string; 0, libpq's "wait
// forever", is no bound to pgx, and gets 10s too). Zero fields of cfg take their defaults; a
// negative duration, or one out of its range, is an error that matches
// ErrInvalidOptions. Run makes the
// pool, opens the connections and closes them when it returns, so a
// Dispatcher that never runs holds nothing; a Dispatcher runs once, and a
// second Run returns an error. The pool's
// sessions run with synchronous_commit off: claims, acks and nacks that a
// server crash loses only cause a redelivery, which at-least-once
// delivery allows, and they no longer wait for a WAL flush. Producers'
// inserts, on their own connections, keep the server's setting. The pool's
// ShouldPing is replaced, and its BeforeClose wrapped (a caller's still
// runs): see the comments where they are set.
func NewDispatcher(poolCfg *pgxpool.Config, cfg DispatcherConfig) (*Dispatcher, error) {
	if isNil(cfg.Resolver) {
		// A typed nil, such as a (*Mux)(nil), would panic on every
		// consumer, and no queue would be served.
		got := ""
		if cfg.Resolver != nil {
			got = fmt.Sprintf(" (got %T(nil))", cfg.Resolver)
		}
		return nil, fmt.Errorf("bellhop: DispatcherConfig.Resolver is required%s: %w", got, ErrInvalidOptions)
	}
	if o := reflect.ValueOf(cfg.Observer); o.Kind() == reflect.Pointer && o.IsNil() {
		// Called on the lanes' goroutines, a nil pointer's method would
		// crash the process at the first delivery.
		return nil, fmt.Errorf("bellhop: DispatcherConfig.Observer is a %T(nil); leave it unset instead: %w", cfg.Observer, ErrInvalidOptions)
	}
	if poolCfg == nil || poolCfg.ConnConfig == nil {
		return nil, fmt.Errorf("bellhop: a pool config is required (make it with pgxpool.ParseConfig): %w", ErrInvalidOptions)
	}
	if err := cfg.checkSigns(); err != nil {
		return nil, err
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.ShutdownGrace == 0 {
		cfg.ShutdownGrace = DefaultShutdownGrace
	}
	if cfg.DefaultVisibilityTimeout == 0 {
		cfg.DefaultVisibilityTimeout = DefaultVisibilityTimeout
	}
	windowDefault := ""
	if cfg.BusyLease == 0 {
		cfg.BusyLease = DefaultBusyLease
	}
	if cfg.BusyWindow == 0 {
		cfg.BusyWindow, windowDefault = DefaultBusyWindow, ", the default"
	}
	if cfg.StatementTimeout == 0 {
		cfg.StatementTimeout = DefaultStatementTimeout
	}
	// Past the longest lease, no handler is left to wait for; far past
	// it, the stop's bound (ShutdownGrace + StopBudget) overflowed, and
	// the stop gave up on every outcome at once.
	if cfg.ShutdownGrace > validate.MaxVisibility {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.ShutdownGrace (%s) must be at most %s, the longest visibility timeout: %w",
			cfg.ShutdownGrace, validate.MaxVisibility, ErrInvalidOptions)
	}
	if cfg.StatementTimeout < 100*time.Millisecond {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.StatementTimeout (%s) must be at least 100ms: %w", cfg.StatementTimeout, ErrInvalidOptions)
	}
	if cfg.PollInterval < 100*time.Millisecond {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.PollInterval (%s) must be at least 100ms: %w", cfg.PollInterval, ErrInvalidOptions)
	}
	// Below these, the listener would reconnect in a tight loop: on every
	// heartbeat, or as fast as the server refuses it.
	if cfg.ReconnectDelay != 0 && cfg.ReconnectDelay < 50*time.Millisecond {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.ReconnectDelay (%s) must be at least 50ms: %w", cfg.ReconnectDelay, ErrInvalidOptions)
	}
	if cfg.HeartbeatTimeout != 0 && cfg.HeartbeatTimeout < 100*time.Millisecond {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.HeartbeatTimeout (%s) must be at least 100ms: %w", cfg.HeartbeatTimeout, ErrInvalidOptions)
	}
	// Both go to the database in whole units: a visibility timeout in
	// seconds, as a consumer's, within a consumer's range (an int4 there);
	// the busy mark's idle_session_timeout in milliseconds, where 0 turns
	// the timeout off (a hung dispatcher's mark would last) and over
	// about 24 days is refused.
	if vt := cfg.DefaultVisibilityTimeout; vt < time.Second || vt > validate.MaxVisibility || vt%time.Second != 0 {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.DefaultVisibilityTimeout (%s) must be a whole number of seconds, 1s to %s: %w",
			vt, validate.MaxVisibility, ErrInvalidOptions)
	}
	if cfg.BusyLease < 10*time.Millisecond || cfg.BusyLease > time.Hour {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.BusyLease (%s) must be 10ms to 1h: %w", cfg.BusyLease, ErrInvalidOptions)
	}
	if cfg.BusyWindow > cfg.BusyLease/4 {
		return nil, fmt.Errorf("bellhop: DispatcherConfig.BusyWindow (%s%s) must be at most a quarter of BusyLease (%s): %w",
			cfg.BusyWindow, windowDefault, cfg.BusyLease, ErrInvalidOptions)
	}
	pc := poolCfg.Copy()
	// A server that accepts connections and never answers (a wedged
	// proxy, a path a failover left dead) held each connection attempt
	// without a connect_timeout until the kernel gave up, minutes later:
	// the reclaim and the claims waited on it after the server was back
	// (the lifecycle review saw deliveries resume 30 s after recovery).
	// bellhop's commands default to the same bound.
	if pc.ConnConfig.ConnectTimeout <= 0 {
		pc.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	params := pc.ConnConfig.RuntimeParams
	if params == nil {
		params = map[string]string{}
		pc.ConnConfig.RuntimeParams = params
	}
	// Every statement on this pool is a claim, an outcome, a reclaim, a
	// busy mark or a poll. Without a WAL flush per commit they cost a
	// fraction of the time. A server crash may lose the last few hundred
	// milliseconds of them: a lost ack, nack or dead-letter leaves the
	// message claimed until its lease expires and it is delivered again
	// (or, if that was its last attempt, dead-lettered by the reclaim,
	// without the handler's error); a lost release loses its attempt's
	// refund; a lost reclaim is redone; a lost claim makes the message claimable
	// again while its handler may still run (docs/guarantees.md). All of
	// that is within at-least-once delivery. Lease renewals are the
	// exception, and commit durably (sql/extend.sql says why). Producers' inserts run on
	// their own connections with the server's setting, so a committed
	// message is never lost.
	params["synchronous_commit"] = "off"
	// Claims, settles and the reclaim lock rows and then act on what they
	// read; a database whose default is REPEATABLE READ or SERIALIZABLE
	// would fail them with serialization errors, or let them act on a
	// snapshot taken before the lock.
	params["default_transaction_isolation"] = "read committed"
	if params["application_name"] == "" {
		params["application_name"] = "bellhop-dispatcher"
	}
	d := &Dispatcher{
		cfg:          cfg,
		poolCfg:      pc,
		log:          cfg.Logger,
		reload:       make(chan bool, 1),
		lanes:        map[uuid.UUID]*consumerLanes{},
		byQueue:      map[queueKey]*lane{},
		tidying:      map[queueKey]*lane{},
		panicked:     map[uuid.UUID]string{},
		holding:      map[uuid.UUID]*consumerLanes{},
		handing:      map[claim.Target]bool{},
		owed:         map[claim.Target]bool{},
		stopping:     make(chan struct{}),
		lastFired:    map[uuid.UUID]bool{},
		owner:        uuid.New(),
		claimFailLog: logthrottle.New(1, 10*time.Second),
		offerFailLog: logthrottle.New(1, time.Minute),
		offers:       offerBook{byToken: map[uuid.UUID]*offer{}},
		created:      time.Now(),
	}
	d.ping = probe.New(func(ctx context.Context) error {
		// Once more on a connection lost under the ping: the pool's
		// sessions can end while the listener's stays (idle_session_timeout
		// shorter than the probe's period), and the pool pings the next
		// one first (markStale). Answered as is, /readyz said 503 for a
		// database that was there.
		db := d.pool.Load()
		err := db.Ping(ctx)
		if d.lostConn(err) {
			if again := db.Ping(ctx); again != nil {
				return fmt.Errorf("%w (and before it, on a lost connection: %v)", again, err)
			}
			return nil
		}
		return err
	},
		cfg.StatementTimeout, time.Second)
	// pgxpool pings a connection idle for over a second before handing it
	// out; that is one more round trip in front of the first claim after
	// a quiet spell, exactly where latency matters. A failed statement is
	// retried anyway, so ping only connections idle for a minute, or idle
	// since the pool's connections came under suspicion (markStale): the
	// listener reconnected, as after a restart or a failover, which ends
	// the pool's sessions too; or a pool connection was found closed, as
	// when the server ends the pool's sessions and not the listener's
	// (pg_terminate_backend, idle_session_timeout). Unpinged, each dead
	// one failed a statement in turn, backing off between tries: the
	// catch-up that follows a reconnect came 10 to 25 s late, and a
	// message committed after the pool's sessions ended waited seconds.
	// A connection string's default_query_exec_mode is in pc; a
	// BeforeConnect hook may set one per connection, which only the
	// connection made knows.
	d.simpleProtocol.Store(pc.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol)
	afterConnect := pc.AfterConnect
	pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if c.Config().DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol {
			d.simpleProtocol.Store(true)
		}
		if afterConnect != nil {
			return afterConnect(ctx, c)
		}
		return nil
	}
	pc.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
		stale := time.Duration(d.stale.Load())
		return p.IdleDuration > time.Minute || stale > 0 && p.IdleDuration > time.Since(d.created)-stale
	}
	beforeClose := pc.BeforeClose
	pc.BeforeClose = func(c *pgx.Conn) {
		// Closed before the pool closes it: a statement found it broken
		// or ended by the server, whichever of the pool's statements it
		// was (a claim, an ack, a reclaim pass). Connections the pool
		// drops itself (lifetime, idle time, Reset) are still open here.
		if c.IsClosed() {
			d.markStale()
		}
		if beforeClose != nil {
			beforeClose(c)
		}
	}
	// The connections made outside the pool (the listener's, the busy
	// locks') run the pool's connect hooks too, as the pool's own do: a
	// BeforeConnect that sets the password (rotated credentials, a cloud
	// IAM token) left them unable to connect, and the dispatcher deaf,
	// on the fallback poll alone and never Ready.
	beforeConnect := pc.BeforeConnect
	var onConnect func(context.Context, *pgx.Conn) error
	if cfg.LeaseAtInsert {
		d.leaseChannel = newLeaseChannel()
		onConnect = d.holdLeaseKey
	}
	if !cfg.DisableBusyMarks {
		lockCfg := pc.ConnConfig.Copy()
		d.marks = busylock.New(func(ctx context.Context) (*pgx.Conn, error) {
			cc := lockCfg.Copy()
			cc.RuntimeParams["application_name"] = "bellhop-busy-locks"
			if beforeConnect != nil {
				if err := beforeConnect(ctx, cc); err != nil {
					return nil, fmt.Errorf("BeforeConnect: %w", err)
				}
			}
			c, err := pgx.ConnectConfig(ctx, cc)
			if err == nil && afterConnect != nil {
				if err = afterConnect(ctx, c); err != nil {
					_ = c.Close(ctx)
					return nil, fmt.Errorf("AfterConnect: %w", err)
				}
			}
			return c, err
		}, d.owner, cfg.BusyLease, d.log)
	}
	d.listener = notify.New(notify.Config{
		ConnConfig:       pc.ConnConfig,
		BeforeConnect:    beforeConnect,
		AfterConnect:     afterConnect,
		Handler:          (*routes)(d),
		Logger:           d.log,
		ReconnectDelay:   cfg.ReconnectDelay,
		HeartbeatTimeout: cfg.HeartbeatTimeout,
		LeaseChannel:     d.leaseChannel,
		OnLease:          d.onLease,
		OnConnect:        onConnect,
	})
	return d, nil
}

// Run delivers until ctx is cancelled, then stops cleanly: it claims no
// more, lets in-flight handlers finish for up to ShutdownGrace, cancels
// the rest and releases their messages with their attempts refunded,
// writes every outcome and returns. A released message is claimable at
// once, unless its handler's error wraps ErrAbandoned: then at the end of
// its lease. A handler that ignores its context's end keeps Run waiting
// for it to return: its message's outcome is written then (an error it
// returns, Permanent ones included, counts as the cancellation's, and
// releases the message, attempt refunded), and the token fences it if its lease has run out meanwhile.
// The grace counts from ctx's end.
//
// How long the stop takes: while the handlers have their grace, a claim
// pass already sent gets up to min(StatementTimeout, claim.StopWait (5s))
// to answer, and what it claimed is released; a pass cut off then, its
// answer lost, may have committed, and leaves what it claimed leased
// until the visibility timeout, an attempt spent (a message on its last
// attempt is dead-lettered by the reclaim). Once the last handler has
// returned, the stop's writes (outcomes, offers, the hand-over to the
// other dispatchers, busy marks, last_fired_at) share StopBudget (5s),
// cut short to end at the stop's bound below:
// once it runs out, as against a server that stopped answering, the
// write under way is cancelled and the rest are skipped, each of their
// effects expiring by itself (see StopBudget); nothing is lost, an
// outcome not written only lets its message be delivered again after its
// lease. So Run returns at most max(ShutdownGrace,
// min(StatementTimeout, 5s)) + StopBudget after ctx ends (15s with the
// defaults), or, if a handler that ignores its context returns later,
// once it has; at that bound, the outcomes not yet written are given
// up on, those such a handler returns later too, however many wait while
// the database is away, and the stop's other writes are skipped. Once Run has returned, the pool's connections to
// a server that stopped answering may take pgx up to 15s more to close,
// in the background. Nothing is logged after Run returns:
// when the grace runs out, Run waits for its warning to reach the
// Logger, so a Logger that blocks delays Run too. It returns an error only
// if it cannot start: among those, a database without Bellhop's schema
// (migrations.ErrNoSchema) or with an older one than this code's
// (migrations.ErrSchemaBehind); a newer one is fine.
func (d *Dispatcher) Run(ctx context.Context) (err error) {
	if d.listener == nil {
		// Not made by NewDispatcher: no pool config, listener or maps.
		// Without this, pgxpool panicked on the nil config.
		err := fmt.Errorf("bellhop: Dispatcher.Run: the Dispatcher was not made by NewDispatcher: %w", ErrInvalidOptions)
		d.startErr.Store(&err)
		return err
	}
	if !d.ran.CompareAndSwap(false, true) {
		return errors.New("bellhop: Dispatcher.Run called more than once (a Dispatcher runs once; make a new one)")
	}
	defer func() {
		if err != nil {
			d.startErr.Store(&err)
		}
		d.ended.Store(true)
	}()
	// The pool is made here, not in NewDispatcher: pgxpool starts a
	// goroutine at once (and connections, with pool_min_conns), which a
	// Dispatcher that never runs could not release.
	db, err := newPool(d.poolCfg)
	if err != nil {
		return fmt.Errorf("dispatcher: pool: %w", err)
	}
	d.db = db
	d.reclaim = reclaim.New(db, d.log, reclaim.Options{
		DefaultVT: d.cfg.DefaultVisibilityTimeout, Timeout: d.cfg.StatementTimeout,
		OnPass: func(r reclaim.Result) {
			if d.cfg.Observer != nil {
				d.cfg.Observer.Reclaimed(r.Released, r.DeadLettered)
			}
		},
		OnError: func(error) { d.failed(OpReclaim) },
	})
	d.pool.Store(db)
	var stopBy time.Time // the end of a stop's budget, once it began
	defer func() { d.closePool(stopBy) }()
	// The listener connects once the pool's first connection is made,
	// beside the schema check and the consumer load: its connect and
	// LISTEN were the longest step between Run and the first claim. Until
	// the lanes exist, what it hears finds none; its connect asks for the
	// reload and wake scan that the control loop makes once it runs, as
	// after any reconnect. If Run cannot start, the listener is stopped
	// before Run returns; its "listening" line may have come before Run's
	// error. Started with the pool's connection instead, it also said it
	// was retrying when the server was unreachable and Run was about to
	// fail, for no measurable gain (BENCHMARKS.md, "Start-up").
	var bg sync.WaitGroup
	lctx, stopListener := context.WithCancel(ctx)
	defer stopListener()
	started := false
	defer func() {
		if !started {
			stopListener()
			bg.Wait()
		}
	}()
	if err := d.db.Ping(ctx); err != nil {
		return fmt.Errorf("dispatcher: connect: %w", err)
	}
	bg.Go(func() { _ = d.listener.Run(lctx) })
	// A schema older than this code lacks functions and tables that some
	// statements need (the reclaimer's, say): those would fail on every
	// try while the rest seemed to work.
	if err := migrations.Check(ctx, d.db); err != nil {
		return fmt.Errorf("dispatcher: %w", err)
	}
	// One writer: outcomes that arrive while a write is in flight go in
	// the next one. A second writer took them at once instead, in twice
	// the statements (9,688 against 6,156 for a 20,000-message burn-down
	// at in-flight 10), and the burn-down was slower for it.
	d.complete = claim.NewCompleter(d.db, d.log, 1, cmp.Or(d.outcomeBatch, 500))
	// Two claim passes in flight at once, and the lanes' passes that come
	// while both are out go together in the next (claim.Combiner). One
	// alone would make a lane's pass wait behind another lane's even when
	// few queues are busy; more would rarely combine, since a pass takes
	// well under a millisecond when the server is not loaded.
	d.claims = claim.NewCombiner(d.db, 2, d.cfg.StatementTimeout)
	var handlersCancel context.CancelFunc
	d.handlers, handlersCancel = context.WithCancel(context.WithoutCancel(ctx))
	defer handlersCancel()
	if _, err := d.loadConsumers(ctx); err != nil {
		d.complete.Close()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
			return fmt.Errorf("dispatcher: the database has no Bellhop schema (run the migrations first): %w", err)
		}
		return fmt.Errorf("dispatcher: %w", err)
	}

	started = true
	d.running.Store(true)
	bg.Go(func() { d.reclaim.Run(ctx) })
	if d.marks != nil {
		bg.Go(func() { d.marks.Run(ctx) })
	}
	// One pass at start-up returns leases that expired while no dispatcher
	// ran (a crash and restart) and learns when the live ones expire. It
	// runs once the control loop's first scan for work has (control), or
	// startupReclaimWait after now if that scan is late: made at once, it
	// held the pool's one connection for 40 - 50 ms while the reload and
	// scan after the listener's connect opened another, and the first
	// delivery came that much later.
	d.reclaim.Observe(time.Now().Add(startupReclaimWait))
	bg.Go(func() { d.control(ctx) })
	bg.Go(func() { d.touchLoop(ctx) })
	d.log.Info().Stringer("poll_interval", d.cfg.PollInterval).Msg("dispatcher started")

	<-ctx.Done()
	d.ended.Store(true)
	// The grace counts from the stop, not from the end of the waits below
	// (a claim in flight, offers locked by producers), which could add
	// seconds to it: a supervisor's own stop timeout is set from it.
	graceEnd := time.Now().Add(d.cfg.ShutdownGrace)
	// The stop's bound holds however many outcomes wait: while the
	// database is away, the Completer retries a batch until its leases
	// end, and handlers whose outcomes queue behind it block in Submit,
	// which inFlight.Wait below waits for, before stopWrites' budget
	// starts. At the bound, every write still wanted is given up on, so
	// that those handlers return, and so is any a handler that ignored
	// its context submits later: its message comes back after its lease.
	boundAt := time.Now().Add(max(d.cfg.ShutdownGrace, min(d.cfg.StatementTimeout, claim.StopWait)) + StopBudget)
	over := time.AfterFunc(time.Until(boundAt), func() {
		d.complete.Abandon(errors.New("the stop's time for its writes ran out (ShutdownGrace, then StopBudget)"))
	})
	defer over.Stop()
	graceOver := make(chan struct{})
	grace := time.AfterFunc(d.cfg.ShutdownGrace, func() {
		defer close(graceOver)
		d.log.Warn().Stringer("grace", d.cfg.ShutdownGrace).
			Msg("shutdown grace over: cancelling any handler still running; its message is released")
		handlersCancel()
	})
	d.log.Info().Msg("dispatcher stopping: no more claims; waiting for in-flight handlers")
	stopped := d.stopLanes()
	if left := min(5*time.Second, time.Until(graceEnd)); d.cfg.LeaseAtInsert && left > 0 {
		// No producer may lease to us while handlers finish: a lease
		// made now waits for the end of the grace to be released. Within
		// the grace: closeOffers withdraws them all again after it.
		wctx, wcancel := timeout.Bound(context.Background(), left)
		d.dropOffers(wctx, nil)
		wcancel()
	}
	d.inFlight.Wait()
	if !grace.Stop() {
		<-graceOver // its line is written before Run goes on, and returns
	}
	// From here StopBudget, ending at boundAt at the latest, bounds the
	// writes, outcomes included. over only bounds the wait for the
	// handlers: left running, it fired a moment
	// before a budget that began as a caught claim pass ended, gave up on
	// the outcomes while the budget had not quite run out, and the stop
	// went on to the hand-over with no time left for it. Had it fired
	// already, the stop's bound has passed: its writes are skipped (they
	// were given a budget of their own, and a hand-over against a server
	// that stopped answering took the stop 5s past its bound).
	spent := !over.Stop()
	stopBy = d.stopWrites(stopped, bg.Wait, spent, boundAt)
	d.log.Info().Msg("dispatcher stopped")
	return nil
}

// stopWrites makes a stop's writes, once its handlers are done, within
// StopBudget for all of them (see StopBudget): the offers' withdrawal
// first, whose releases join the outcomes that the Completer writes
// meanwhile, then the outcomes left, which spare redeliveries; once the
// budget has run out, the rest are skipped.
// The budget is a timeout.Bound, so that the warnings of a write cut off
// by it say so (timeout.Explain). bgDone waits for the background loops,
// whose ctx has ended, before the busy marks and last_fired_at: the touch
// loop's last update, failing, hands its consumers back for the final one.
// spent says that the stop's bound passed while its handlers finished:
// the outcomes were given up then, and every write is skipped. The budget
// ends at boundAt, the stop's bound, if that comes first: handlers that
// returned just before it (blocked in Submit while the database was slow,
// or ignoring their context) would otherwise take the stop up to a whole
// budget past its bound, and past a supervisor's kill. It returns the
// budget's end, which also bounds the wait for the pool to close
// (closePool).
func (d *Dispatcher) stopWrites(stopped []*lane, bgDone func(), spent bool, boundAt time.Time) (by time.Time) {
	budget := min(StopBudget, time.Until(boundAt))
	spent = spent || budget <= 0
	ctx, cancel := timeout.Bound(context.Background(), max(budget, 0))
	defer cancel()
	by, _ = ctx.Deadline()
	if spent {
		var end context.CancelCauseFunc
		ctx, end = context.WithCancelCause(ctx)
		end(errBoundPassed)
		by = time.Now()
	}
	// At the budget's end every outcome still wanted is given up, also a
	// release that closeOffers submits (a lease found by its token): with
	// the Completer's queue full, Submit would block until a batch retried
	// while the database is away gave up, up to a try's 10s or more.
	defer context.AfterFunc(ctx, func() { d.complete.Abandon(context.Cause(ctx)) })()
	d.closeOffers(ctx)
	if n := d.complete.Pending(); n > 0 {
		d.log.Info().Int("outcomes", n).Stringer("stop_budget", StopBudget).
			Msgf("dispatcher stopping: waiting for %d outcome writes", n)
	}
	// Only when outcomes were given up on: Pending, read once Shutdown
	// has returned, is 0 whatever became of them, and a budget spent by
	// closeOffers with no outcome pending loses none.
	if n, err := d.complete.Shutdown(ctx); n > 0 {
		d.log.Warn().Err(err).Int("outcomes_left", n).Stringer("stop_budget", StopBudget).
			Msg("the stop's time for its writes ran out; the outcomes not written let their messages come back after their leases")
	}
	said := false // the skip is logged once, naming every write it skips
	skipped := func(what string) bool {
		if ctx.Err() == nil {
			return false
		}
		if said {
			return true
		}
		said = true
		d.log.Warn().Stringer("stop_budget", StopBudget).Str("skipped", what).
			Msg("the stop's time for its writes ran out: skipping its remaining writes (busy marks expire with their lease, " +
				"the other dispatchers find the retries this one had timed at their fallback poll, last_fired_at misses the last second)")
		return true
	}
	// Cut short as the stop began: what it had not sent is owed now.
	d.handers.Wait()
	if !skipped("hand-over, busy marks, last_fired_at") {
		d.handOver(ctx, stopped)
	}
	bgDone()
	if skipped("busy marks, last_fired_at") {
		return by
	}
	if err := claim.ClearMarks(ctx, d.db, d.owner); err != nil {
		d.log.Warn().Err(timeout.Explain(ctx, err)).Msg("could not clear busy marks; they expire with their lease")
	}
	if skipped("last_fired_at") {
		return by
	}
	// The column is informational: a lock on a consumer's row or a frozen
	// server must not keep Run from returning.
	d.flushLastFired(ctx)
	return by
}

// errBoundPassed ends the writes of a stop whose bound passed while its
// handlers finished (stopWrites).
var errBoundPassed = errors.New("the stop's time ran out before its handlers were done (ShutdownGrace, then StopBudget)")

// closePool closes the pool, waiting for it until by at most (zero: for as
// long as it takes, as after a failed start). pgx drains a connection whose
// statement was cancelled for up to 15s, until the server closes it, and
// the pool's Close waits for that: against a server that no longer answers
// (a stop write cut off by StopBudget), that wait goes on in the background
// once by has passed, so that a stop keeps to its bound, and pgx closes the
// sockets when it gives up. Nothing is logged meanwhile.
func (d *Dispatcher) closePool(by time.Time) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.db.Close()
	}()
	if by.IsZero() {
		<-done
		return
	}
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// Ready reports whether the dispatcher can deliver right now: Run has
// started (its schema checked and consumers loaded) and is not stopping
// (its errors say "dispatcher not running", "dispatcher starting",
// "dispatcher stopped" and, wrapping Run's error, "dispatcher could not
// start"), the database answers, and the listener is
// connected, and not deaf: a listener that has missed two heartbeats and
// heard none, as through PgBouncer's transaction pooling, makes it fail
// with notify.ErrDeaf until one comes back. Concurrent calls share one
// database check, and its answer, success or failure, is reused for a
// second, so that frequent callers cost the database at most one check a
// second, whether it answers or refuses connections (each refused check
// may be a failed login, which the server logs); a recovery shows at most
// a second late. ctx bounds the wait, the check itself is bounded by
// StatementTimeout.
func (d *Dispatcher) Ready(ctx context.Context) error {
	db := d.pool.Load()
	if err := d.startErr.Load(); err != nil {
		return fmt.Errorf("dispatcher could not start: %w", *err)
	}
	switch {
	case d.ended.Load():
		return errors.New("dispatcher stopped: Run's context has ended")
	case db == nil:
		return errors.New("dispatcher not running")
	case !d.running.Load():
		// The listener connects while Run still checks the schema and
		// loads the consumers, either of which may yet fail.
		return errors.New("dispatcher starting")
	case !d.listener.Connected():
		return errors.New("listener not connected")
	}
	if err := d.listener.Deaf(); err != nil {
		return err
	}
	if err := d.ping.Check(ctx); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	return nil
}

// ListenerStats returns the listener's counters, for metrics: zeros for a
// Dispatcher not made by NewDispatcher, which has no listener.
func (d *Dispatcher) ListenerStats() notify.Stats {
	if d.listener == nil {
		return notify.Stats{}
	}
	return d.listener.Stats()
}

// resolve asks the Resolver for c's handler. A handler that is a nil
// pointer or func inside the interface counts as nil, as does a Resolver
// that panics (logged): either would otherwise fail every delivery, and
// dead-letter messages that another dispatcher was meant to serve. The
// panic value is logged as fmt prints it, so that a Consumer in it shows
// no secret (Consumer.String), nor a Message its payload, which JSON
// would show. Every reload resolves
// every consumer: a panic is logged at error once, and again only when
// its value changes or after the consumer resolved. d.mu must be held.
func (d *Dispatcher) resolve(c Consumer) (h Handler) {
	defer func() {
		r := recover()
		if r == nil {
			delete(d.panicked, c.ID)
			return
		}
		h = nil
		text := fmt.Sprint(r)
		level := zerolog.ErrorLevel
		if d.panicked[c.ID] == text {
			level = zerolog.DebugLevel
		}
		d.panicked[c.ID] = text
		d.log.WithLevel(level).Str("app_id", c.AppID.String()).Str("queue", c.Queue).Str("consumer_id", c.ID.String()).Str("panic", text).
			Msg("the Resolver panicked; this dispatcher does not serve the consumer")
	}()
	if h = d.cfg.Resolver.Resolve(c); isNil(h) {
		return nil
	}
	return h
}

// routes receives the listener's events and routes them to lanes without
// blocking.
type routes Dispatcher

func (r *routes) HandleEvent(ev notify.Event) {
	d := (*Dispatcher)(r)
	switch ev.Kind {
	case notify.KindQueue:
		d.mu.RLock()
		l := d.byQueue[queueKey{ev.AppID, ev.Queue}]
		d.mu.RUnlock()
		if l != nil {
			l.poke()
		}
	case notify.KindInvoke:
		d.mu.RLock()
		cl := d.lanes[ev.TriggerID]
		d.mu.RUnlock()
		if cl != nil && cl.invoke != nil {
			cl.invoke.poke()
		}
	case notify.KindBusy:
		if ev.Owner == d.owner {
			return
		}
		d.mu.RLock()
		l := d.byQueue[queueKey{ev.AppID, ev.Queue}]
		d.mu.RUnlock()
		if l != nil {
			l.watchHint.Store(true)
			l.poke()
		}
	case notify.KindConsumers:
		d.requestReload(false)
	}
}

// Connected runs after every (re)connect: whatever was committed while the
// listener was away notified nobody, so reload consumers and wake the
// lanes that have work (wakeAfterConnect).
func (r *routes) Connected() {
	d := (*Dispatcher)(r)
	d.markStale()
	d.requestReload(true)
}

// markStale has the pool ping each connection idle since now before it
// hands it out (ShouldPing): the listener has just (re)connected, or a
// pool connection was found closed, and the pool's idle sessions may have
// ended the same way.
func (d *Dispatcher) markStale() {
	now := int64(max(time.Since(d.created), 1))
	for {
		old := d.stale.Load()
		if old >= now || d.stale.CompareAndSwap(old, now) {
			return
		}
	}
}

// retryWait is how long to wait before trying again a statement that
// failed for the failures-th time in a row: backing off from 0.5 – 1 s
// to at most ceiling, except after a first failure on a connection lost
// under the statement, which is retried at once. The server ended the
// pool's sessions (pg_terminate_backend, idle_session_timeout) or a path
// broke, and the pool, told here rather than when it closes the
// connection a moment later, pings the others before use (markStale).
// Backing off, a lane's messages, or a consumer change, waited for the
// retry even when the database was there all along. Should the retry
// fail too, the backoff follows as for any failure.
func (d *Dispatcher) retryWait(err error, failures int, ceiling time.Duration) time.Duration {
	if d.lostConn(err) && failures == 1 {
		return 0
	}
	return backoff.Delay(failures, time.Second, ceiling)
}

// lostConn reports whether err is a connection lost under its statement
// (connLost), and if so has the pool ping its idle connections before use
// (markStale).
func (d *Dispatcher) lostConn(err error) bool {
	if !connLost(err) {
		return false
	}
	d.markStale()
	return true
}

// connLost reports whether err is a statement's connection lost under
// it: the server ended the session (a FATAL error, as for a terminated
// backend or idle_session_timeout), or the connection broke (refused
// writes, end of file). Not a connection that could not be made, which
// the server being away explains, nor a statement that timed out, which
// a slow server explains as well (pollFailed's case).
func connLost(err error) bool {
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) || pgconn.Timeout(err) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		sev := cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity)
		return sev == "FATAL" || sev == "PANIC"
	}
	if netErr := net.Error(nil); errors.As(err, &netErr) {
		return !netErr.Timeout()
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

func (d *Dispatcher) requestReload(wakeAll bool) {
	for {
		select {
		case d.reload <- wakeAll:
			return
		default:
		}
		// A reload is pending already: upgrade it to waking if needed.
		select {
		case prev := <-d.reload:
			wakeAll = wakeAll || prev
		default:
		}
	}
}

// startupReclaimWait bounds how long the start-up reclaim pass waits for
// the first scan for work (Run).
const startupReclaimWait = time.Second

// control runs consumer reloads and the fallback poll.
func (d *Dispatcher) control(ctx context.Context) {
	poll := time.NewTimer(jitter(d.cfg.PollInterval))
	defer poll.Stop()
	reloadFailures := 0
	scanned := false // the first scan for work has run, and so may the start-up reclaim pass
	// At most one retry is due at a time: a reload asked for meanwhile
	// (a notification, a reconnect) replaces it, so failures never start
	// a second chain of retries.
	var retry <-chan time.Time
	retryWake := false
	for {
		var wakeAll bool
		select {
		case <-ctx.Done():
			return
		case wakeAll = <-d.reload:
		case <-retry:
		case <-poll.C:
			pctx, cancel := d.bound(ctx)
			d.poll(pctx)
			cancel()
			poll.Reset(jitter(d.cfg.PollInterval))
			continue
		}
		wakeAll = wakeAll || retryWake
		retry, retryWake = nil, false
		rctx, cancel := d.bound(ctx)
		added, err := d.loadConsumers(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			reloadFailures++
			d.failed(OpReload)
			wait := d.retryWait(err, reloadFailures, 30*time.Second)
			d.log.Warn().Err(timeout.Explain(rctx, err)).Stringer("retry_in", wait).Msg("reloading consumers failed")
			retry, retryWake = time.After(wait), wakeAll
			continue
		}
		reloadFailures = 0
		if wakeAll || added > 0 {
			// A new consumer's queue may hold messages whose
			// notifications found no lane. One statement finds the
			// lanes with work, rather than a claim for each new one.
			wctx, cancel := d.bound(ctx)
			d.wakeAfterConnect(wctx)
			cancel()
			if !scanned {
				scanned = true
				d.reclaim.Observe(time.Now())
			}
		}
		if wakeAll {
			// Leases made while the listener was away announced
			// themselves to nobody.
			live, unheard := d.offerTokens(time.Now())
			lctx, cancel := d.bound(ctx)
			d.recoverLeases(lctx, append(live, unheard...))
			cancel()
		}
	}
}

// bound limits ctx to StatementTimeout, for one statement of a lane, or
// one step of the control loop or of touchLoop.
func (d *Dispatcher) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	return timeout.Bound(ctx, d.cfg.StatementTimeout)
}

// jitter spreads polls of many dispatchers by ±10%. Near the largest
// Duration (a PollInterval meant as "never"), p plus its share would wrap to
// a negative wait, and the dispatcher would poll at once: the wait stops at
// the largest Duration instead.
func jitter(p time.Duration) time.Duration {
	d := rand.N(p/5+1) - p/10
	if d > math.MaxInt64-p {
		return math.MaxInt64
	}
	return p + d
}

// wakeAfterConnect wakes the lanes that may have missed a notification
// while the listener was away (wake_scan.sql), or every lane if the scan
// fails. Until the listener has heard a heartbeat, the scan carries one.
func (d *Dispatcher) wakeAfterConnect(ctx context.Context) {
	var queueLanes, invokeLanes [][16]byte
	heartbeat := ""
	token := d.listener.FirstHeartbeat()
	if token != "" {
		heartbeat = "h:" + token
	}
	// The third column is there only to make pg_notify run.
	err := d.db.QueryRow(ctx, queries.WakeScan, queries.Args{"owner": queries.UUID(d.owner), "heartbeat": heartbeat}).Scan(&queueLanes, &invokeLanes, new(bool))
	if token != "" {
		if err != nil {
			d.listener.ForgetHeartbeat(token)
		} else {
			d.listener.HeartbeatSent(token)
		}
	}
	if err != nil {
		if !timeout.Stopping(ctx) {
			d.failed(OpPoll)
			d.log.Warn().Err(timeout.Explain(ctx, err)).Msg("scanning for work after connecting failed; waking every queue")
			d.wakeAll()
		}
		return
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	for _, id := range queueLanes {
		if cl := d.lanes[id]; cl != nil {
			cl.queue.poke()
		}
	}
	for _, id := range invokeLanes {
		if cl := d.lanes[id]; cl != nil {
			cl.invoke.poke()
		}
	}
}

func (d *Dispatcher) wakeAll() {
	d.mu.RLock()
	defer d.mu.RUnlock()
	for _, cl := range d.lanes {
		cl.queue.poke()
		cl.invoke.poke()
	}
}

// pollFailed handles a fallback poll, carrying heartbeat token, that
// failed. Its token is forgotten: the cancelled statement's notification
// was rolled back, and a token from a statement that was answered with an
// error was never sent. If the server did not answer within
// StatementTimeout, the path to it is suspect, as after a failover or a
// partition, when every connection opened before it hangs: the
// listener's too, which hears nothing and says nothing. So the listener
// is reconnected at once, and catches up on reconnecting; a poll that
// failed used to leave a hung listener in place until a poll succeeded,
// one poll interval per dead pooled connection. The reconnect is not a
// missed heartbeat: counting it as one (the token armed, then missed)
// took a listener on a direct connection, whose polls timed out on a
// locked queue_messages, for one that can never hear (notify.ErrDeaf,
// with the transaction-pooling hint). And the pool's connections are
// dropped (pgxpool's Reset: idle ones closed at once, those in use when
// they come back, new ones dialled on demand): the others opened on the
// same path would each hang a statement for StatementTimeout in turn, the
// reload and the scan after the listener's reconnect first (ShouldPing's
// ping waits as long), while a healthy server costs only a few new
// connections, once a poll interval at most. The scan after a reconnect
// only forgets its token when it fails: its connection is new, and a
// reconnect for each scan timed out on a locked table would repeat every
// StatementTimeout.
func (d *Dispatcher) pollFailed(ctx context.Context, token string) {
	d.listener.ForgetHeartbeat(token)
	if ctx.Err() == nil || timeout.Stopping(ctx) {
		return
	}
	d.db.Reset()
	d.reclaim.PathSuspect()
	d.listener.Restart()
	d.log.Warn().Stringer("statement_timeout", d.cfg.StatementTimeout).
		Msg("no answer from the database: dropping the pool's connections and reconnecting the listener")
}

// missedGrace is how long work must have been ready for a fallback poll
// that finds it on a quiet lane to count it as a missed notification.
// Work that came due just now is on its way: another dispatcher's timer
// for a nack's or a delayed message's due time fires at that moment (in
// soaks, polls caught such work 10 - 15 ms after it came due), or its
// notification is in flight. The poll wakes the lane either way; a
// notification lost for work enqueued less than this before a poll goes
// uncounted.
const missedGrace = time.Second

// poll runs the fallback poll: one statement that also carries the
// listener's heartbeat and the next lease expiry.
func (d *Dispatcher) poll(ctx context.Context) {
	// Which lanes are quiet before the poll: ready work on a lane that was
	// quiet before and after it, and did not run in between, is work whose
	// notification was missed.
	type mark struct {
		quiet  bool
		passes uint64
	}
	before := map[*lane]mark{}
	d.mu.RLock()
	for _, cl := range d.lanes {
		for _, l := range []*lane{cl.queue, cl.invoke} {
			q, n := l.quiet()
			before[l] = mark{q, n}
		}
	}
	d.mu.RUnlock()

	token := d.listener.ExpectHeartbeat()
	var queueReady, queueStale, invokeReady, invokeStale, liveOffers []uuid.UUID
	var nextExpiry *time.Time
	var dbStart, dbNow, listed time.Time
	var offers, unheard []uuid.UUID
	// The first column is there only to make pg_notify run. The offers
	// are listed once the poll has its connection: poll.sql deletes ours
	// made more than 5 s before it that the list lacks, which a long wait
	// for a connection after listing would have reached.
	sent, err := d.timedRow(ctx, queries.Poll, func() queries.Args {
		listed = time.Now()
		offers, unheard = d.offerTokens(listed)
		return queries.Args{
			"heartbeat":       "h:" + token,
			"default_vt_secs": int(d.cfg.DefaultVisibilityTimeout / time.Second),
			"owner":           d.owner,
			"offers":          queries.UUIDs(offers),
			"offer_ttl_ms":    d.offerTTL().Milliseconds(),
			"grace_ms":        missedGrace.Milliseconds(),
		}
	}, new(bool), &queueReady, &queueStale, &invokeReady, &invokeStale, &nextExpiry, &liveOffers, &dbStart, &dbNow)
	if err != nil {
		if !timeout.Stopping(ctx) {
			d.failed(OpPoll)
			d.log.Warn().Err(timeout.Explain(ctx, err)).Msg("fallback poll failed")
		}
		d.pollFailed(ctx, token)
		return
	}
	d.listener.HeartbeatSent(token)
	if nextExpiry != nil {
		d.reclaim.Observe(claim.LocalClock(dbNow)(*nextExpiry))
	}
	d.recoverLeases(ctx, unheard)
	d.afterPoll(ctx, listed, boundOf(sent, dbStart), offers, liveOffers)
	set := func(ids []uuid.UUID) map[uuid.UUID]bool {
		m := make(map[uuid.UUID]bool, len(ids))
		for _, id := range ids {
			m[id] = true
		}
		return m
	}
	staleQueue, staleInvoke := set(queueStale), set(invokeStale)
	missed := 0
	wake := func(l *lane, stale bool) {
		b := before[l]
		q, n := l.quiet()
		if stale && b.quiet && q && n == b.passes {
			missed++
		}
		l.poke()
	}
	d.mu.RLock()
	for _, id := range queueReady {
		if cl := d.lanes[id]; cl != nil {
			wake(cl.queue, staleQueue[id])
		}
	}
	for _, id := range invokeReady {
		if cl := d.lanes[id]; cl != nil {
			wake(cl.invoke, staleInvoke[id])
		}
	}
	d.mu.RUnlock()
	if missed > 0 {
		d.log.Warn().Int("queues", missed).Msg("fallback poll found ready work on idle queues; notifications were missed, or a dispatcher that alone knew a retry's due time died or could not wake the others")
	}
	if d.cfg.Observer != nil {
		d.cfg.Observer.Polled(missed)
	}
}

// loadConsumers reads every consumer and starts, updates or stops lanes
// to match. It returns how many consumers it started lanes for.
func (d *Dispatcher) loadConsumers(ctx context.Context) (added int, err error) {
	rows, err := d.db.Query(ctx, queries.ConsumerList, queries.Args{"app_name": nil, "with_secret": true})
	if err != nil {
		return 0, fmt.Errorf("load consumers: %w", err)
	}
	consumers, err := pgx.CollectRows(rows, scanConsumer)
	if err != nil {
		return 0, fmt.Errorf("load consumers: %w", err)
	}
	// Resolved before d.mu is taken: the listener's routes read under it,
	// and a slow Resolver (a lookup of its own, a logger that blocks)
	// held up every notification for as long as the reload took.
	handlers := make([]Handler, len(consumers))
	for i, c := range consumers {
		handlers[i] = d.resolve(c)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped {
		return 0, nil
	}
	seen := make(map[uuid.UUID]bool, len(consumers))
	var fresh []*lane             // queue lanes started
	var heirs [][2]*consumerLanes // old lanes whose slots new ones count, and those
	for i, c := range consumers {
		h := handlers[i]
		if h == nil {
			continue
		}
		seen[c.ID] = true
		st := &consumerState{Consumer: c, handler: h}
		var moved *consumerLanes
		if cl := d.lanes[c.ID]; cl != nil && cl.queue.target.Queue != c.Queue {
			// Moved to another queue (by SQL; the API cannot): new lanes.
			d.dropLanes(cl)
			delete(d.lanes, c.ID)
			moved = cl
		}
		if cl := d.lanes[c.ID]; cl != nil {
			old := cl.queue.state.Swap(st)
			cl.invoke.state.Store(st)
			// Only a pause, a resume or a new in-flight limit changes what
			// a lane may claim now; other settings apply from its next
			// pass. Waking every lane on every reload would claim once per
			// consumer and source.
			if old.Enabled != c.Enabled || old.MaxInFlight != c.MaxInFlight {
				cl.queue.poke()
				cl.invoke.poke()
			}
			continue
		}
		lctx, cancel := context.WithCancel(context.Background())
		slots := new(atomic.Int32)
		// The lanes this consumer had: moved to another queue just now,
		// or stopped by an earlier reload that did not serve it, whose
		// deliveries may still run.
		prev := moved
		if prev == nil {
			prev = d.holding[c.ID]
		}
		delete(d.holding, c.ID)
		if prev != nil {
			// The old lanes' deliveries run on and hold their slots: the
			// new lanes count them, against the same MaxInFlight, and
			// each one that ends frees its slot for them (freeSlots).
			slots = prev.queue.inFlight
		}
		cl := &consumerLanes{
			queue:  newLane(lctx, d, st, claim.Target{Source: claim.Queue, AppID: c.AppID, Queue: c.Queue, TriggerID: c.ID}, slots),
			invoke: newLane(lctx, d, st, claim.Target{Source: claim.Invoke, AppID: c.AppID, TriggerID: c.ID}, slots),
			cancel: cancel,
		}
		cl.queue.sibling, cl.invoke.sibling = cl.invoke, cl.queue
		if prev != nil {
			// Linked once the new lanes are complete (after below): a
			// delivery of the old ones that ends starts the heir's
			// goroutines (freeSlots). A slot freed before then is in the
			// shared count, which the new lanes' first pass reads.
			heirs = append(heirs, [2]*consumerLanes{prev, cl})
		}
		d.lanes[c.ID] = cl
		d.byQueue[queueKey{c.AppID, c.Queue}] = cl.queue
		// No goroutines yet: the first wake-up starts them.
		fresh = append(fresh, cl.queue)
	}
	for id, cl := range d.lanes {
		if !seen[id] {
			d.dropLanes(cl)
			delete(d.lanes, id)
		}
	}
	for id, cl := range d.holding {
		// Also forgotten as the last slot is freed (slotsDrained); this
		// catches a count that a stopped lane's claim took and gave back.
		if cl.queue.inFlight.Load() == 0 {
			delete(d.holding, id)
		}
	}
	if len(d.panicked) > 0 {
		exists := make(map[uuid.UUID]bool, len(consumers))
		for _, c := range consumers {
			exists[c.ID] = true
		}
		for id := range d.panicked {
			if !exists[id] {
				delete(d.panicked, id)
			}
		}
	}
	for _, l := range fresh {
		l.after = d.tidying[queueKey{l.target.AppID, l.target.Queue}]
	}
	for _, h := range heirs {
		h[0].queue.heir.Store(h[1])
		h[0].invoke.heir.Store(h[1])
	}
	return len(fresh), nil
}

// dropLanes stops the lanes of a consumer gone while the dispatcher
// runs on (removed, not served by this dispatcher any more, or moved to
// another queue). Lanes whose deliveries still hold slots are kept in
// holding until those end, for the lanes that may serve the consumer
// again. d.mu must be held.
func (d *Dispatcher) dropLanes(cl *consumerLanes) {
	cl.stop(true)
	if cl.queue.inFlight.Load() > 0 {
		// After stop: a claim pass that the stop did not cut short has
		// taken its slots by now, and one that it did delivers nothing.
		d.holding[cl.queue.target.TriggerID] = cl
	}
	// A consumer replaced in one reload (removed and registered again
	// under a new id) has its new lane here already.
	k := queueKey{cl.queue.target.AppID, cl.queue.target.Queue}
	if d.byQueue[k] == cl.queue {
		delete(d.byQueue, k)
	}
	d.tidying[k] = cl.queue
}

// slotsDrained forgets the lanes kept in holding that share l's slot
// count, once that count is back to zero: l's consumer is not served here
// now, and its stopped lanes start no delivery (a claim pass of theirs
// cut short by the stop gives back what it claimed).
func (d *Dispatcher) slotsDrained(l *lane) {
	d.mu.Lock()
	defer d.mu.Unlock()
	id := l.target.TriggerID
	if cl := d.holding[id]; cl != nil && cl.queue.inFlight == l.inFlight && l.inFlight.Load() == 0 {
		delete(d.holding, id)
	}
}

// tidied forgets l once it has given up its busy mark and offers.
func (d *Dispatcher) tidied(l *lane) {
	d.mu.Lock()
	k := queueKey{l.target.AppID, l.target.Queue}
	if d.tidying[k] == l {
		delete(d.tidying, k)
	}
	d.mu.Unlock()
	close(l.tidied)
}

// stopLanes stops every lane's claiming and waits until no lane can
// start another delivery; in-flight deliveries go on. It returns the
// lanes it stopped, for handOver.
func (d *Dispatcher) stopLanes() []*lane {
	d.mu.Lock()
	d.stopped = true
	close(d.stopping)
	stopped := make([]*lane, 0, 2*len(d.lanes))
	for id, cl := range d.lanes {
		// No tidying per lane: the lock connection, closed as the stop
		// begins (busylock.Holder.Run), frees every busy key at once;
		// with leasing at INSERT, Run deletes the offers then too
		// (dropOffers), and ends leasing once the handlers have finished
		// (closeOffers); the busy-mark rows go last of all
		// (claim.ClearMarks), and only other dispatchers read them.
		cl.stop(false)
		delete(d.lanes, id)
		stopped = append(stopped, cl.queue, cl.invoke)
	}
	clear(d.byQueue)
	d.mu.Unlock()
	d.lanesRun.Wait()
	return stopped
}

// handOver runs once a stop has written every outcome, within ctx, the
// stop's budget: it wakes the other
// dispatchers for each stopped lane that had a due time or had nacked
// (sql/hand_over.sql), and for what was handed over to it since the stop
// began or could not be sent before (owed: retries nacked by lanes a
// reload had stopped, whose queue no lane here served), so that the
// retries whose time only this dispatcher knew are delivered on time and
// not at a fallback poll.
func (d *Dispatcher) handOver(ctx context.Context, lanes []*lane) {
	var due []claim.Target
	for _, l := range lanes {
		if l.timed.Load() || l.nacked.Load() {
			due = append(due, l.target)
		}
	}
	d.mu.Lock()
	for t := range d.owed {
		due = append(due, t)
	}
	clear(d.owed)
	d.mu.Unlock()
	if len(due) == 0 {
		return
	}
	if err := d.wake(ctx, due); err != nil {
		d.log.Warn().Err(timeout.Explain(ctx, err)).Int("lanes", len(due)).
			Msg("could not wake the other dispatchers for the retries this one had timed; they find them at their fallback poll")
	}
}

// wake notifies every dispatcher, this one included, for targets
// (sql/hand_over.sql), one notification for each queue or invoke outbox.
func (d *Dispatcher) wake(ctx context.Context, targets []claim.Target) error {
	seen := make(map[string]bool)
	var payloads []string
	for _, t := range targets {
		e := notify.Event{Kind: notify.KindQueue, AppID: t.AppID, Queue: t.Queue}
		if t.Source == claim.Invoke {
			e = notify.Event{Kind: notify.KindInvoke, AppID: t.AppID, TriggerID: t.TriggerID}
		}
		if p := e.String(); !seen[p] {
			seen[p] = true
			payloads = append(payloads, p)
		}
	}
	_, err := d.db.Exec(ctx, queries.HandOver, queries.Args{"payloads": payloads})
	return err
}

// handTarget is t as its hand-over's notification names it: a queue's
// without the consumer, an invoke outbox's without the queue.
func handTarget(t claim.Target) claim.Target {
	if t.Source == claim.Queue {
		return claim.Target{Source: claim.Queue, AppID: t.AppID, Queue: t.Queue}
	}
	return claim.Target{Source: claim.Invoke, AppID: t.AppID, TriggerID: t.TriggerID}
}

// handOverLater wakes every dispatcher for t (sql/hand_over.sql) off the
// caller's goroutine, which may be the Completer's (a nack's Done): a
// retry nacked, or a due time armed, by a lane that a reload stopped,
// when no lane here serves its queue or invoke outbox now. Only this
// dispatcher knows that due time, and the other dispatchers, which may
// serve the consumer now (a Go handler replaced by a push consumer
// another process serves), would otherwise find it at their fallback
// poll. Hand-overs asked for while one is being sent go together in the
// next statement; once the stop has begun, they are the stop's
// (handOver), within its budget.
func (d *Dispatcher) handOverLater(t claim.Target) {
	t = handTarget(t)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped {
		d.owed[t] = true
		return
	}
	d.handing[t] = true
	if !d.handRunning {
		d.handRunning = true
		d.handers.Add(1)
		go d.handLoop()
	}
}

// handLoop sends the hand-overs that handOverLater asked for until none
// is left, each statement bounded by StatementTimeout and cut short by
// the stop, which then sends what was not (owed).
func (d *Dispatcher) handLoop() {
	defer d.handers.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-d.stopping:
			cancel()
		case <-ctx.Done():
		}
	}()
	for {
		d.mu.Lock()
		if d.stopped {
			for t := range d.handing {
				d.owed[t] = true
			}
			clear(d.handing)
		}
		if len(d.handing) == 0 {
			d.handRunning = false
			d.mu.Unlock()
			return
		}
		targets := make([]claim.Target, 0, len(d.handing))
		for t := range d.handing {
			targets = append(targets, t)
		}
		clear(d.handing)
		d.mu.Unlock()
		bctx, bcancel := d.bound(ctx)
		err := d.wake(bctx, targets)
		bcancel()
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			// The stop began: its hand-over sends them (stopWrites waits
			// for this loop first).
			d.mu.Lock()
			for _, t := range targets {
				d.owed[t] = true
			}
			d.mu.Unlock()
			continue
		}
		ev := d.log.Warn().Err(timeout.Explain(bctx, err)).Int("targets", len(targets))
		if len(targets) == 1 {
			ev = ev.Str("app_id", targets[0].AppID.String()).Stringer("source", targets[0].Source)
			if targets[0].Source == claim.Queue {
				ev = ev.Str("queue", targets[0].Queue)
			} else {
				ev = ev.Str("consumer_id", targets[0].TriggerID.String())
			}
		}
		ev.Msg("could not wake the other dispatchers for a retry nacked by a consumer this one no longer serves; they find it at their fallback poll")
	}
}

// pokeServing wakes the lane that serves target now, if this dispatcher
// has one, for the pass a nack asks for (lane.afterNack): a nack written
// after its lane was stopped by a reload (its consumer replaced, paused or
// moved) sends no notification, and the stopped lane's timer is gone, so
// nobody else would learn its retry time before the fallback poll. The
// serving lane takes the nack as its own: if it has no free slot to read
// the retry's due time, it hands it over (lane.handOff), and a stop hands
// it over too (handOver). With no lane here serving target (the consumer
// went to a push consumer another process serves, say), the other
// dispatchers are woken for it (handOverLater). A stopped lane's due time
// goes the same way as the lane is tidied up (lane.tidyUp).
func (d *Dispatcher) pokeServing(t claim.Target) {
	d.mu.RLock()
	var l *lane
	if t.Source == claim.Queue {
		l = d.byQueue[queueKey{t.AppID, t.Queue}]
	} else if cl := d.lanes[t.TriggerID]; cl != nil {
		l = cl.invoke
	}
	d.mu.RUnlock()
	if l == nil {
		d.handOverLater(t)
		return
	}
	l.nacked.Store(true)
	l.renacked.Store(true)
	l.poke()
}

// fired notes a delivery to consumer id, for last_fired_at.
func (d *Dispatcher) fired(id uuid.UUID) {
	d.lastFiredMu.Lock()
	d.lastFired[id] = true
	d.lastFiredMu.Unlock()
}

// touchLoop writes last_fired_at at most once a second, for all consumers
// delivered to in that second, and not at all while idle.
func (d *Dispatcher) touchLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fctx, cancel := d.bound(ctx)
			d.flushLastFired(fctx)
			cancel()
		}
	}
}

func (d *Dispatcher) flushLastFired(ctx context.Context) {
	d.lastFiredMu.Lock()
	if len(d.lastFired) == 0 {
		d.lastFiredMu.Unlock()
		return
	}
	ids := make([]pgtype.UUID, 0, len(d.lastFired)) // see queries.UUID
	for id := range d.lastFired {
		ids = append(ids, queries.UUID(id))
	}
	clear(d.lastFired)
	d.lastFiredMu.Unlock()
	if _, err := d.db.Exec(ctx, queries.TouchLastFired, queries.Args{"trigger_ids": ids}); err != nil {
		// Tried again with the next second's: a consumer delivered to once
		// would otherwise never show it.
		d.lastFiredMu.Lock()
		for _, id := range ids {
			d.lastFired[id.Bytes] = true
		}
		d.lastFiredMu.Unlock()
		if !timeout.Stopping(ctx) {
			d.log.Debug().Err(timeout.Explain(ctx, err)).Msg("updating last_fired_at failed; trying again in a second")
		}
	}
}
