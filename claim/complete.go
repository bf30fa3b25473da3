package claim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/logthrottle"
	queries "github.com/bellhopq/bellhop/sql"
)

// Verdict is what happens to a message once its handler is done.
type Verdict uint8

const (
	// Ack deletes the message: it was handled.
	Ack Verdict = iota
	// Nack releases it for another attempt after a delay.
	Nack
	// DeadLetter moves it to dead_letters.
	DeadLetter
	// Release gives it back with its attempt refunded: its handler was
	// interrupted by a clean stop, or its delivery never started because
	// the claim returned after the lease had run out. It is claimable at
	// once unless HoldLease keeps it.
	Release
)

// String names v as the logs give it (their "outcome" field).
func (v Verdict) String() string {
	return [...]string{"ack", "nack", "dead_letter", "release"}[v]
}

// Outcome is a settled delivery waiting to be written.
type Outcome struct {
	Message *Message
	Verdict Verdict
	Delay   time.Duration // Nack: how long until the next attempt
	// HoldLease, for a Nack or a Release, keeps the message invisible
	// until its lease of this length would have ended (from claimed_at),
	// if that is later than Delay: its handler was abandoned before the
	// lease ran out, and the work it gave up on may still be running. For
	// a DeadLetter, a redrive before then enqueues the message to be
	// delivered then.
	HoldLease time.Duration
	// Error, for a DeadLetter, is the last error, kept with the dead
	// letter as valid UTF-8 with no NUL bytes, cut to MaxErrorBytes
	// (lastError): text PostgreSQL refuses would fail the whole batch.
	Error string
	Queue string // DeadLetter of an Invoke delivery: its consumer's queue
	// Done, if set, is called once the outcome is written (applied: the
	// token still matched, or not) or when it is not known whether it was:
	// then err wraps ErrOutcomeUnknown, because a try that got a
	// connection failed and may have committed before its answer was
	// lost. Either a later try found the token gone, or every try failed
	// (then it wraps ErrWriteFailed and the last try's error too). When
	// every try failed and none got a connection, nothing was sent: err
	// wraps ErrWriteFailed and the last try's error, not
	// ErrOutcomeUnknown. An outcome not written leaves the lease to
	// expire and the message to be delivered again.
	Done func(applied bool, err error)
}

// ErrOutcomeUnknown is wrapped by Done's error for an outcome whose write
// was tried more than once, a failed try having got a connection to send
// it on: a try that committed but whose answer was lost (a connection
// cut, a timeout after the commit) applied it, or none did. A later try
// that found the token gone, or every try failing, cannot tell which.
var ErrOutcomeUnknown = errors.New("outcome may or may not have been applied: an earlier try may have committed")

// ErrWriteFailed is wrapped, with the last try's error, by Done's error
// for an outcome whose every try failed, and with ErrOutcomeUnknown too
// unless no try got a connection (then nothing was sent); without it,
// ErrOutcomeUnknown means that a later try found the token gone.
var ErrWriteFailed = errors.New("every try to write the outcome failed")

// Completer writes outcomes in batches: whatever has queued up while the
// previous batch was in flight goes in the next one, so a lone outcome is
// written at once and a busy dispatcher writes many per round trip.
type Completer struct {
	db       *pgxpool.Pool
	log      zerolog.Logger
	failLog  *logthrottle.Throttle // batches given up on (flush)
	in       chan Outcome
	maxBatch int
	workers  int
	// tryTimeout bounds one try: writeTimeout, shorter in tests.
	tryTimeout time.Duration
	wg         sync.WaitGroup
	once       sync.Once
	// pending counts the outcomes submitted and not yet settled.
	pending atomic.Int64
	// givenUp counts the outcomes given up on because the writes were
	// cancelled (Shutdown's budget ran out, or Abandon).
	givenUp atomic.Int64
	// writes is the parent of every try's context: Shutdown cancels it
	// when its budget runs out, and no try is made from then on.
	writes       context.Context
	cancelWrites context.CancelCauseFunc
}

// NewCompleter returns a Completer writing through db with the given
// number of concurrent writers (default 2) and batch size (default 500).
func NewCompleter(db *pgxpool.Pool, log zerolog.Logger, workers, maxBatch int) *Completer {
	if workers <= 0 {
		workers = 2
	}
	if maxBatch <= 0 {
		maxBatch = 500
	}
	c := &Completer{db: db, log: log, failLog: logthrottle.New(1, 10*time.Second), in: make(chan Outcome, 4*maxBatch), maxBatch: maxBatch, workers: workers, tryTimeout: writeTimeout}
	c.writes, c.cancelWrites = context.WithCancelCause(context.Background())
	c.wg.Add(workers)
	for range workers {
		go c.loop()
	}
	return c
}

// Submit queues o. It blocks while the queue is full, which slows the
// dispatcher down to the rate the database can settle messages.
func (c *Completer) Submit(o Outcome) {
	c.pending.Add(1)
	c.in <- o
}

// TrySubmit queues o if the queue has room, and reports whether it did;
// it never blocks, for a caller that must not wait (the listener's
// goroutine) and can hand a full queue's wait to a goroutine of its own.
func (c *Completer) TrySubmit(o Outcome) bool {
	c.pending.Add(1)
	select {
	case c.in <- o:
		return true
	default:
		c.pending.Add(-1)
		return false
	}
}

// Pending returns how many submitted outcomes are not settled yet: neither
// written nor given up on.
func (c *Completer) Pending() int { return int(c.pending.Load()) }

// Close writes everything already submitted and returns when done.
// Nothing may be submitted after Close.
func (c *Completer) Close() {
	c.once.Do(func() { close(c.in) })
	c.wg.Wait()
}

// Shutdown is Close within ctx, a stop's budget for its writes: once ctx
// ends, the try under way is cancelled and no other is made, so every
// outcome not written by then is given up on at once (its Done gets
// ErrWriteFailed: the message comes back after its lease, unless the
// cancelled try committed). It returns how many outcomes were given up on
// so, counting those Abandon gave up on before, and, if any were, why the
// writes were cancelled (ctx's cause, or Abandon's); (0, nil) if none
// was, even if ctx ended: Close returns once every outcome is settled, so
// Pending, read after it, is 0 whatever became of them, and ctx may have
// ended with nothing left to write.
func (c *Completer) Shutdown(ctx context.Context) (givenUp int, err error) {
	stop := context.AfterFunc(ctx, func() { c.cancelWrites(context.Cause(ctx)) })
	defer stop()
	c.Close()
	if n := c.givenUp.Load(); n > 0 {
		return int(n), context.Cause(c.writes)
	}
	return 0, nil
}

// Abandon gives up at once on every outcome not written yet and on every
// one submitted from now on: the try under way is cancelled, no other is
// made, and each Done gets ErrWriteFailed, wrapping cause. For a stop
// whose time is up: while the database is away, a batch is retried until
// its leases end, and Submit blocks once the queue is full, so that
// handlers whose outcomes wait behind it could hold a stop for as long.
func (c *Completer) Abandon(cause error) { c.cancelWrites(cause) }

func (c *Completer) loop() {
	defer c.wg.Done()
	batch := make([]Outcome, 0, c.maxBatch)
	for o := range c.in {
		batch = append(batch[:0], o)
	fill:
		for len(batch) < c.maxBatch {
			select {
			case o, ok := <-c.in:
				if !ok {
					break fill
				}
				batch = append(batch, o)
			default:
				break fill
			}
		}
		c.flush(batch)
	}
}

// Bounds of flush's retries.
const (
	// writeTimeout bounds one try.
	writeTimeout = 10 * time.Second
	// maxPause caps the pause between tries, which starts at 50ms and
	// doubles.
	maxPause = time.Second
	// lastTry is the least time a retry gets before the leases end.
	lastTry = 100 * time.Millisecond
	// answeredTries is how many times a batch is tried while each try
	// fails with an error that no outage explains (transient): the
	// server's answer, or the client's own, on a connection it got.
	answeredTries = 5
	// unknownLease is how long a batch is retried when none of its leases
	// has a known end (claimed for a consumer that no longer serves the
	// queue: Message.VisibilityTimeout zero).
	unknownLease = 5 * time.Second
)

// flush writes one batch, retrying while the database is away (a try gets
// no connection, or fails as an outage does: transient) until the
// batch's leases end: the latest lease end of its outcomes, renewals
// included (Message.LeaseEnd), on this process's clock, which measures a
// lease from before its claim was sent and so ends it no later than the
// reclaimer does. The write is fenced by the claim token alone (ack.sql
// and the others match id and token, not the lease's time), so a try
// after that would be harmless, but pointless: the message may be
// reclaimed and delivered again by then, and the write would then change
// nothing. So a restart of the database that takes seconds loses no
// outcome whose lease outlasts it. Tries are paused by 50ms, doubling,
// at most maxPause; each is bounded by c.tryTimeout, writeTimeout but in
// tests (a retry also by the leases' end). An error that no outage explains (transient), the
// server's answer or the client's own, is tried answeredTries times at
// most. Outcomes submitted meanwhile wait for a later batch, which
// another writer may write first (there are two by default): their order
// does not matter, since each is fenced by its own claim token. flush runs on a context of its own: outcomes must be written
// even while the dispatcher is stopping, until Shutdown's budget runs
// out, which cancels the try under way and ends the retries. A failed try
// is logged at debug; a batch given up on at warn, at most once every
// 10 s (a database outage fails every batch).
func (c *Completer) flush(batch []Outcome) {
	var applied Applied
	var err error
	// sent: a failed try got a connection, and so may have committed.
	sent := false
	start := time.Now()
	until := leasesEnd(batch, start)
	delay := 50 * time.Millisecond
	answered := 0 // tries failed with an error no outage explains
	for try := 1; ; try++ {
		by := time.Now().Add(c.tryTimeout)
		if try > 1 && until.Before(by) {
			by = until
		}
		ctx, cancel := context.WithDeadline(c.writes, by)
		applied, err = Write(ctx, c.db, batch)
		cancel()
		if err == nil {
			break
		}
		var noConn *noConnError
		if !errors.As(err, &noConn) {
			sent = true
		}
		if !transient(err) {
			answered++
		}
		// The last retry is made lastTry before the leases end at the
		// latest, the pause before it cut short to fit.
		pause := min(delay, maxPause, time.Until(until)-lastTry)
		if answered < answeredTries && pause >= 0 && c.writes.Err() == nil {
			c.log.Debug().Err(err).Int("batch", len(batch)).Int("try", try).Stringer("retry_in", pause).
				Msg("writing message outcomes failed; retrying")
			select {
			case <-time.After(pause):
				delay *= 2
				continue
			case <-c.writes.Done():
			}
		}
		why := fmt.Sprintf("gave up after %d tries in %s", try, time.Since(start).Round(time.Millisecond))
		switch {
		case c.writes.Err() != nil:
			err = fmt.Errorf("%w (the last try: %w)", context.Cause(c.writes), err)
			why += ": the stop's time for its writes ran out"
			c.givenUp.Add(int64(len(batch)))
		case answered >= answeredTries:
			why += fmt.Sprintf(": %d failed with an error that no outage explains", answered)
		default:
			why += ": the batch's leases have ended"
		}
		if !sent {
			why += "; no try got a connection, so none sent the batch"
		}
		c.failLog.Event(&c.log, zerolog.WarnLevel, 1).Err(err).Int("batch", len(batch)).Int("try", try).
			Msgf("writing message outcomes failed; %s (logged at most once every 10s; held_back counts the batches not logged)", why)
		break
	}
	defer c.pending.Add(-int64(len(batch)))
	for _, o := range batch {
		if o.Done == nil {
			continue
		}
		has := applied.Has(o.Message)
		switch {
		case err != nil && !sent:
			o.Done(false, fmt.Errorf("%w, none got a connection to send it on, the last with: %w", ErrWriteFailed, err))
		case err != nil:
			o.Done(false, fmt.Errorf("%w; %w, the last with: %w", ErrOutcomeUnknown, ErrWriteFailed, err))
		case !has && sent:
			o.Done(false, ErrOutcomeUnknown)
		default:
			o.Done(has, nil)
		}
	}
}

// leasesEnd returns when the latest lease of batch ends, or unknownLease
// after start if none has a known end.
func leasesEnd(batch []Outcome, start time.Time) time.Time {
	var end time.Time
	for i := range batch {
		m := batch[i].Message
		e := m.LeaseEnd
		if e.IsZero() && m.VisibilityTimeout > 0 {
			e = m.LeasedAt.Add(m.VisibilityTimeout)
		}
		if e.After(end) {
			end = e
		}
	}
	if end.IsZero() {
		return start.Add(unknownLease)
	}
	return end
}

// transient reports whether err is what an outage looks like, worth
// retrying until the leases end: no connection (refused, cut, or not
// made in time: a try that got none from the pool, noConnError, unless
// the server refused the session for good: a bad password (28P01), a
// database not there (3D000), no CONNECT privilege (42501)), or one of the server's errors of a restart, a failover or a
// passing conflict: connection exceptions (08), a shutdown or a server
// not accepting connections yet (57P01 - 57P03), too many connections
// (53300), a read-only transaction (25006: a primary demoted to a standby,
// seen before the connection moves on), serialization failures and
// deadlocks (40001, 40P01). Any other error, the server's or the client's
// own (a value pgx cannot encode, say), is no outage's: it fails every
// try alike, and retried until a lease of up to 12h ended it would hold
// back every later outcome.
func transient(err error) bool {
	// First: a dial that hangs (a host that drops packets) or a pool
	// full of them ends the try with the bare context.DeadlineExceeded,
	// which the check below takes for a live connection's silence, and
	// such a batch was given up after answeredTries (about 51s).
	var noConn *noConnError
	if errors.As(err, &noConn) {
		// But for a server that refuses the session for good (a bad
		// password, a role not allowed in, a database gone): retried
		// until the leases end, that held every later outcome for hours.
		// pgx's own list of refusals not worth another host's try; not
		// all of class 28: 28000 is also an LDAP, PAM or RADIUS server
		// out of reach, which passes.
		var refused *pgconn.PgError
		if errors.As(noConn.err, &refused) &&
			(refused.Code == "28P01" || refused.Code == "3D000" || refused.Code == "42501") {
			return false
		}
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03", "53300", "25006", "40001", "40P01":
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08")
	}
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	if pgconn.Timeout(err) || errors.Is(err, context.DeadlineExceeded) {
		// A try that got no answer within its time on a connection it
		// had: a server that is up but slow, or a write waiting on a
		// row lock, as likely as a dead path. Retried until the leases
		// end, one such batch held every later outcome of the
		// dispatcher behind it, for up to a 12h lease.
		return false
	}
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || pgconn.SafeToRetry(err)
}

// noConnError is a Write that got no connection from the pool to send its
// batch on (the dial failed or did not end in time, or the pool stayed
// full until the try's end): nothing was sent, so nothing can have
// committed, and transient counts it as an outage, but for the server's
// refusals for good.
type noConnError struct{ err error }

func (e *noConnError) Error() string { return "no connection: " + e.err.Error() }

func (e *noConnError) Unwrap() error { return e.err }

// Applied is the set of outcomes that a Write applied, each known by its
// message's id and claim token: a batch may hold a stale outcome and the
// current one for the same message, and only the current one applies.
type Applied map[[2]uuid.UUID]bool

// Has reports whether the outcome for m, as claimed with m.Token, applied.
func (a Applied) Has(m *Message) bool { return a[[2]uuid.UUID{m.ID, m.Token}] }

// Write applies outcomes in one round trip (one implicit transaction, its
// statements run with their generic plans: generic_plans.sql) and
// returns those whose tokens still matched. Outcomes whose tokens are
// stale change nothing and are simply absent from the result. The
// connection is acquired first, so that a try that got none (its error
// wraps a noConnError) is known to have sent nothing.
func Write(ctx context.Context, db *pgxpool.Pool, outcomes []Outcome) (Applied, error) {
	var acks, nacks, dead, release settle
	for i := range outcomes {
		o := &outcomes[i]
		switch o.Verdict {
		case Ack:
			acks.add(o)
		case Nack:
			nacks.add(o)
		case DeadLetter:
			dead.add(o)
		case Release:
			release.add(o)
		}
	}
	b := &pgx.Batch{}
	b.Queue(queries.GenericPlans)
	// What each statement of b writes, for its errors: a batch holds up
	// to hundreds of outcomes, and all of them are retried or given up
	// together, so the error says which statement failed.
	what := []string{"set generic plans"}
	if acks.n > 0 {
		what = append(what, fmt.Sprintf("ack %d", acks.n))
		b.Queue(queries.Ack, queries.Args{
			"q_ids": acks.q.ids, "q_tokens": acks.q.tokens,
			"o_ids": acks.o.ids, "o_tokens": acks.o.tokens,
		})
	}
	if nacks.n > 0 {
		what = append(what, fmt.Sprintf("nack %d", nacks.n))
		b.Queue(queries.Nack, queries.Args{
			"q_ids": nacks.q.ids, "q_tokens": nacks.q.tokens, "q_delays_ms": nacks.q.delays, "q_holds_ms": nacks.q.holds,
			"o_ids": nacks.o.ids, "o_tokens": nacks.o.tokens, "o_delays_ms": nacks.o.delays, "o_holds_ms": nacks.o.holds,
		})
	}
	if dead.n > 0 {
		what = append(what, fmt.Sprintf("dead-letter %d", dead.n))
		b.Queue(queries.DeadLetter, queries.Args{
			"q_ids": dead.q.ids, "q_tokens": dead.q.tokens, "q_errors": dead.q.errors, "q_holds_ms": dead.q.holds,
			"o_ids": dead.o.ids, "o_tokens": dead.o.tokens, "o_errors": dead.o.errors, "o_queue_names": dead.o.queues,
			"o_holds_ms": dead.o.holds,
		})
	}
	if release.n > 0 {
		what = append(what, fmt.Sprintf("release %d", release.n))
		b.Queue(queries.Release, queries.Args{
			"q_ids": release.q.ids, "q_tokens": release.q.tokens, "q_holds_ms": release.q.holds,
			"o_ids": release.o.ids, "o_tokens": release.o.tokens, "o_holds_ms": release.o.holds,
		})
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("settle %d messages: %w", len(outcomes), &noConnError{err})
	}
	// After br.Close, on every path: the connection goes back to the
	// pool, or is destroyed if the batch left it broken or busy.
	defer conn.Release()
	applied := make(Applied, len(outcomes))
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		br.Close()
		return nil, fmt.Errorf("settle %d messages: %s: %w", len(outcomes), what[0], err)
	}
	for _, st := range what[1:] {
		rows, err := br.Query()
		if err != nil {
			br.Close()
			return nil, fmt.Errorf("settle %d messages: %s: %w", len(outcomes), st, err)
		}
		for rows.Next() {
			var id, token uuid.UUID
			if err := rows.Scan(&id, &token); err != nil {
				rows.Close()
				br.Close()
				return nil, fmt.Errorf("settle %d messages: %s: %w", len(outcomes), st, err)
			}
			applied[[2]uuid.UUID{id, token}] = true
		}
		if err := rows.Err(); err != nil {
			br.Close()
			return nil, fmt.Errorf("settle %d messages: %s: %w", len(outcomes), st, err)
		}
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("settle %d messages: %w", len(outcomes), err)
	}
	return applied, nil
}

// settle collects one verdict's arguments, split by table.
type settle struct {
	n    int
	q, o columns
}

type columns struct {
	// See queries.UUID: pgx encoded a []uuid.UUID element by element
	// through its driver.Valuer, a fifth of the dispatcher's CPU in
	// burn-downs.
	ids, tokens []pgtype.UUID
	delays      []int64
	holds       []int64
	errors      []string
	queues      []string
}

func (s *settle) add(o *Outcome) {
	s.n++
	c := &s.q
	if o.Message.Source == Invoke {
		c = &s.o
	}
	c.ids = append(c.ids, queries.UUID(o.Message.ID))
	c.tokens = append(c.tokens, queries.UUID(o.Message.Token))
	c.delays = append(c.delays, o.Delay.Milliseconds())
	c.holds = append(c.holds, o.HoldLease.Milliseconds())
	c.errors = append(c.errors, lastError(o.Error))
	c.queues = append(c.queues, o.Queue)
}

// MaxErrorBytes bounds the error text kept with a dead letter. A handler's
// panic keeps its stack, which fits.
const MaxErrorBytes = 16 << 10

// lastError makes a handler's error text storable: PostgreSQL rejects a
// text value with invalid UTF-8 or a NUL byte (SQLSTATE 22021), which
// would roll back every outcome batched with it. Both become U+FFFD, and
// the text is cut to MaxErrorBytes on a character boundary.
func lastError(s string) string {
	if len(s) <= MaxErrorBytes && utf8.ValidString(s) && !strings.Contains(s, "\x00") {
		return s
	}
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
	if len(s) > MaxErrorBytes {
		const ellipsis = "…"
		cut := MaxErrorBytes - len(ellipsis)
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + ellipsis
	}
	return s
}
