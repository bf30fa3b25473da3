// Package busylock holds a dispatcher's busy marks as producers see them:
// session advisory locks, one per queue, on a connection of its own
// (sql/busy_hold.sql, migrations/0042_busy_locks.sql). While a queue's key
// is held, its producers skip their notification.
//
// The locks end with the session, so a dispatcher that dies loses its
// marks at once. A dispatcher that hangs loses them to the server's
// idle_session_timeout, set on the session while it holds any mark, and
// only then; the holder keeps it from firing with keep-alives, which it
// sends only then. A broken or timed-out session loses every mark without
// the lanes knowing: Release then reports the release as unconfirmed,
// because the old backend may still hold the key for a moment, and the
// lane must confirm that the key is free before it sleeps
// (claim.TryBusyLock). So does a Hold that failed once its statement was
// sent: the statement may have taken the key before its answer was lost.
package busylock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	queries "github.com/bellhopq/bellhop/sql"
)

// Key names one queue.
type Key struct {
	AppID uuid.UUID
	Queue string
}

// ErrClosed is returned by Hold after Run has returned.
var ErrClosed = errors.New("busylock: closed")

// Holder owns the lock connection. Its methods are safe for concurrent
// use: Hold, Release and the keep-alives take turns on the one
// connection; Held answers without waiting for them.
type Holder struct {
	connect func(context.Context) (*pgx.Conn, error)
	owner   uuid.UUID
	idle    time.Duration
	log     zerolog.Logger

	mu     sync.Mutex // a turn on the connection
	conn   *pgx.Conn
	closed bool

	// keys guards held and lost apart from mu, so that Held, which every
	// claim pass asks, does not wait for a statement on the connection.
	// Taken inside mu when both are. Both change only in a turn (under mu),
	// so that a turn can rely on what it reads of them.
	keys sync.Mutex
	held map[Key]struct{}
	lost map[Key]struct{} // held by a session that was dropped
}

// New returns a Holder that opens its connection with connect when it
// first needs one. owner names the dispatcher in the busy notification
// that a successful Hold sends. idle is the session's idle_session_timeout
// while it holds marks: how long a hung dispatcher keeps them.
func New(connect func(context.Context) (*pgx.Conn, error), owner uuid.UUID, idle time.Duration, log zerolog.Logger) *Holder {
	return &Holder{
		connect: connect, owner: owner, idle: idle, log: log,
		held: map[Key]struct{}{}, lost: map[Key]struct{}{},
	}
}

// Hold marks k busy for producers. It reports whether this dispatcher now
// holds k's key: false if another dispatcher holds it, or a producer was
// testing it at that instant. It never waits for the lock. A new hold
// also tells the other dispatchers, in the same statement, so that they
// watch the key (notify.KindBusy). Holding k already, it sends nothing:
// the session takes a key at most once, so that one Release ends it.
func (h *Holder) Hold(ctx context.Context, k Key) (bool, error) {
	if h.Held(k) {
		return true, nil // a lane refreshing its mark need not wait its turn
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	// Again, now that held cannot change under us: two lanes of one queue
	// (an operator's SQL can give a queue two consumers) may both have
	// passed the check above while one of them took the key. The lock is
	// re-entrant and busy_release.sql unlocks once, so a second take would
	// leave the session holding the key after its Release: with no marks
	// left, untimed and without keep-alives, until the process exits, and
	// the queue's producers silent all that while.
	if h.Held(k) {
		return true, nil
	}
	if h.closed {
		return false, ErrClosed
	}
	if ctx.Err() != nil {
		// Ended while waiting its turn: nothing was sent, so the session
		// and every key it holds are as they were.
		return false, fmt.Errorf("busy lock %s/%s: hold: %w", k.AppID, k.Queue, ctx.Err())
	}
	if h.conn == nil {
		c, err := h.connect(ctx)
		if err != nil {
			return false, fmt.Errorf("busy lock %s/%s: connect: %w", k.AppID, k.Queue, err)
		}
		h.conn = c
	}
	// Whether the session holds other keys: if it is refused this one, its
	// idle_session_timeout stays armed only then, since keep-alives are
	// sent only then (Run).
	h.keys.Lock()
	holding := len(h.held) > 0
	h.keys.Unlock()
	var unset, held bool
	var notified int64
	err := h.conn.QueryRow(ctx, queries.BusyHold, queries.Args{
		"app_id": queries.UUID(k.AppID), "queue_name": k.Queue, "owner": queries.UUID(h.owner),
		"idle_ms": h.idle.Milliseconds(), "holding": holding,
	}).Scan(&unset, &held, &notified)
	if err != nil {
		h.drop()
		// The statement may have taken the key before its answer was
		// lost (a timeout on a dead path): the dropped session's backend
		// may then hold it, as it may the keys it held, until the server
		// ends that session, and producers skip their notifications
		// meanwhile. Release reports it unconfirmed, so that the lane
		// waits until the key is free before it relies on them again.
		h.keys.Lock()
		h.lost[k] = struct{}{}
		h.keys.Unlock()
		return false, fmt.Errorf("busy lock %s/%s: hold: %w", k.AppID, k.Queue, err)
	}
	if held {
		h.keys.Lock()
		h.held[k] = struct{}{}
		// An exclusive lock in the new session: the dropped one is gone.
		delete(h.lost, k)
		h.keys.Unlock()
	}
	return held, nil
}

// Held reports whether this dispatcher holds k's key, as far as it knows.
func (h *Holder) Held(k Key) bool {
	h.keys.Lock()
	defer h.keys.Unlock()
	_, ok := h.held[k]
	return ok
}

// Release ends k's mark. confirmed is false when k was held by a session
// that broke or timed out, or its last Hold failed after sending its
// statement: that session's backend may still hold the key for a moment,
// so the caller must check that the key is free before it relies on
// producers announcing again. Releasing a key that was never held is
// confirmed.
//
// A Release that fails drops the connection, and with it every key, only
// when its statement may have reached the server: one whose ctx ended
// while it waited its turn, or whose statement was never sent on a live
// connection, leaves the session and its keys as they were, k included
// (Held still reports it), and returns the error unconfirmed: call
// Release again.
func (h *Holder) Release(ctx context.Context, k Key) (confirmed bool, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keys.Lock()
	_, lost := h.lost[k]
	delete(h.lost, k)
	_, held := h.held[k]
	last := len(h.held) == 1
	h.keys.Unlock()
	if lost {
		return false, nil
	}
	if !held {
		return true, nil
	}
	if ctx.Err() != nil {
		// Ended while waiting its turn: nothing was sent, so the session
		// and every key it holds, k included, are as they were.
		return false, fmt.Errorf("busy lock %s/%s: release: %w", k.AppID, k.Queue, ctx.Err())
	}
	idle := h.idle
	if last {
		idle = 0 // no marks left: an idle session needs no keep-alives
	}
	var unset, released bool
	err = h.conn.QueryRow(ctx, queries.BusyRelease, queries.Args{
		"app_id": queries.UUID(k.AppID), "queue_name": k.Queue, "idle_ms": idle.Milliseconds(),
	}).Scan(&unset, &released)
	if err != nil && pgconn.SafeToRetry(err) && !h.conn.IsClosed() {
		// Never sent (the context ended just now, say), on a session
		// that is still there: it holds its keys as before. A write
		// that failed is safe to retry too, but pgx closes the
		// connection then, and the session is gone.
		return false, fmt.Errorf("busy lock %s/%s: release: %w", k.AppID, k.Queue, err)
	}
	if err != nil {
		h.drop()
		h.keys.Lock()
		delete(h.lost, k)
		h.keys.Unlock()
		return false, fmt.Errorf("busy lock %s/%s: release: %w", k.AppID, k.Queue, err)
	}
	h.keys.Lock()
	delete(h.held, k)
	h.keys.Unlock()
	if !released {
		// The session is not the one that took the key: treat the key
		// as lost.
		h.log.Warn().Str("app_id", k.AppID.String()).Str("queue", k.Queue).
			Msg("busy lock was not held by its session at release")
		return false, nil
	}
	return true, nil
}

// Run sends keep-alives while marks are held, until ctx ends; then it
// closes the connection, which releases every mark.
func (h *Holder) Run(ctx context.Context) {
	t := time.NewTicker(h.idle / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			h.mu.Lock()
			h.closed = true
			h.drop()
			h.keys.Lock()
			clear(h.lost)
			h.keys.Unlock()
			h.mu.Unlock()
			return
		case <-t.C:
			h.keepAlive(ctx)
		}
	}
}

func (h *Holder) keepAlive(ctx context.Context) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keys.Lock()
	marks := len(h.held)
	h.keys.Unlock()
	if marks == 0 || h.conn == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, h.idle)
	defer cancel()
	if err := h.conn.Ping(pctx); err != nil {
		if ctx.Err() == nil {
			h.log.Warn().Err(err).Int("marks", marks).
				Msg("busy lock connection failed; producers of the marked queues notify again")
		}
		h.drop()
	}
}

// drop closes the connection, which ends its session and so its locks,
// and moves every held key to lost. h.mu must be held.
func (h *Holder) drop() {
	if h.conn == nil {
		return
	}
	cctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = h.conn.Close(cctx)
	cancel()
	h.conn = nil
	h.keys.Lock()
	for k := range h.held {
		h.lost[k] = struct{}{}
	}
	clear(h.held)
	h.keys.Unlock()
}
