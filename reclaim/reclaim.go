// Package reclaim returns expired leases. A message whose consumer died or
// hung past its visibility timeout is made claimable again, or
// dead-lettered when it has used all its attempts, and its queue is
// woken.
//
// The reclaimer is a timer, not a tick: it sleeps until the next lease it
// knows of can expire. It learns of leases from its own dispatcher's
// claims (Observe) and, for leases taken by other dispatchers, from the
// dispatcher's fallback poll (also Observe). It runs one pass at start-up
// and, after that, only when a lease it knows of can have expired: once
// nothing is in flight it runs no statement at all.
//
// A pass returns at most a batch of expired leases, and is cancelled if it
// has not answered within its timeout, so that a pass on a connection
// whose server no longer answers cannot stop the reclaimer; when a pass
// fills its batch, the next one runs at once. A pass reads only the leases
// older than the shortest visibility timeout, since no other can have
// expired, and for the next expiry only those that can end first
// (migration 0060). Its time still grows with the leases in flight when
// many are older than the shortest timeout (consumers with long timeouts
// beside one with a short timeout) and, more slowly, when consumers'
// timeouts differ: a pass cancelled for its timeout is tried again with
// twice the timeout, up to maxGrowth times Options.Timeout, so that many
// leases in flight cannot stop reclaim for good, and after a pass that
// succeeds the next one has twice as long as it took, or
// Options.Timeout if that is longer.
//
// Each message a pass dead-letters is logged at warn with its app_id,
// queue, message_id and attempt, as a handler's dead letter is, at most
// deadLogBurst a pass: the pass returns the details of that many, and one
// more line counts the rest. These lines are written deadLogBurst+1 at
// once and then one a second; the others go to the debug level, and the
// next warn line counts the dead letters they left out in held_back.
//
// The package is importable, since the repository's layout puts it at the
// top level, but it is a part of the dispatcher in package bellhop, not an
// API of its own: its names and statements change with the migrations and
// with package bellhop, and no release keeps them. Use package bellhop.
package reclaim

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/backoff"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/timeout"
	queries "github.com/bellhopq/bellhop/sql"
)

// Result counts what one pass did.
type Result struct {
	Released     int64
	DeadLettered int64
}

// DefaultBatch is the most expired leases of each kind (queue messages,
// invoke deliveries) that one pass returns, when Options.Batch is zero. It
// bounds a pass's writes and keeps its transaction short. A pass reads
// the leases older than the shortest timeout along the claimed_at index
// and stops once its batch is full: with 100,000 in flight and 20,000
// expired, reclaim took about as long in passes of 10,000 as in one pass
// (BENCHMARKS.md, "Reclaim passes in batches").
const DefaultBatch = 10000

// maxGrowth bounds how far a pass's timeout grows after passes that ran
// out of it: a pass on a dead connection is still cancelled within 32
// times Options.Timeout.
const maxGrowth = 32

// A failed pass is retried after retryBase, doubled per failure in a row
// up to retryCeiling, each with jitter down to half: a failure that lasts
// (a revoked grant, a database away) costs a statement and a log line at
// 0.5 – 1, 1 – 2 ... 15 – 30s, not every second for as long as it lasts.
const (
	retryBase    = time.Second
	retryCeiling = 30 * time.Second
)

// rearmFloor is the least wait before a pass the timer starts; a pass that
// filled its batch is followed at once instead.
const rearmFloor = 100 * time.Millisecond

// A pass logs at most deadLogBurst of its dead letters one by one, and
// one line more for the rest; a burst of those lines is let through at
// once, then one every deadLogInterval (see the package comment).
const (
	deadLogBurst    = 10
	deadLogInterval = time.Second
)

// deadLetterMessage is the log line of a message a pass dead-lettered.
const deadLetterMessage = "message dead-lettered by the reclaim: its lease expired on the last attempt"

// Options configures a Reclaimer.
type Options struct {
	// DefaultVT applies to messages of queues that have no consumer.
	DefaultVT time.Duration
	// Timeout bounds each pass: one that has not answered by then is
	// cancelled, logged and tried again, backing off, as after any
	// failure, with twice the timeout (see the package comment). Zero: no
	// bound.
	Timeout time.Duration
	// Batch: see DefaultBatch.
	Batch int
	// OnPass, if set, is called after every pass that changed something.
	OnPass func(Result)
	// OnError, if set, is called after every pass that failed, except
	// one that the end of Run's context cut short.
	OnError func(error)
}

// Reclaimer runs reclaim passes when leases can have expired.
type Reclaimer struct {
	db   *pgxpool.Pool
	log  zerolog.Logger
	opts Options

	mu   sync.Mutex
	next time.Time // zero: nothing known in flight
	// notBefore, after a failed pass, is when its retry is due: a lease
	// that ends sooner waits for it, or every claim's Observe would undo
	// the backoff and retry a pass that keeps failing at each lease's end.
	notBefore time.Time
	timer     *time.Timer
	kick      chan struct{}
	// suspect is set by PathSuspect, and taken by the next pass.
	suspect atomic.Bool

	// retryBase and retryCeiling, here so that a test can shorten them.
	retryBase, retryCeiling time.Duration
	// rearm is the least wait before a pass the timer starts (rearmFloor),
	// here so that a test can lengthen it.
	rearm time.Duration

	// deadLog bounds the dead letters' warn lines, and counts the dead
	// letters of the lines it holds back.
	deadLog *logthrottle.Throttle
}

// deadLetter is one of the dead letters a pass lists (reclaim.sql's
// logged column).
type deadLetter struct {
	ID          uuid.UUID  `json:"id"`
	Source      string     `json:"source"`
	AppID       uuid.UUID  `json:"app_id"`
	Queue       string     `json:"queue"`
	ConsumerID  *uuid.UUID `json:"consumer_id"`
	Attempt     int        `json:"attempt"`
	MaxAttempts int        `json:"max_attempts"`
}

// New returns a Reclaimer.
func New(db *pgxpool.Pool, log zerolog.Logger, opts Options) *Reclaimer {
	if opts.Batch <= 0 {
		opts.Batch = DefaultBatch
	}
	r := &Reclaimer{db: db, log: log, opts: opts, kick: make(chan struct{}, 1),
		retryBase: retryBase, retryCeiling: retryCeiling, rearm: rearmFloor, deadLog: logthrottle.New(deadLogBurst+1, deadLogInterval)}
	r.timer = time.AfterFunc(time.Hour, r.fire)
	r.timer.Stop()
	return r
}

// PathSuspect tells r that the path to the server is suspect (the
// dispatcher has just dropped the pool's connections after a fallback poll
// got no answer within its timeout): the passes that ran out of their
// timeout meanwhile may have waited on a dead connection, not on a slow
// server, and the timeout they doubled goes back to Options.Timeout for
// the next pass. It grew through an outage up to 32 times that, and a pass
// on a connection still dead after it would have held the expired leases
// as long.
func (r *Reclaimer) PathSuspect() { r.suspect.Store(true) }

// Observe tells the reclaimer that some lease can expire at t. It arms the
// timer for t unless it is already armed for earlier, or, while passes
// fail, for when the next retry is due if t comes before that.
func (r *Reclaimer) Observe(t time.Time) {
	if t.IsZero() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	t = later(t, r.notBefore)
	if !r.next.IsZero() && !t.Before(r.next) {
		return
	}
	r.next = t
	r.timer.Reset(time.Until(t))
}

func (r *Reclaimer) fire() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Run performs passes when the timer fires, until ctx is done.
func (r *Reclaimer) Run(ctx context.Context) {
	defer r.timer.Stop()
	var failures, stuck int
	bound := r.opts.Timeout
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
		}
		r.mu.Lock()
		if wait := time.Until(r.notBefore); wait > 0 {
			// A kick left from before the retry was armed: keep to it.
			r.next = r.notBefore
			r.timer.Reset(wait)
			r.mu.Unlock()
			continue
		}
		r.next = time.Time{}
		r.mu.Unlock()
		if r.suspect.Swap(false) {
			bound = r.opts.Timeout
		}
		began := time.Now()
		res, next, more, err := r.pass(ctx, bound)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failures++
			wait := backoff.Delay(failures, r.retryBase, r.retryCeiling)
			if timeout.Expired(err) {
				bound = min(2*bound, maxGrowth*r.opts.Timeout)
			}
			// The retry, and nothing sooner: a lease end observed during
			// the pass may have armed the timer earlier, or fired it.
			r.mu.Lock()
			r.notBefore = time.Now().Add(wait)
			r.next = r.notBefore
			r.timer.Reset(wait)
			select {
			case <-r.kick:
			default:
			}
			r.mu.Unlock()
			r.log.Warn().Err(err).Stringer("retry_in", wait).Stringer("timeout", bound).Msg("reclaim pass failed")
			if r.opts.OnError != nil {
				r.opts.OnError(err)
			}
			continue
		}
		r.mu.Lock()
		r.notBefore = time.Time{}
		r.mu.Unlock()
		// A pass that needed a grown timeout is likely to need it again:
		// back at Options.Timeout, every other pass ran out of it, doing
		// its work for nothing and backing off. So the next pass gets
		// twice what this one took, within the same bounds.
		failures = 0
		bound = min(max(2*time.Since(began), r.opts.Timeout), maxGrowth*r.opts.Timeout)
		if more {
			stuck = 0
			r.fire()
			continue
		}
		if next.IsZero() {
			stuck = 0
			continue
		}
		// Leases still live are re-armed, no sooner than rearmFloor, so
		// that one whose consumer's timeout is longer than we knew cannot
		// spin the timer. A lease that has expired and yet was not
		// reclaimed is on a row another transaction holds locked (the pass
		// skips locked rows): it is looked at again backing off to ten
		// times that (once a second), not ten times a second for as long
		// as the lock lasts.
		now := time.Now()
		if res.Released+res.DeadLettered == 0 && !next.After(now) {
			stuck++
		} else {
			stuck = 0
		}
		r.Observe(later(next, now.Add(min(10*r.rearm, r.rearm<<min(stuck, 4)))))
	}
}

// Pass returns expired leases now, a batch at a time until none is left,
// and reports when the next live lease expires, on this process's clock
// (zero if none).
func (r *Reclaimer) Pass(ctx context.Context) (time.Time, error) {
	for {
		_, next, more, err := r.pass(ctx, r.opts.Timeout)
		if err != nil || !more {
			return next, err
		}
	}
}

// pass returns a batch of expired leases, and reports when the next live
// lease expires and whether more may have expired, in one round trip.
// It is cancelled after bound.
func (r *Reclaimer) pass(ctx context.Context, bound time.Duration) (res Result, next time.Time, more bool, err error) {
	ctx, cancel := timeout.Bound(ctx, bound)
	defer cancel()
	res, next, more, err = r.send(ctx)
	return res, next, more, timeout.Explain(ctx, err)
}

func (r *Reclaimer) send(ctx context.Context) (Result, time.Time, bool, error) {
	args := queries.Args{"default_vt_secs": int(r.opts.DefaultVT / time.Second), "batch": r.opts.Batch,
		"dead_logged": deadLogBurst}
	b := &pgx.Batch{}
	b.Queue(queries.Reclaim, args)
	b.Queue(queries.NextLeaseExpiry, args)
	br := r.db.SendBatch(ctx, b)
	defer br.Close()
	var res Result
	var woken, floorsStarted int64
	var more bool
	var logged []byte
	if err := br.QueryRow().Scan(&res.Released, &res.DeadLettered, &woken, &floorsStarted, &more, &logged); err != nil {
		return res, time.Time{}, false, err
	}
	var next *time.Time
	var dbNow time.Time
	if err := br.QueryRow().Scan(&next, &dbNow); err != nil {
		return res, time.Time{}, false, err
	}
	if err := br.Close(); err != nil {
		return res, time.Time{}, false, err
	}
	if res.Released+res.DeadLettered > 0 {
		r.log.Info().Int64("released", res.Released).Int64("dead_lettered", res.DeadLettered).
			Msg("reclaimed expired leases")
		r.logDead(res.DeadLettered, logged)
		if r.opts.OnPass != nil {
			r.opts.OnPass(res)
		}
	}
	if next == nil {
		return res, time.Time{}, more, nil
	}
	return res, claim.LocalClock(dbNow)(*next), more, nil
}

// logDead logs the dead letters of a pass: one line each for those it
// listed (logged, JSON), one line for the rest of its total. Each line is
// a warning while deadLog lets it through, else a debug line, whose dead
// letters the next warning counts in held_back.
func (r *Reclaimer) logDead(total int64, logged []byte) {
	if total == 0 {
		return
	}
	var list []deadLetter
	if len(logged) > 0 {
		if err := json.Unmarshal(logged, &list); err != nil {
			r.log.Warn().Err(err).Int64("dead_lettered", total).Msg("could not read the list of messages the reclaim dead-lettered")
			list = nil
		}
	}
	for _, d := range list {
		ev := r.deadEvent(1).Str("source", d.Source).Str("app_id", d.AppID.String()).Str("queue", d.Queue)
		if d.ConsumerID != nil {
			ev = ev.Str("consumer_id", d.ConsumerID.String())
		}
		ev.Str("message_id", d.ID.String()).Int("attempt", d.Attempt).Int("max_attempts", d.MaxAttempts).
			Msg(deadLetterMessage)
	}
	if rest := total - int64(len(list)); rest > 0 {
		r.deadEvent(rest).Int64("dead_lettered", total).Int64("not_listed", rest).
			Msg("more messages dead-lettered by the reclaim than are logged one by one: their leases expired on the last attempt")
	}
}

// deadEvent starts a line about n dead letters: a warning if deadLog
// lets it through, else a debug line, whose n dead letters the next
// warning counts in held_back.
func (r *Reclaimer) deadEvent(n int64) *zerolog.Event {
	return r.deadLog.Event(&r.log, zerolog.WarnLevel, n)
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
