package bellhop

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/timeout"
	"github.com/bellhopq/bellhop/notify"
	queries "github.com/bellhopq/bellhop/sql"
)

// LeaseStats counts what leasing at INSERT did (DispatcherConfig.LeaseAtInsert).
// Each message leased to this dispatcher that it took charge of counts
// once, in Leased or in Recovered; it was then delivered, or released with
// its attempt refunded (its lane had stopped or was paused, its queue had
// no consumer any more, the dispatcher was stopping, or it waited for a
// slot too long).
type LeaseStats struct {
	// Offers counts the offers made: the INSERTs that succeeded. One
	// that returned an error is not counted, although its offer may
	// have been written (its reply lost).
	Offers uint64
	// Leased counts messages that producers leased to this dispatcher
	// and that it heard of by their notification.
	Leased uint64
	// Recovered counts messages leased to this dispatcher that it found
	// by their token before it heard their notification: after a
	// listener reconnect, after a poll found the offer taken (the
	// notification lost, or still on its way), and at a clean stop,
	// whose finds are released.
	Recovered uint64
}

// offer is one token this dispatcher put on offer (docs/lease-at-insert.md).
type offer struct {
	lane   *lane
	sentAt time.Time // our clock before the offer was sent (and before its connection was acquired)
	// bound bounds how far the database's clock is ahead of ours: from
	// the offer's own statement, then from each poll that finds the
	// offer still out, so that the bound is never older than one poll
	// interval however long the offer waits (the two clocks drift).
	// Known once the offer's result came back. Under offerBook.mu.
	bound      clockBound
	boundKnown bool
	// live: on offer as far as we know. A token no longer on offer that
	// we have not heard of may still be taken by a producer that locked
	// it and commits later; we keep it until forget.
	live   bool
	forget time.Time
}

// offerBook holds the dispatcher's tokens. A token leaves the book exactly
// once, with the message leased under it: from its notification, or from
// a recovery; whichever comes second finds nothing.
type offerBook struct {
	mu      sync.Mutex
	byToken map[uuid.UUID]*offer
	// closed: the dispatcher has stopped; leases are no longer taken.
	closed bool
	stats  LeaseStats
	// closing is held for reading while a leased message's release is
	// submitted to the completer, and for writing while closed is set,
	// so that no release is submitted after closeOffers returns and the
	// completer closes.
	closing sync.RWMutex
}

// newLeaseChannel returns a fresh channel name: 128 random bits, known only
// to this dispatcher and to bellhop_offers.
func newLeaseChannel() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "bellhop_l_" + hex.EncodeToString(b[:])
}

// holdLeaseKey takes the lease key (sql/lease_key_hold.sql) on a new
// listener connection, before it LISTENs: producers look for offers only
// while the key is held. A producer holds the key for the instant of its
// test, so a failed try is retried for a second. If the key stays taken
// (a session that kept it exclusively, which the producers' test never
// does), the dispatcher goes on without it: its offers then mostly go
// unused and its messages come by claims, as without leasing, until the
// next connection tries again.
func (d *Dispatcher) holdLeaseKey(ctx context.Context, conn *pgx.Conn) error {
	deadline := time.Now().Add(time.Second)
	for {
		var held bool
		if err := conn.QueryRow(ctx, queries.LeaseKeyHold, queries.Args{"owner": d.owner}).Scan(&held); err != nil {
			return fmt.Errorf("take the lease key: %w", err)
		}
		if held {
			return nil
		}
		if time.Now().After(deadline) {
			d.log.Warn().Msg("another session holds the lease key exclusively; producers will seldom lease to this dispatcher until the listener reconnects")
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// maxOfferTTL bounds offerTTL, for a PollInterval of decades, which means
// "never poll": an offer that lives a century lives for ever. Without the
// bound, three times a PollInterval of about 97 years or more wrapped to a
// negative TTL, every offer was written expired, and leasing was off
// without a word. A century keeps what the TTL feeds in range: the
// token's forget time (retire adds the visibility timeout, at most 12 h,
// to it) and the offer's expires_at, now() plus the TTL in PostgreSQL,
// whose timestamps end in 294276 AD. A bound of days instead would leave
// the offers of a longer PollInterval expired, and so unused by
// producers, for most of each interval.
const maxOfferTTL = 100 * 365 * 24 * time.Hour

// offerTTL is how long an offer lives without its dispatcher's poll: three
// polls, so that one failed poll does not end it, and at most maxOfferTTL.
func (d *Dispatcher) offerTTL() time.Duration {
	if d.cfg.PollInterval > maxOfferTTL/3 {
		return maxOfferTTL
	}
	return 3 * d.cfg.PollInterval
}

// makeOffer puts one token of l's queue on offer. It runs on l's goroutine.
// The lane's offered flag is set before the offer is sent, since its lease
// may be heard of before the offer's result comes back.
func (l *lane) makeOffer(ctx context.Context) {
	d := l.d
	token := uuid.New()
	o := &offer{lane: l, sentAt: time.Now(), live: true}
	d.offers.mu.Lock()
	if d.offers.closed {
		d.offers.mu.Unlock()
		return
	}
	d.offers.byToken[token] = o
	d.offers.mu.Unlock()
	l.offered.Store(true)

	var dbStart time.Time
	bctx, cancel := d.bound(ctx)
	defer cancel()
	args := queries.Args{
		"token": queries.UUID(token), "app_id": queries.UUID(l.target.AppID), "queue_name": l.target.Queue, "owner": queries.UUID(d.owner),
		"channel": d.leaseChannel, "ttl_ms": d.offerTTL().Milliseconds(), "consumer_id": queries.UUID(l.target.TriggerID),
	}
	sent, err := d.timedRow(bctx, queries.OfferMake, func() queries.Args { return args }, &dbStart)
	if err != nil {
		// The offer may or may not exist: keep the token as for a
		// taken one, but let the lane offer again.
		d.offers.mu.Lock()
		d.retire(o, time.Now())
		l.offered.Store(false)
		d.offers.mu.Unlock()
		if !timeout.Stopping(bctx) {
			// Counted and logged at warn (throttled): a role without
			// INSERT on bellhop_offers turns LeaseAtInsert off, and
			// nothing else would show it. Outside the book's lock: the
			// Observer may read LeaseStats, and a log write may block.
			d.failed(OpOffer)
			ev := d.log.Debug()
			if ok, held := d.offerFailLog.Allow(); ok {
				ev = d.log.Warn().Int("held_back", held)
			}
			ev.Err(timeout.Explain(bctx, err)).Str("app_id", l.target.AppID.String()).Str("queue", l.target.Queue).
				Msg("could not make an offer (leasing at INSERT); the queue is claimed after notifications as usual (logged at warn at most once a minute; held_back counts the failures not logged)")
		}
		return
	}
	d.offers.mu.Lock()
	defer d.offers.mu.Unlock()
	// Counted only now: a failed INSERT (a database outage) made no
	// offer that the count could show.
	d.offers.stats.Offers++
	o.bound, o.boundKnown = boundOf(sent, dbStart), true
}

// clockBound is one reading of the two clocks by timedRow: at, ours
// (monotonic reading included), and ahead, the database's
// statement_timestamp() less at, which bounds how far the database's
// clock is ahead of ours.
type clockBound struct {
	at    time.Time
	ahead time.Duration
}

func boundOf(sent, dbStart time.Time) clockBound {
	return clockBound{at: sent, ahead: dbStart.Sub(sent)}
}

// local turns a time on the database's clock into ours, no later than it
// was by ours: at plus the time the database's clock counted from its
// reading at at. The result carries at's monotonic reading, so that a
// deadline measured from it (time.Until) runs on the monotonic clock, as
// a claim's does: computed on wall clocks alone (dbTime less ahead), a
// step of this machine's clock back, between the reading and the
// deadline, moved the deadline past the lease's end by the step.
func (b clockBound) local(dbTime time.Time) time.Time {
	return b.at.Add(dbTime.Sub(b.at.Round(0)) - b.ahead)
}

// timedRow runs one statement on a connection of the pool and returns our
// clock's reading just before the statement was sent, once the connection
// was ours; args is called then too. The database's clock read at the
// statement's start (statement_timestamp(), which the server sets as it
// takes the statement's Execute message, or its Query message in the
// simple protocol) is later than that reading, so their difference bounds
// how far the database's clock is ahead of ours; the wait for a busy
// pool's connection and the statement's own run time stay out of the
// bound. With them in it, a lease after a slow poll was dated up to the
// poll's length early: never late, but its handler's deadline came that
// much early, and a poll as slow as the lease less its margin had leased
// messages released unstarted. The statement's arguments carry offer
// tokens, and may carry the lease channel: they go hidden.
func (d *Dispatcher) timedRow(ctx context.Context, sql string, args func() queries.Args, dest ...any) (sent time.Time, err error) {
	err = d.db.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
		sent = time.Now()
		return c.QueryRow(ctx, sql, d.hidden(args())...).Scan(dest...)
	})
	return sent, err
}

// hidden returns the arguments of a statement that carries the lease
// channel or offer tokens, with what keeps them out of the statement's
// text; call it once the statement's connection is acquired. Under
// default_query_exec_mode=simple_protocol pgx writes arguments into the
// text, which pg_stat_activity shows to monitoring roles for as long as
// the connection's next statement has not replaced it: the channel and a
// live token there let such a role read leased payloads and send a
// forged lease (docs/lease-at-insert.md). A leasing dispatcher's such
// statements then go in exec mode, which sends arguments as parameters
// on an unnamed statement and, like simple_protocol, keeps no prepared
// statement on the server. It needs a session of its own anyway (LISTEN,
// advisory keys), a direct or session-pooled connection, where exec mode
// works as well as simple_protocol.
func (d *Dispatcher) hidden(args queries.Args) []any {
	if d.cfg.LeaseAtInsert && d.simpleProtocol.Load() {
		return []any{pgx.QueryExecModeExec, args}
	}
	return []any{args}
}

// wantsOffer reports whether the lane should have a token on offer: it is
// an enabled queue lane with a free slot, not draining a busy queue, not
// settling, not watching another dispatcher's mark. Lane goroutine only.
func (l *lane) wantsOffer() bool {
	if !l.d.cfg.LeaseAtInsert || l.target.Source != claim.Queue || l.offered.Load() ||
		l.busy || l.settle || l.watching {
		return false
	}
	st := l.state.Load()
	return st.Enabled && int(l.inFlight.Load()) < st.MaxInFlight
}

// withdraw takes the lane's offers back (a paused consumer). An offer a
// producer is taking cannot be withdrawn; its lease is released when it
// arrives.
func (l *lane) withdraw(ctx context.Context) {
	if !l.offered.Swap(false) {
		return
	}
	d := l.d
	var mine []uuid.UUID
	d.offers.mu.Lock()
	for t, o := range d.offers.byToken {
		if o.lane == l && o.live {
			mine = append(mine, t)
			d.retire(o, time.Now())
		}
	}
	d.offers.mu.Unlock()
	if len(mine) == 0 {
		// Retired meanwhile (the poll found it taken or gone): nothing
		// to delete, and dropOffers(nil) would delete every offer of
		// the dispatcher.
		return
	}
	bctx, cancel := d.bound(ctx)
	d.dropOffers(bctx, mine)
	cancel()
}

// dropOffers deletes the given offers of ours, or all of them (nil), and
// forgets the tokens it deleted: nobody can lease under those any more.
func (d *Dispatcher) dropOffers(ctx context.Context, tokens []uuid.UUID) {
	var arg any
	if tokens != nil {
		arg = queries.UUIDs(tokens)
	}
	var gone []uuid.UUID
	err := d.db.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
		rows, err := c.Query(ctx, queries.OfferDrop, d.hidden(queries.Args{"owner": d.owner, "tokens": arg})...)
		if err == nil {
			gone, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		}
		return err
	})
	if err != nil {
		d.log.Debug().Err(timeout.Explain(ctx, err)).Msg("could not withdraw offers; they expire")
		return
	}
	d.offers.mu.Lock()
	for _, t := range gone {
		delete(d.offers.byToken, t)
	}
	d.offers.mu.Unlock()
}

// dropAllOffers deletes every offer of ours at a clean stop, waiting for
// a producer that has one locked to commit or roll back (at most 2s:
// offer_drop_all_wait.sql), so that offer_recover.sql, run next, sees its
// lease. If the wait runs out (a producer that fired the trigger early
// with SET CONSTRAINTS ... IMMEDIATE and keeps its transaction open), it
// drops the others, skipping the locked ones, as before. It reports
// whether it deleted every offer of ours.
func (d *Dispatcher) dropAllOffers(ctx context.Context) (all bool) {
	var gone []uuid.UUID
	err := pgx.BeginFunc(ctx, d.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, queries.OfferDropAllWait); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, queries.OfferDropAll, queries.Args{"owner": d.owner})
		if err != nil {
			return err
		}
		gone, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		return err
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			// The wait ran out: a producer still holds one.
			d.log.Warn().Err(err).Msg("a producer held one of our offers through the stop's wait; " +
				"withdrawing the others: a lease it commits after the stop's lookup runs out, its attempt spent")
		} else {
			d.log.Warn().Err(timeout.Explain(ctx, err)).Msg("could not withdraw our offers at the stop; " +
				"trying once more without waiting for producers (those left expire, and no producer " +
				"takes one once our listener's session has ended)")
		}
		d.dropOffers(ctx, nil)
		return false
	}
	d.offers.mu.Lock()
	for _, t := range gone {
		delete(d.offers.byToken, t)
	}
	d.offers.mu.Unlock()
	return true
}

// onLease routes a lease notification. It runs on the listener's
// goroutine, so it only hands the message on.
func (d *Dispatcher) onLease(ls notify.Lease) {
	o, leasedAt := d.useToken(ls.Token, ls.ClaimedAt, false)
	if o == nil {
		// A token we never issued, or one recovered already: the claim
		// token fences it either way.
		d.log.Debug().Str("message_id", ls.ID.String()).Int("attempt", ls.Attempt).Msg("ignoring a lease under a token not on offer")
		return
	}
	o.lane.leased(&claim.Message{
		Source: claim.Queue, ID: ls.ID, Token: ls.Token, Payload: ls.Payload, EnqueuedAt: ls.EnqueuedAt,
		Attempt: ls.Attempt, MaxAttempts: ls.MaxAttempts, EnqueuedBy: ls.EnqueuedBy,
		LeasedAt: leasedAt, VisibilityTimeout: ls.VisibilityTimeout,
	})
}

// useToken takes token out of the book, once: it returns nil if the token
// is not there (never issued, or used already) or the dispatcher has
// stopped, and otherwise the offer and when the lease under it began by
// our clock (leasedAt, for its claimed_at). A lane whose live offer it was
// may offer again; it does so once the handler has started (deliver),
// since offering now would compete with the delivery, and with the
// producer's commit, for the machine's CPUs.
func (d *Dispatcher) useToken(token uuid.UUID, claimedAt time.Time, recovered bool) (*offer, time.Time) {
	d.offers.mu.Lock()
	defer d.offers.mu.Unlock()
	o := d.offers.byToken[token]
	if o == nil || d.offers.closed {
		return nil, time.Time{}
	}
	delete(d.offers.byToken, token)
	if recovered {
		d.offers.stats.Recovered++
	} else {
		d.offers.stats.Leased++
	}
	if o.live {
		o.lane.offered.Store(false)
	}
	return o, o.leasedAt(claimedAt)
}

// leasedAt turns a lease's claimed_at, on the database's clock, into ours:
// never later than the lease really began, so that a lease measured from
// it ends no later than the reclaimer thinks it does. The lease began
// after the offer was sent; and claimed_at minus the most the database's
// clock can be ahead of ours is earlier still than the lease's start.
// offerBook.mu must be held: makeOffer and afterPoll write bound.
func (o *offer) leasedAt(claimedAt time.Time) time.Time {
	if !o.boundKnown {
		return o.sentAt
	}
	return latest(o.sentAt, o.bound.local(claimedAt))
}

func latest(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// leased delivers a message a producer leased to this lane, as soon as a
// slot is free. Until then it waits and its lease runs, but no longer than
// a delivery could still start (deliver's limit): then it is released,
// its attempt refunded. Left waiting, the lease ran out and the reclaimer
// took it, spending the attempt undelivered, and dead-lettering the
// message if that was its last.
func (l *lane) leased(cm *claim.Message) {
	st := l.state.Load()
	if !st.Enabled || l.ctx.Err() != nil {
		l.d.releaseLeased(cm, l.target)
		return
	}
	vt := leaseTimeout(st, cm)
	if end := cm.LeasedAt.Add(vt); time.Now().Before(end) {
		l.d.reclaim.Observe(end)
	} // else deliver releases it at once, and the reclaimer need not race it
	l.d.fired(st.ID)
	l.pendMu.Lock()
	l.pending = append(l.pending, cm)
	l.pendMu.Unlock()
	l.startPending()
	l.pendMu.Lock()
	waits := slices.Contains(l.pending, cm)
	l.pendMu.Unlock()
	if waits {
		time.AfterFunc(time.Until(startBy(cm, vt)), func() {
			if l.unpend(cm) {
				l.d.releaseLeased(cm, l.target)
			}
		})
	}
}

// unpend takes cm off the waiting leased messages, and reports whether it
// was still there (not started, released or taken by another unpend).
func (l *lane) unpend(cm *claim.Message) bool {
	l.pendMu.Lock()
	defer l.pendMu.Unlock()
	i := slices.Index(l.pending, cm)
	if i < 0 {
		return false
	}
	l.pending = slices.Delete(l.pending, i, i+1)
	return true
}

// releasePending releases every waiting leased message: the lane's
// consumer was paused, and nothing may start on it.
func (l *lane) releasePending() {
	l.pendMu.Lock()
	waiting := l.pending
	l.pending = nil
	l.pendMu.Unlock()
	for _, cm := range waiting {
		l.d.releaseLeased(cm, l.target)
	}
}

// startPending starts waiting leased messages while slots are free, and
// releases them if the lane's consumer was paused meanwhile: a paused
// consumer starts nothing, as a claim would not.
func (l *lane) startPending() {
	l.pendMu.Lock()
	defer l.pendMu.Unlock()
	for len(l.pending) > 0 {
		st := l.state.Load()
		if !st.Enabled || l.ctx.Err() != nil {
			// Stopped too: released without taking a slot, which a
			// stopped lane's heir may be holding (freeSlots).
			cm := l.pending[0]
			l.pending = l.pending[1:]
			l.d.releaseLeased(cm, l.target)
			continue
		}
		if !l.acquire(st.MaxInFlight) {
			return
		}
		cm := l.pending[0]
		l.pending = l.pending[1:]
		// stop cancels ctx under runMu before the dispatcher waits for
		// deliveries, so none starts after that wait began.
		l.runMu.Lock()
		stopped := l.ctx.Err() != nil
		if !stopped {
			l.d.inFlight.Add(1)
		}
		l.runMu.Unlock()
		if stopped {
			l.unslot(1)
			l.d.releaseLeased(cm, l.target)
			continue
		}
		l.delivering.Add(1)
		go l.deliver(st, cm)
	}
}

// acquire takes one slot if fewer than max are taken.
func (l *lane) acquire(max int) bool {
	for {
		n := l.inFlight.Load()
		if int(n) >= max {
			return false
		}
		if l.inFlight.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// reserve takes every free slot of max at once, for a claim pass, and
// returns how many it took.
func (l *lane) reserve(max int) int {
	for {
		n := l.inFlight.Load()
		if int(n) >= max {
			return 0
		}
		if l.inFlight.CompareAndSwap(n, int32(max)) {
			return max - int(n)
		}
	}
}

// freeSlots gives back n slots and starts waiting leased messages. The
// slots are the sibling lane's too: it starts its own waiting messages,
// offers again, and claims if it stopped for want of a slot, which
// freeSlots reports.
func (l *lane) freeSlots(n int) (siblingWoken bool) {
	if n > 0 {
		l.unslot(n)
	}
	l.startPending()
	if n <= 0 {
		return false
	}
	if s := l.sibling; s != nil {
		siblingWoken = s.slotFreed()
	}
	// A lane stopped by its consumer's move hands the slots on to the
	// consumer's new lanes, which share its count, and to theirs, should
	// the consumer have moved again since.
	for h := l.heir.Load(); h != nil; h = h.queue.heir.Load() {
		h.queue.slotFreed()
		h.invoke.slotFreed()
	}
	return siblingWoken
}

// unslot takes n slots off the count. A stopped lane whose consumer is
// served here by no lane now, as the last of them is given back, has the
// dispatcher forget its lanes (Dispatcher.holding): nothing holds a slot
// of that count any more.
func (l *lane) unslot(n int) {
	if l.inFlight.Add(-int32(n)) == 0 && l.ctx.Err() != nil {
		l.d.slotsDrained(l)
	}
}

// slotFreed tells l that another lane freed one of its slots: it starts
// its waiting messages, offers again, and claims if it stopped for want
// of a slot, which it reports.
func (l *lane) slotFreed() bool {
	l.startPending()
	l.reoffer()
	if l.backlog.Swap(false) {
		l.poke()
		return true
	}
	return false
}

// releaseLeased gives back a leased message this dispatcher will not
// deliver (its lane stopped or is paused): the attempt is refunded and the
// queue woken, as for any release. Once the dispatcher has stopped, the
// lease runs out instead.
func (d *Dispatcher) releaseLeased(cm *claim.Message, t claim.Target) {
	d.offers.closing.RLock()
	d.offers.mu.Lock()
	closed := d.offers.closed
	d.offers.mu.Unlock()
	if closed {
		d.offers.closing.RUnlock()
		return
	}
	o := claim.Outcome{Message: cm, Verdict: claim.Release, Done: func(_ bool, err error) {
		// Not when a retry found it released, or reclaimed.
		if errors.Is(err, claim.ErrWriteFailed) {
			d.log.Warn().Err(err).Str("app_id", t.AppID.String()).Str("queue", t.Queue).
				Str("message_id", cm.ID.String()).Int("attempt", cm.Attempt).
				Msg("could not release a leased message; it comes back after its lease")
		}
	}}
	if d.complete.TrySubmit(o) {
		d.offers.closing.RUnlock()
		return
	}
	// The Completer's queue is full (its writes slow, or retried while
	// the database is away). A lease heard for a paused or stopped lane
	// is released on the listener's goroutine, which waiting here held up
	// every notification; the wait goes on in a goroutine instead, still
	// holding closing, so that closeOffers waits for the submit as before.
	go func() {
		defer d.offers.closing.RUnlock()
		d.complete.Submit(o)
	}()
}

// retire marks o as no longer on offer, as of now. Its token stays in the
// book until any lease made under it has run out: the offer, if it is
// still in the table, expires within the TTL, and a lease made before that
// runs out within the visibility timeout after it. Until then a lease
// under it, heard of or found, is delivered; after, it is the reclaimer's.
// A shorter wait (the TTL alone, as the offer's INSERT error and withdraw
// once had) left such a lease to wait for its visibility timeout when its
// notification came after the token was forgotten (model/OFFERS.md,
// finding A).
func (d *Dispatcher) retire(o *offer, now time.Time) {
	o.live, o.forget = false, now.Add(d.offerTTL()+o.lane.state.Load().VisibilityTimeout)
}

// offerTokens returns the tokens of ours that should stay on offer (their
// lane runs), and those we have not heard of since they left the offer.
// On the way it retires the offers of stopped lanes and forgets tokens
// whose time is up.
func (d *Dispatcher) offerTokens(now time.Time) (live, unheard []uuid.UUID) {
	d.offers.mu.Lock()
	defer d.offers.mu.Unlock()
	for t, o := range d.offers.byToken {
		if o.live && o.lane.ctx.Err() != nil {
			// Its lane stopped (the consumer was removed): the poll
			// deletes the offer unless a producer is taking it.
			d.retire(o, now)
		}
		switch {
		case o.live:
			live = append(live, t)
		case now.After(o.forget):
			// Whoever took it never committed, or its lease was
			// reclaimed: nothing more can come of it.
			delete(d.offers.byToken, t)
		default:
			unheard = append(unheard, t)
		}
	}
	return live, unheard
}

// afterPoll learns from the poll which of the offers it extended are still
// on offer. The others were taken (their lease may be on its way, or was
// lost) or lost with the UNLOGGED table: their lanes offer again, and the
// leases are looked for; not those made after listed, when the poll's
// tokens were listed. bound, the poll's reading of the two clocks
// (timedRow), bounds again how far the database's clock is ahead of ours,
// for the offers still out.
func (d *Dispatcher) afterPoll(ctx context.Context, listed time.Time, bound clockBound, asked, stillLive []uuid.UUID) {
	on := make(map[uuid.UUID]bool, len(stillLive))
	for _, t := range stillLive {
		on[t] = true
	}
	var gone []uuid.UUID
	d.offers.mu.Lock()
	for _, t := range asked {
		o := d.offers.byToken[t]
		if o != nil && on[t] {
			o.bound, o.boundKnown = bound, true
		}
		if o == nil || on[t] || !o.live || o.sentAt.After(listed) {
			continue
		}
		d.retire(o, time.Now())
		o.lane.offered.Store(false)
		o.lane.offerPoke()
		gone = append(gone, t)
	}
	d.offers.mu.Unlock()
	if len(gone) > 0 {
		d.recoverLeases(ctx, gone)
	}
}

// recoverLeases finds the messages leased under the given tokens whose
// notifications we have not heard (lost, or still on their way), and
// delivers them like leases heard of.
func (d *Dispatcher) recoverLeases(ctx context.Context, tokens []uuid.UUID) {
	fs, err := d.findLeases(ctx, tokens)
	if err != nil {
		if !timeout.Stopping(ctx) {
			d.log.Warn().Err(timeout.Explain(ctx, err)).Int("tokens", len(tokens)).
				Msg("could not look for leases whose notification we have not heard; they come back after their lease")
		}
		return
	}
	d.takeLeases(fs)
}

// foundLease is a message leased under one of our tokens, as
// offer_recover.sql found it.
type foundLease struct {
	m         claim.Message
	claimedAt time.Time
}

// findLeases looks up the messages leased under tokens (offer_recover.sql),
// each measured by the visibility timeout of the consumer whose offer it
// was: a token no longer in the book (its notification came meanwhile) is
// looked up with no consumer, and takeLeases skips it.
func (d *Dispatcher) findLeases(ctx context.Context, tokens []uuid.UUID) ([]foundLease, error) {
	if len(tokens) == 0 {
		return nil, nil
	}
	consumers := make([]uuid.UUID, len(tokens))
	d.offers.mu.Lock()
	for i, t := range tokens {
		if o := d.offers.byToken[t]; o != nil {
			consumers[i] = o.lane.target.TriggerID
		}
	}
	d.offers.mu.Unlock()
	var fs []foundLease
	what := "look up leases by token"
	err := d.db.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
		rows, err := c.Query(ctx, queries.OfferRecover, d.hidden(queries.Args{"tokens": queries.UUIDs(tokens), "consumers": queries.UUIDs(consumers)})...)
		if err != nil {
			return err
		}
		defer rows.Close()
		what = "read leases found by token"
		for rows.Next() {
			var f foundLease
			var vtSecs *int32
			if err := rows.Scan(&f.m.ID, &f.m.Payload, &f.m.EnqueuedAt, &f.m.Token, &f.m.Attempt, &f.m.MaxAttempts,
				&f.m.EnqueuedBy, &f.claimedAt, &vtSecs); err != nil {
				return err
			}
			if vtSecs != nil {
				f.m.VisibilityTimeout = time.Duration(*vtSecs) * time.Second
			}
			fs = append(fs, f)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return fs, nil
}

// takeLeases delivers the leases findLeases found whose tokens are still
// in the book; a lane that has stopped releases them (leased).
func (d *Dispatcher) takeLeases(fs []foundLease) {
	for i := range fs {
		f := &fs[i]
		o, leasedAt := d.useToken(f.m.Token, f.claimedAt, true)
		if o == nil {
			continue // its notification came meanwhile
		}
		f.m.Source = claim.Queue
		f.m.LeasedAt = leasedAt
		if f.m.VisibilityTimeout == 0 {
			// The queue has no consumer now: nothing measures the lease.
			d.releaseLeased(&f.m, o.lane.target)
			continue
		}
		d.log.Info().Str("app_id", o.lane.target.AppID.String()).Str("queue", o.lane.target.Queue).
			Str("message_id", f.m.ID.String()).Int("attempt", f.m.Attempt).
			Msg("found by its token a message leased to us whose notification we had not heard")
		o.lane.leased(&f.m)
	}
}

// closeOffers ends leasing at INSERT when the dispatcher stops: it deletes
// our offers, waiting for a producer taking one (dropAllOffers), releases
// the messages leased under tokens we have not heard of, and ignores
// leases from then on (with our listener gone, producers make none).
// It runs after the last delivery finished and before the completer
// closes. ctx is the stop's budget for all of it; if the lookup fails
// (the budget ran out, the database is away), a lease under a token we
// have not heard of is not released: it runs out, its attempt spent, and
// the warning says how many tokens that may concern.
func (d *Dispatcher) closeOffers(ctx context.Context) {
	if !d.cfg.LeaseAtInsert {
		return
	}
	if errors.Is(context.Cause(ctx), errBoundPassed) {
		// Nothing is sent, and the one warning says what that leaves: a
		// release would not be written anyway, since the outcomes were
		// given up at the bound (Completer.Abandon), and a failed
		// statement's warning would say only "context canceled".
		d.offers.mu.Lock()
		n := len(d.offers.byToken)
		d.offers.mu.Unlock()
		d.log.Warn().Err(errBoundPassed).Int("tokens", n).
			Msg("not withdrawing our offers at the stop (they expire, and no producer takes one once our listener's session " +
				"has ended), nor looking for leases under our tokens: a message leased under one stays leased until its lease " +
				"runs out, its attempt spent, and is then reclaimed")
		d.closeBook()
		return
	}
	// The tokens left in the book are not only offers not withdrawn: a
	// taken offer's token stays until its notification is heard, and
	// the listener has stopped. Whether any offer may still be out is
	// what dropAllOffers knows.
	withdrawn := d.dropAllOffers(ctx)
	var tokens []uuid.UUID
	d.offers.mu.Lock()
	for t := range d.offers.byToken {
		tokens = append(tokens, t)
	}
	d.offers.mu.Unlock()
	fs, err := d.findLeases(ctx, tokens)
	if err != nil {
		// Whatever ended ctx, the stop is the caller: the log line is
		// the only sign that leases may be held past it.
		d.log.Warn().Err(timeout.Explain(ctx, err)).Int("tokens", len(tokens)).Bool("offers_withdrawn", withdrawn).
			Msg("could not look for leases under our tokens at the stop; a message leased under one " +
				"stays leased until its lease runs out, its attempt spent, and is then reclaimed")
	} else {
		d.takeLeases(fs) // every lane has stopped: leased releases them
	}
	d.closeBook()
}

// closeBook ends leasing: a lease heard from now on is ignored, and runs
// out: the completer closes after this, and a release submitted then
// would panic.
func (d *Dispatcher) closeBook() {
	d.offers.closing.Lock()
	d.offers.mu.Lock()
	d.offers.closed = true
	d.offers.mu.Unlock()
	d.offers.closing.Unlock()
}

// LeaseStats returns the counters of leasing at INSERT.
func (d *Dispatcher) LeaseStats() LeaseStats {
	d.offers.mu.Lock()
	defer d.offers.mu.Unlock()
	return d.offers.stats
}
