package bellhop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/internal/timeout"
	"github.com/bellhopq/bellhop/notify"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestRetiredTokenOutlivesItsLease checks the rule found by the model of
// offers (model/OFFERS.md, finding A): a token that leaves the offer stays
// in the book, and its leases are still looked for, until any lease made
// under it has run out: the offer's TTL plus the visibility timeout, on
// every path that retires a token. Each case fails if its path keeps the
// token for the TTL alone.
func TestRetiredTokenOutlivesItsLease(t *testing.T) {
	const (
		poll = time.Minute
		vt   = 30 * time.Second
		ttl  = 3 * poll // offerTTL
	)
	// LeaseAtInsert off: the lane that afterPoll pokes makes no offer of
	// its own. The pool refuses every connection, so the lookups by token
	// fail (and are logged) at once.
	newBook := func(t *testing.T) (*Dispatcher, *lane) {
		return testBook(t, DispatcherConfig{PollInterval: poll}, closedPool(t), vt)
	}
	// bookAt reports whether token is still in the book at now, and as
	// what: live, or unheard (looked for by the poll).
	bookAt := func(d *Dispatcher, token uuid.UUID, now time.Time) (live, unheard bool) {
		l, u := d.offerTokens(now)
		for _, x := range l {
			live = live || x == token
		}
		for _, x := range u {
			unheard = unheard || x == token
		}
		return live, unheard
	}

	tests := []struct {
		name   string
		retire func(t *testing.T, d *Dispatcher, l *lane) (uuid.UUID, time.Time)
	}{
		{"the poll found it gone (afterPoll)", func(t *testing.T, d *Dispatcher, l *lane) (uuid.UUID, time.Time) {
			token := uuid.New()
			d.offers.byToken[token] = &offer{lane: l, live: true, sentAt: time.Now().Add(-time.Second)}
			at := time.Now()
			d.afterPoll(context.Background(), at, clockBound{at: at, ahead: time.Millisecond}, []uuid.UUID{token}, nil)
			return token, at
		}},
		{"its lane stopped (offerTokens)", func(t *testing.T, d *Dispatcher, l *lane) (uuid.UUID, time.Time) {
			token := uuid.New()
			stopped, cancel := context.WithCancel(context.Background())
			cancel()
			l.ctx = stopped
			d.offers.byToken[token] = &offer{lane: l, live: true}
			at := time.Now()
			if live, unheard := bookAt(d, token, at); live || !unheard {
				t.Fatalf("after its lane stopped: live %v, unheard %v; want an unheard token", live, unheard)
			}
			return token, at
		}},
		{"its consumer was paused (withdraw)", func(t *testing.T, d *Dispatcher, l *lane) (uuid.UUID, time.Time) {
			token := uuid.New()
			d.offers.byToken[token] = &offer{lane: l, live: true}
			l.offered.Store(true)
			at := time.Now()
			l.withdraw(context.Background()) // its DELETE fails: the token stays
			return token, at
		}},
		{"its INSERT failed (makeOffer)", func(t *testing.T, d *Dispatcher, l *lane) (uuid.UUID, time.Time) {
			before := time.Now()
			l.makeOffer(context.Background())
			if len(d.offers.byToken) != 1 {
				t.Fatalf("book holds %d tokens after a failed offer; want 1", len(d.offers.byToken))
			}
			if l.offered.Load() {
				t.Fatal("the lane still counts its failed offer as out; it would never offer again")
			}
			var token uuid.UUID
			for tk := range d.offers.byToken {
				token = tk
			}
			return token, before
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, l := newBook(t)
			token, at := tc.retire(t, d, l)
			// A lease made just before the offer expired (at+ttl) still
			// holds until at+ttl+vt: the token must still be looked for.
			if live, unheard := bookAt(d, token, at.Add(ttl+vt/2)); live || !unheard {
				t.Fatalf("TTL + VT/2 after it left the offer: live %v, unheard %v; want unheard (a lease under it may still hold)",
					live, unheard)
			}
			if live, unheard := bookAt(d, token, at.Add(ttl+vt+5*time.Second)); live || unheard {
				t.Fatalf("after TTL + VT: live %v, unheard %v; want it forgotten", live, unheard)
			}
			if _, ok := d.offers.byToken[token]; ok {
				t.Fatal("a forgotten token is still in the book")
			}
		})
	}
}

// TestPollRenewsClockBound checks that a poll that finds an offer still
// out bounds the database clock's lead again: a lease under an offer made
// long ago must not be measured with the lead of that day, or a database
// clock that has since drifted ahead makes the lease look younger than
// the reclaimer thinks it is (two consumers at once). Found by review of
// the model of offers (model/OFFERS.md).
func TestPollRenewsClockBound(t *testing.T) {
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute}, closedPool(t), 30*time.Second)

	made := time.Now().Add(-48 * time.Hour)
	token := uuid.New()
	// When the offer was made, the two clocks agreed.
	d.offers.byToken[token] = &offer{lane: l, live: true, sentAt: made, bound: clockBound{at: made}, boundKnown: true}
	// Now the database's clock is 10 s ahead of ours.
	const lead = 10 * time.Second
	d.afterPoll(context.Background(), time.Now(), clockBound{at: time.Now(), ahead: lead + time.Millisecond}, []uuid.UUID{token}, []uuid.UUID{token})

	claimedAt := time.Now().Add(lead) // the producer's clock_timestamp(), on the database's clock
	o, leasedAt := d.useToken(token, claimedAt, false)
	if o == nil {
		t.Fatal("the token left the book, though the poll found it still on offer")
	}
	if want := claimedAt.Add(-lead); leasedAt.After(want) {
		t.Fatalf("lease measured from %v after its start by our clock; want no later than it began",
			leasedAt.Sub(want))
	}
}

// TestLeaseAtInsertOnMonotonicClock: a lease made at INSERT is dated on
// our monotonic clock, as a claim is (its LeasedAt is a time.Now()), so
// that the handler's deadline, time.Until a time after it, is too. Dated
// from the database's claimed_at on wall clocks alone, a step of this
// machine's clock back by more than the lease's margin, after the clock
// bound was read, let the handler run past the lease's end, while the
// reclaimer handed the message on (a review's finding). A test cannot
// step the clock: it checks that the time carries a monotonic reading
// (which time.Time's String shows as "m=") and that it is the lease's
// start by the bound.
func TestLeaseAtInsertOnMonotonicClock(t *testing.T) {
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute}, closedPool(t), 30*time.Second)
	sent := time.Now().Add(-time.Second)
	const lead = 3 * time.Second // the database's clock ahead of ours, as the offer read it
	token := uuid.New()
	d.offers.byToken[token] = &offer{lane: l, live: true, sentAt: sent, bound: clockBound{at: sent, ahead: lead}, boundKnown: true}
	// The lease, 800 ms after the offer by the database's clock, which
	// pgx reads with no monotonic reading.
	claimedAt := sent.Round(0).Add(lead + 800*time.Millisecond)
	_, leasedAt := d.useToken(token, claimedAt, false)
	if !strings.Contains(leasedAt.String(), " m=") || leasedAt.Sub(sent) != 800*time.Millisecond {
		t.Errorf("lease dated %s, %s after the offer; want a time with a monotonic reading, 800ms after it", leasedAt, leasedAt.Sub(sent))
	}
}

// slowOffers makes every offer's INSERT take at least wait longer, with a
// trigger in the test's own database.
func slowOffers(t *testing.T, pool *pgxpool.Pool, wait time.Duration) {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		fmt.Sprintf(`CREATE FUNCTION test_slow_offer() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN PERFORM pg_sleep(%f); RETURN NEW; END $$`, wait.Seconds()),
		`CREATE TRIGGER test_slow_offer BEFORE INSERT ON bellhop_offers FOR EACH ROW EXECUTE FUNCTION test_slow_offer()`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
}

// holdPool takes every connection pool may open, waiting for those in
// use, and returns a function that gives them back.
func holdPool(t *testing.T, pool *pgxpool.Pool) (release func()) {
	t.Helper()
	var held []*pgxpool.Conn
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	return func() {
		for _, c := range held {
			c.Release()
		}
	}
}

// clockBoundOK checks a bound on how far the database's clock is ahead of
// ours against the true lead, which one round trip brackets: the bound
// must be at least the least the lead can be (a smaller one dates leases
// after they began), and above the most it can be by well under wait, the
// slowdown the bounded statement met.
func clockBoundOK(t *testing.T, pool *pgxpool.Pool, ahead, wait time.Duration) {
	t.Helper()
	before := time.Now()
	var db time.Time
	if err := pool.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	least, most := db.Sub(after), db.Sub(before)
	t.Logf("bound %v; the database's clock is ahead by %v to %v", ahead, least, most)
	if ahead < least {
		t.Errorf("bound on the database clock's lead %v is below the lead, at least %v: leases would be dated late", ahead, least)
	}
	if ahead-most >= wait/2 {
		t.Errorf("bound on the database clock's lead %v, %v above the lead, with the statement slowed by %v; the slowdown was counted in it",
			ahead, ahead-most, wait)
	}
}

// TestOfferClockBoundExcludesWaits: the bound an offer's own statement
// sets on the database clock's lead (offer.bound) leaves out a wait for a
// pool connection and the statement's run time. With them in it, leases
// made under the offer were dated that much early, their handlers' time
// cut short by as much (3c of the forty-ninth session's review). Both
// cases fail with the bound taken from before the acquire to the end of
// the statement.
func TestOfferClockBoundExcludesWaits(t *testing.T) {
	const wait = 400 * time.Millisecond
	tests := []struct {
		name string
		// slow runs before the offer, during the ends it once the offer
		// is under way.
		slow func(t *testing.T, pool *pgxpool.Pool) (during func())
	}{
		{"its statement ran slowly", func(t *testing.T, pool *pgxpool.Pool) func() {
			slowOffers(t, pool, wait)
			return func() {}
		}},
		{"it waited for a connection", func(t *testing.T, pool *pgxpool.Pool) func() {
			release := holdPool(t, pool)
			return func() {
				time.Sleep(wait) // the wait being measured, not a synchronisation
				release()
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
			d.owner, d.leaseChannel = uuid.New(), newLeaseChannel()
			during := tc.slow(t, pool)

			start := time.Now()
			done := make(chan time.Duration)
			go func() {
				l.makeOffer(ctx)
				done <- time.Since(start)
			}()
			eventually(t, "the offer's token in the book", func() bool {
				d.offers.mu.Lock()
				defer d.offers.mu.Unlock()
				return len(d.offers.byToken) == 1
			})
			during()
			if took := <-done; took < wait {
				t.Fatalf("the offer took %v, less than the slowdown of %v: the test slowed nothing", took, wait)
			}
			d.offers.mu.Lock()
			defer d.offers.mu.Unlock()
			for _, o := range d.offers.byToken {
				if !o.live || !o.boundKnown {
					t.Fatalf("offer live %v, its clock bound known %v; want a made offer", o.live, o.boundKnown)
				}
				clockBoundOK(t, pool, o.bound.ahead, wait)
			}
		})
	}
}

// TestPollClockBoundExcludesWaits: the bound a fallback poll renews on the
// database clock's lead, for the offers still out, leaves out a wait for
// a pool connection and the poll's run time; with them, a slow poll (a
// busy pool, thousands of consumers to probe) dated the next leases up to
// its length early, and a poll as slow as the lease less its margin had
// leased messages released unstarted. Both cases fail with the bound
// taken from before the acquire to the end of the statement.
func TestPollClockBoundExcludesWaits(t *testing.T) {
	const wait = 600 * time.Millisecond
	tests := []struct {
		name string
		// before runs before the dispatcher starts; during once it has an
		// offer out, and returns when the next poll is slowed.
		before func(t *testing.T, pool *pgxpool.Pool)
		during func(t *testing.T, d *Dispatcher, mark func())
	}{
		{"the poll ran slowly", func(t *testing.T, pool *pgxpool.Pool) {
			// The poll's own SELECT list calls bellhop_next_lease_expiry
			// (its writes, in WITH, run after that list): the test's
			// database gets a slow one.
			for _, q := range []string{
				`ALTER FUNCTION bellhop_next_lease_expiry(int) RENAME TO test_next_lease_expiry`,
				fmt.Sprintf(`CREATE FUNCTION bellhop_next_lease_expiry(vt int) RETURNS timestamptz LANGUAGE plpgsql AS $$
					BEGIN PERFORM pg_sleep(%f); RETURN test_next_lease_expiry(vt); END $$`, wait.Seconds()),
			} {
				if _, err := pool.Exec(context.Background(), q); err != nil {
					t.Fatal(err)
				}
			}
		}, func(t *testing.T, d *Dispatcher, mark func()) { mark() }},
		{"the poll waited for a connection", func(*testing.T, *pgxpool.Pool) {}, func(t *testing.T, d *Dispatcher, mark func()) {
			// A poll that held a connection has sent its statement
			// before every connection is ours; the next one (every
			// 100 ms) waits. The bound is marked again before the
			// connections are given back, since a poll that did not wait
			// may write its bound after its connection went back.
			release := holdPool(t, d.db)
			mark()
			time.Sleep(wait) // the wait being measured, not a synchronisation
			mark()
			release()
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, client, _ := reloadSetup(t, ConsumerSpec{Queue: "a", MaxInFlight: 1})
			cfg.MaxConns = 4
			tc.before(t, client.db)
			d, err := NewDispatcher(cfg, DispatcherConfig{
				Resolver: resolverFunc(func(Consumer) Handler {
					return HandlerFunc(func(context.Context, *Message) error { return nil })
				}),
				PollInterval: 100 * time.Millisecond, LeaseAtInsert: true, Logger: zerolog.Nop(),
			})
			if err != nil {
				t.Fatal(err)
			}
			runUntilCleanup(t, d, nil)
			// A lane offers after a pass: one message makes it run.
			if _, err := client.Enqueue(context.Background(), "app", "a", []byte(`{}`), EnqueueOptions{}); err != nil {
				t.Fatal(err)
			}
			// The one offer out, once its own statement bounded the lead.
			var o *offer
			eventually(t, "an offer out", func() bool {
				d.offers.mu.Lock()
				defer d.offers.mu.Unlock()
				for _, x := range d.offers.byToken {
					if x.live && x.boundKnown {
						o = x
					}
				}
				return o != nil
			})
			// A bound no statement gives, so that the next poll's is seen.
			const unset = 100 * time.Hour
			tc.during(t, d, func() {
				d.offers.mu.Lock()
				defer d.offers.mu.Unlock()
				o.bound.ahead = unset
			})
			var ahead time.Duration
			eventually(t, "a poll that renews the offer's clock bound", func() bool {
				d.offers.mu.Lock()
				defer d.offers.mu.Unlock()
				ahead = o.bound.ahead
				return ahead != unset
			})
			clockBoundOK(t, client.db, ahead, wait)
		})
	}
}

// TestPollKeepsOffersMadeAfterListing: the fallback poll (poll.sql)
// deletes the offers of ours missing from the tokens it was given, except
// those made in the last five seconds, which the dispatcher may have made
// after it listed the tokens (offerTokens runs before the statement), and
// the offers of dispatchers gone for an hour. One transaction runs the
// inserts and the poll, so that every row's age, measured by now(), is
// exact.
func TestPollKeepsOffersMadeAfterListing(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	const ttl = 3 * time.Second
	owner := uuid.New()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows := []struct {
		name  string
		ours  bool
		ends  string // expires_at
		token uuid.UUID
		kept  bool
	}{
		{name: "ours, listed", ours: true, ends: "now() + interval '3 seconds'", kept: true},
		{name: "ours, not listed, made 2.5s ago", ours: true, ends: "now() + interval '0.5 seconds'", kept: true},
		{name: "ours, not listed, made 7.5s ago", ours: true, ends: "now() - interval '4.5 seconds'"},
		{name: "another's, expired half an hour ago", ends: "now() - interval '30 minutes'", kept: true},
		{name: "another's, expired two hours ago", ends: "now() - interval '2 hours'"},
	}
	for i := range rows {
		r := &rows[i]
		r.token = uuid.New()
		o := uuid.New()
		if r.ours {
			o = owner
		}
		if _, err := tx.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
			VALUES ($1, $2, 'q', $3, 'bellhop_l_test', `+r.ends+`)`, r.token, uuid.New(), o); err != nil {
			t.Fatal(err)
		}
	}
	var live []uuid.UUID
	err = tx.QueryRow(ctx, queries.Poll, queries.Args{
		"heartbeat":       "h:test",
		"default_vt_secs": 30,
		"owner":           owner,
		"offers":          queries.UUIDs([]uuid.UUID{rows[0].token}),
		"offer_ttl_ms":    ttl.Milliseconds(),
		"grace_ms":        missedGrace.Milliseconds(),
	}).Scan(new(bool), new([]uuid.UUID), new([]uuid.UUID), new([]uuid.UUID), new([]uuid.UUID), new(*time.Time), &live, new(time.Time), new(time.Time))
	if err != nil {
		t.Fatal(err)
	}
	if len(live) != 1 || live[0] != rows[0].token {
		t.Errorf("live offers %v, want only the listed one, %v", live, rows[0].token)
	}
	for _, r := range rows {
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM bellhop_offers WHERE token = $1`, r.token).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if kept := n == 1; kept != r.kept {
			t.Errorf("%s: kept %v, want %v", r.name, kept, r.kept)
		}
	}
}

// TestReleaseRacesClose checks that a leased message released while the
// dispatcher closes its offers is either submitted before the completer
// closes or not at all: a submit after it would panic on the closed
// channel. Found by review of the model of offers (model/OFFERS.md).
func TestReleaseRacesClose(t *testing.T) {
	// A real database: the completer retries failed writes, and its
	// Close waits for them. The releases match no message.
	pool := pgtest.NewPool(t)
	for i := range 100 {
		d, _ := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
		d.complete = claim.NewCompleter(d.db, zerolog.Nop(), 1, 500)
		stop := make(chan struct{})
		panics := make(chan any, 4)
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				defer func() {
					if r := recover(); r != nil {
						panics <- r
					}
				}()
				m := &claim.Message{Source: claim.Queue, ID: uuid.New(), Token: uuid.New()}
				for {
					select {
					case <-stop:
						return
					default:
					}
					d.releaseLeased(m, claim.Target{})
				}
			})
		}
		time.Sleep(time.Duration(i%5) * 100 * time.Microsecond) // vary where the close lands
		d.closeOffers(context.Background())
		d.complete.Close()
		close(stop)
		wg.Wait()
		close(panics)
		for r := range panics {
			t.Fatalf("round %d: a release after the completer closed: %v", i, fmt.Sprint(r))
		}
	}
}

// testBook returns a dispatcher with an empty offer book and no goroutines,
// and one enabled queue lane of it with one slot and the given visibility
// timeout.
func testBook(t *testing.T, cfg DispatcherConfig, db *pgxpool.Pool, vt time.Duration) (*Dispatcher, *lane) {
	t.Helper()
	d := &Dispatcher{cfg: cfg, db: db, log: zerolog.Nop(), offers: offerBook{byToken: map[uuid.UUID]*offer{}},
		offerFailLog: logthrottle.New(1, time.Minute)}
	l := newLane(context.Background(), d, &consumerState{Consumer: Consumer{VisibilityTimeout: vt, Enabled: true,
		MaxInFlight: 1}}, claim.Target{Source: claim.Queue, AppID: uuid.New(), Queue: "q"}, new(atomic.Int32))
	t.Cleanup(func() { l.timer.Stop() })
	return d, l
}

// closedPool returns a pool whose every connection attempt is refused:
// nothing answers on port 1 of loopback. (A port freed by a listener of
// our own could be taken by a parallel test's server.)
func closedPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestWithdrawKeepsOtherLanesOffers: a lane that thinks it has an offer
// out when the book holds none of its own (the poll retired it, or a
// lease used it, between the flag and the lock) withdraws nothing else:
// the other lanes' offers stay, in the database and in the book. Found by
// review: an empty list of tokens read as "all of the dispatcher's".
func TestWithdrawKeepsOtherLanesOffers(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
	d.owner = uuid.New()
	other := newLane(context.Background(), d, l.state.Load(), claim.Target{Source: claim.Queue, AppID: uuid.New(), Queue: "other"},
		new(atomic.Int32))
	t.Cleanup(func() { other.timer.Stop() })
	token := uuid.New()
	if _, err := pool.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
		VALUES ($1, $2, 'other', $3, 'bellhop_l_test', now() + interval '1 minute')`, token, other.target.AppID, d.owner); err != nil {
		t.Fatal(err)
	}
	d.offers.byToken[token] = &offer{lane: other, live: true, sentAt: time.Now()}
	other.offered.Store(true)

	l.offered.Store(true) // but nothing of l's is in the book
	l.withdraw(ctx)

	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM bellhop_offers WHERE token = $1`, token).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Error("withdrawing a lane with no offer of its own deleted another lane's offer")
	}
	if _, ok := d.offers.byToken[token]; !ok {
		t.Error("withdrawing a lane with no offer of its own took another lane's token out of the book")
	}
	if l.offered.Load() {
		t.Error("the lane still counts an offer as out")
	}
}

// TestFailedOfferNotCounted: LeaseStats.Offers (bellhop_offers_total)
// counts the offers written, not the attempts: a database that refuses
// connections must not make it climb with no offer made. Found by review:
// the count was taken before the INSERT.
func TestFailedOfferNotCounted(t *testing.T) {
	cfg := DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}
	d, l := testBook(t, cfg, closedPool(t), 30*time.Second)
	l.makeOffer(context.Background())
	if len(d.offers.byToken) != 1 {
		t.Fatalf("book holds %d tokens after the failed offer; want 1 (the INSERT was tried)", len(d.offers.byToken))
	}
	if n := d.LeaseStats().Offers; n != 0 {
		t.Errorf("Offers = %d after an INSERT that failed; want 0", n)
	}

	// The same offer against a database that answers is counted.
	d, l = testBook(t, cfg, pgtest.NewPool(t), 30*time.Second)
	d.owner = uuid.New()
	l.makeOffer(context.Background())
	if n := d.LeaseStats().Offers; n != 1 {
		t.Errorf("Offers = %d after an offer made; want 1", n)
	}
}

// TestStopLookupFailureWarns: a stop whose lookup of our unheard tokens
// fails (here its budget has run out) says that leases under them may be
// held until they run out, and how many tokens that concerns; and the
// failed withdrawal of offers says what failed, not that a producer held
// one. Found by review: with Run's plain deadline the lookup's failure
// was taken for the caller stopping and logged nothing, and every error
// of the withdrawal was logged as a producer holding an offer.
func TestStopLookupFailureWarns(t *testing.T) {
	pool := pgtest.NewPool(t)
	for _, tc := range []struct {
		name    string
		ctx     func() (context.Context, context.CancelFunc)
		explain string // in the errors logged
	}{
		{"a plain deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), time.Nanosecond)
		}, "deadline exceeded"},
		{"Run's bound", func() (context.Context, context.CancelFunc) {
			return timeout.Bound(context.Background(), time.Nanosecond)
		}, "no answer within 1ns"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
			d.owner = uuid.New()
			var logs syncbuf.Buffer
			d.log = zerolog.New(&logs).Level(zerolog.WarnLevel)
			o := &offer{lane: l, live: true, sentAt: time.Now()}
			d.retire(o, time.Now()) // a token taken by a producer, its notification not heard
			d.offers.byToken[uuid.New()] = o

			ctx, cancel := tc.ctx()
			defer cancel()
			<-ctx.Done()
			d.closeOffers(ctx)

			type line struct {
				Level, Message, Error string
				Tokens                int
				Withdrawn             *bool `json:"offers_withdrawn"`
			}
			var lookup, withdraw *line
			for _, s := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
				var ln line
				if err := json.Unmarshal([]byte(s), &ln); err != nil {
					t.Fatalf("log line %q: %v", s, err)
				}
				switch {
				case strings.Contains(ln.Message, "could not look for leases under our tokens at the stop"):
					lookup = &ln
				case strings.Contains(ln.Message, "offers"):
					withdraw = &ln
				}
			}
			if lookup == nil {
				t.Fatalf("no warning that the stop's lookup failed; logs:\n%s", logs.String())
			}
			if lookup.Level != "warn" || lookup.Tokens != 1 || !strings.Contains(lookup.Error, tc.explain) ||
				!strings.Contains(lookup.Message, "until its lease runs out") || lookup.Withdrawn == nil || *lookup.Withdrawn {
				t.Errorf("the lookup's warning is %+v; want a warning about 1 token, its lease held until it runs out, error saying %q, offers_withdrawn false",
					*lookup, tc.explain)
			}
			if withdraw == nil {
				t.Fatalf("no warning that the withdrawal failed; logs:\n%s", logs.String())
			}
			if strings.Contains(withdraw.Message, "producer held") || !strings.Contains(withdraw.Error, tc.explain) {
				t.Errorf("the withdrawal's warning is %+v; want the error (%q), not a producer holding an offer", *withdraw, tc.explain)
			}
		})
	}
}

// TestStopLookupFailureAfterWithdrawal: when the stop withdrew every
// offer but its lookup of unheard tokens failed, the warning says the
// offers were withdrawn. Found by review: it counted the tokens left in
// the book as offers not withdrawn, though a taken offer's token stays
// there too (its notification unheard), and no offer was left.
func TestStopLookupFailureAfterWithdrawal(t *testing.T) {
	pool := pgtest.NewPool(t) // a database of its own: the test renames a table
	ctx := context.Background()
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
	d.owner = uuid.New()
	var logs syncbuf.Buffer
	d.log = zerolog.New(&logs).Level(zerolog.WarnLevel)
	o := &offer{lane: l, live: true, sentAt: time.Now()}
	d.offers.byToken[uuid.New()] = o // taken by a producer, its notification not heard
	// offer_recover.sql fails; the offers' withdrawal does not.
	if _, err := pool.Exec(ctx, `ALTER TABLE queue_messages RENAME TO queue_messages_gone`); err != nil {
		t.Fatal(err)
	}
	bctx, cancel := timeout.Bound(ctx, 10*time.Second)
	defer cancel()
	d.closeOffers(bctx)

	var lookup struct {
		Message   string
		Tokens    int
		Withdrawn *bool `json:"offers_withdrawn"`
	}
	for _, s := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if strings.Contains(s, "could not look for leases under our tokens at the stop") {
			if err := json.Unmarshal([]byte(s), &lookup); err != nil {
				t.Fatal(err)
			}
		}
	}
	if lookup.Message == "" {
		t.Fatalf("no warning that the stop's lookup failed; logs:\n%s", logs.String())
	}
	if lookup.Tokens != 1 || lookup.Withdrawn == nil || !*lookup.Withdrawn {
		t.Errorf("the lookup's warning is %+v; want 1 token and offers_withdrawn true", lookup)
	}
}

// TestHugePollIntervalOffers: a PollInterval meant as "never" (100 years)
// still makes offers that live: three times it wrapped to a negative TTL,
// every offer was written expired, and leasing was off without a word.
// The offer's expires_at must also stay within PostgreSQL's timestamps,
// and the token's forget time after now.
func TestHugePollIntervalOffers(t *testing.T) {
	const century = 100 * 365 * 24 * time.Hour
	pool := pgtest.NewPool(t)
	d, l := testBook(t, DispatcherConfig{PollInterval: century, LeaseAtInsert: true}, pool, 12*time.Hour)
	d.owner = uuid.New()
	if ttl := d.offerTTL(); ttl < 3*24*time.Hour {
		t.Fatalf("offerTTL = %s with a PollInterval of 100 years; want at least days", ttl)
	}
	var logs syncbuf.Buffer
	d.log = zerolog.New(&logs).Level(zerolog.DebugLevel)
	l.makeOffer(context.Background())
	if n := d.LeaseStats().Offers; n != 1 {
		t.Fatalf("Offers = %d; want the offer made (logs: %s)", n, logs.String())
	}
	var live bool
	if err := pool.QueryRow(context.Background(),
		`SELECT expires_at > now() + interval '1 year' FROM bellhop_offers WHERE owner = $1`, d.owner).Scan(&live); err != nil {
		t.Fatal(err)
	}
	if !live {
		t.Error("the offer was written expiring within a year, with a PollInterval of 100 years")
	}
	o := &offer{lane: l, live: true}
	now := time.Now()
	d.retire(o, now)
	if !o.forget.After(now.Add(24 * time.Hour)) {
		t.Errorf("a retired token is forgotten at %v, before its offer could have expired", o.forget)
	}
}

// TestStopDropWaitRunsOut: when a producer holds one of the stopping
// dispatcher's offers through the stop's wait (offer_drop_all_wait.sql's
// lock_timeout), the warning says so, and the other offers are withdrawn
// all the same. The warning used to be the same for any error.
func TestStopDropWaitRunsOut(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
	d.owner = uuid.New()
	var logs syncbuf.Buffer
	d.log = zerolog.New(&logs).Level(zerolog.WarnLevel)
	held, free := uuid.New(), uuid.New()
	for _, token := range []uuid.UUID{held, free} {
		if _, err := pool.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at)
			VALUES ($1, $2, 'q', $3, 'bellhop_l_test', now() + interval '1 minute')`, token, l.target.AppID, d.owner); err != nil {
			t.Fatal(err)
		}
		d.offers.byToken[token] = &offer{lane: l, live: true, sentAt: time.Now()}
	}
	// A producer's lease function holds the offer locked (FOR UPDATE)
	// until its transaction ends.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM bellhop_offers WHERE token = $1 FOR UPDATE`, held); err != nil {
		t.Fatal(err)
	}

	sctx, cancel := timeout.Bound(ctx, 10*time.Second)
	defer cancel()
	d.closeOffers(sctx)

	out := logs.String()
	if !strings.Contains(out, "a producer held one of our offers through the stop's wait") ||
		strings.Contains(out, "could not withdraw our offers at the stop") {
		t.Errorf("want the warning that a producer held an offer through the wait, and no other; logs:\n%s", out)
	}
	var left []uuid.UUID
	rows, err := pool.Query(ctx, `SELECT token FROM bellhop_offers WHERE owner = $1`, d.owner)
	if err == nil {
		left, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 1 || left[0] != held {
		t.Errorf("offers left after the stop: %v; want only the held one, %v", left, held)
	}
}

// TestStopPastBoundSkipsOffers: a stop whose bound passed before its
// handlers were done (stopWrites' ctx ended with errBoundPassed) sends
// nothing for its offers, says in one warning what that leaves (offers
// expiring, leases under unheard tokens running out, attempts spent),
// and still ends leasing. It logged a failed withdrawal and a failed
// lookup, each saying only "context canceled".
func TestStopPastBoundSkipsOffers(t *testing.T) {
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, closedPool(t), 30*time.Second)
	d.owner = uuid.New()
	var logs syncbuf.Buffer
	d.log = zerolog.New(&logs).Level(zerolog.DebugLevel)
	o := &offer{lane: l, live: true, sentAt: time.Now()}
	d.offers.byToken[uuid.New()] = o
	ctx, end := context.WithCancelCause(context.Background())
	end(errBoundPassed)
	d.closeOffers(ctx)
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], "not withdrawing our offers") ||
		!strings.Contains(lines[0], `"tokens":1`) || !strings.Contains(lines[0], "its attempt spent") ||
		!strings.Contains(lines[0], errBoundPassed.Error()) {
		t.Errorf("the stop's log about its offers:\n%s\nwant one warning naming the bound, 1 token and the attempt spent", logs.String())
	}
	d.offers.mu.Lock()
	closed := d.offers.closed
	d.offers.mu.Unlock()
	if !closed {
		t.Error("leasing not ended: a lease heard later would be submitted to a closed completer")
	}
}

// modeTracer records the query execution mode in which pgx sends each of
// the statements that carry the lease channel or offer tokens.
type modeTracer struct {
	mu    sync.Mutex
	modes map[string][]pgx.QueryExecMode // by statement name
}

func (m *modeTracer) TraceQueryStart(ctx context.Context, c *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	name := map[string]string{queries.OfferMake: "offer", queries.Poll: "poll", queries.OfferDrop: "withdrawal",
		queries.OfferRecover: "lease lookup"}[data.SQL]
	if name == "" {
		return ctx
	}
	mode := c.Config().DefaultQueryExecMode
	if len(data.Args) > 0 {
		if o, ok := data.Args[0].(pgx.QueryExecMode); ok {
			mode = o
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.modes[name] = append(m.modes[name], mode)
	return ctx
}

func (m *modeTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestSimpleProtocolHidesLeaseSecrets: a leasing dispatcher whose pool
// uses pgx's simple protocol mode, where pgx writes arguments into a
// statement's text, still keeps its lease channel and its offer tokens out
// of that text, which pg_stat_activity shows to monitoring roles (an idle
// connection shows its last statement until its next one): with both,
// such a role can read leased payloads and send a forged lease. The mode
// is set in the connection string's way (the pool config) or by a
// BeforeConnect hook, per connection. Each case:
//   - sends every statement that carries them in another mode: the offer,
//     the poll, the withdrawal (a paused consumer, and the stop) and the
//     lookup of leases by token (after a listener reconnect), each seen
//     at least once;
//   - and, end to end, has no statement text in pg_stat_activity hold the
//     channel or a token of the book, sampled as each of 51 messages is
//     sent (50 of them leased) and once it was handled, with the
//     dispatcher idle and an offer out. That check sees the offer's
//     INSERT, whose values come early in its text; the poll's and the
//     lookup's come after the first kilobyte of theirs, which is all that
//     pg_stat_activity keeps by default (track_activity_query_size).
//
// Either part fails with those statements sent as the pool's mode says.
// The LISTEN's text, whose one round trip of exposure is
// TestLeaseChannelHiddenFromActivity's, is left out.
func TestSimpleProtocolHidesLeaseSecrets(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(*pgxpool.Config)
	}{
		{"default_query_exec_mode", func(cfg *pgxpool.Config) {
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		}},
		{"BeforeConnect", func(cfg *pgxpool.Config) {
			cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
				cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				return nil
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			simpleProtocolHidesLeaseSecrets(t, tc.set)
		})
	}
}

func simpleProtocolHidesLeaseSecrets(t *testing.T, set func(*pgxpool.Config)) {
	ctx := context.Background()
	cfg, client, con := reloadSetup(t, ConsumerSpec{Queue: "a", MaxInFlight: 1})
	set(cfg)
	tracer := &modeTracer{modes: map[string][]pgx.QueryExecMode{}}
	cfg.ConnConfig.Tracer = tracer
	var handled atomic.Int64
	d, err := NewDispatcher(cfg, DispatcherConfig{
		Resolver: resolverFunc(func(Consumer) Handler {
			return HandlerFunc(func(context.Context, *Message) error { handled.Add(1); return nil })
		}),
		PollInterval: 100 * time.Millisecond, LeaseAtInsert: true, Logger: zerolog.Nop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- d.Run(rctx) }()
	stopped := false
	stopRun := func() {
		if stopped {
			return
		}
		stopped = true
		stop()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	t.Cleanup(stopRun)

	// secrets lists the channel and the tokens in the book now.
	secrets := func() []string {
		d.offers.mu.Lock()
		defer d.offers.mu.Unlock()
		s := []string{d.leaseChannel}
		for token := range d.offers.byToken {
			s = append(s, token.String())
		}
		return s
	}
	// shown returns the statements of other sessions that show a secret.
	shown := func() []string {
		rows, err := client.db.Query(ctx, `SELECT query FROM pg_stat_activity
			WHERE pid <> pg_backend_pid() AND datname = current_database() AND query NOT ILIKE 'listen %'`)
		if err != nil {
			t.Fatal(err)
		}
		texts, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		var bad []string
		for _, q := range texts {
			for _, s := range secrets() {
				if strings.Contains(q, s) {
					bad = append(bad, q)
					break
				}
			}
		}
		return bad
	}
	offerOut := func() bool {
		d.offers.mu.Lock()
		defer d.offers.mu.Unlock()
		for _, o := range d.offers.byToken {
			if o.live && o.boundKnown {
				return true
			}
		}
		return false
	}
	seen := func(name string) int {
		tracer.mu.Lock()
		defer tracer.mu.Unlock()
		return len(tracer.modes[name])
	}
	// The first message is claimed; the lane offers after its pass, and
	// each message after it is leased at its INSERT.
	const n = 50
	for i := range n + 1 {
		if _, err := client.Enqueue(ctx, "app", "a", []byte(`{}`), EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
		if bad := shown(); len(bad) > 0 {
			t.Fatalf("after message %d was sent, pg_stat_activity shows a lease secret: %q", i, bad)
		}
		eventually(t, "the message handled and an offer out", func() bool {
			return handled.Load() == int64(i+1) && offerOut()
		})
		if bad := shown(); len(bad) > 0 {
			t.Fatalf("after message %d, idle with an offer out, pg_stat_activity shows a lease secret: %q", i, bad)
		}
	}
	st := d.LeaseStats()
	t.Logf("LeaseStats %+v", st)
	if st.Leased < n/2 {
		t.Fatalf("LeaseStats %+v; want most of the %d messages after the first leased, so that the test sees the leases' statements", st, n)
	}
	eventually(t, "a poll", func() bool { return seen("poll") > 0 })
	// A reconnect looks up leases by the tokens out; a pause withdraws
	// the offer.
	d.listener.Restart()
	eventually(t, "a lookup of leases by token", func() bool { return seen("lease lookup") > 0 })
	if err := client.SetConsumerEnabled(ctx, "app", con.ID, false); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the offer withdrawn", func() bool { return seen("withdrawal") > 0 })
	stopRun()

	tracer.mu.Lock()
	defer tracer.mu.Unlock()
	for _, name := range []string{"offer", "poll", "withdrawal", "lease lookup"} {
		modes := tracer.modes[name]
		if len(modes) == 0 {
			t.Errorf("no %s statement was sent", name)
		}
		for _, m := range modes {
			if m == pgx.QueryExecModeSimpleProtocol {
				t.Errorf("%s statements sent in simple protocol mode (%d of them), with their arguments in their text", name, len(modes))
				break
			}
		}
	}
}

// TestLeaseForPausedLaneDoesNotBlockListener: a lease heard for a paused
// lane is released without waiting on the listener's goroutine, even when
// the Completer's queue is full. Found by review: the release waited in
// Submit there, while writes were retried against a database that was
// away, and every notification of every queue waited with it.
func TestLeaseForPausedLaneDoesNotBlockListener(t *testing.T) {
	d, l := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, closedPool(t), 30*time.Second)
	d.complete = claim.NewCompleter(d.db, zerolog.Nop(), 1, 1) // a queue of 4, and one in the writer
	t.Cleanup(func() {
		// Every submit has returned once every outcome is settled; a
		// Close before that raced them.
		d.complete.Abandon(errors.New("test over"))
		eventually(t, "every outcome given up on", func() bool { return d.complete.Pending() == 0 })
		d.complete.Close()
	})
	// Writes the refused connections keep failing until their leases end.
	const queued = 6
	for range queued {
		go d.complete.Submit(claim.Outcome{Message: &claim.Message{Source: claim.Queue, ID: uuid.New(), Token: uuid.New(),
			LeasedAt: time.Now(), VisibilityTimeout: time.Minute}, Verdict: claim.Release})
	}
	eventually(t, "the Completer's queue full, a submit waiting", func() bool { return d.complete.Pending() == queued })

	paused := *l.state.Load()
	paused.Enabled = false
	l.state.Store(&paused)
	token := uuid.New()
	d.offers.byToken[token] = &offer{lane: l, live: true, sentAt: time.Now()}
	heard := make(chan struct{})
	go func() {
		defer close(heard)
		d.onLease(notify.Lease{Token: token, ID: uuid.New(), Attempt: 1, MaxAttempts: 5, ClaimedAt: time.Now(),
			VisibilityTimeout: 30 * time.Second, Payload: []byte(`{}`)})
	}()
	select {
	case <-heard:
	case <-time.After(5 * time.Second):
		t.Fatal("the listener's lease callback still waited after 5s for room in the Completer's queue")
	}
	eventually(t, "the release submitted, waiting for room off the listener's goroutine", func() bool {
		return d.complete.Pending() == queued+1
	})
}

// TestRecoveredLeaseMeasuredByItsOffersConsumer: a lease found by its
// token is measured by the visibility timeout of the consumer whose offer
// it was, and by none (so that it goes back to the queue) once that
// consumer no longer serves the queue: removed, or replaced by another,
// and our copy not yet reloaded. The lookup used to find a consumer by
// the queue's name, and delivered such a lease to the removed consumer's
// handler, measured by its successor's timeout. Found by review.
func TestRecoveredLeaseMeasuredByItsOffersConsumer(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	client := NewClient(pool)
	app, err := client.CreateApp(ctx, "shop")
	if err != nil {
		t.Fatal(err)
	}
	now, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "shop", Queue: "q", VisibilityTimeout: 45 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	elsewhere, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "shop", Queue: "other", VisibilityTimeout: 90 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	d, _ := testBook(t, DispatcherConfig{PollInterval: time.Minute, LeaseAtInsert: true}, pool, 30*time.Second)
	for _, tc := range []struct {
		name     string
		consumer uuid.UUID
		want     time.Duration
	}{
		{"the queue's consumer", now.ID, 45 * time.Second},
		{"a consumer of another queue", elsewhere.ID, 0},
		{"a removed consumer", uuid.New(), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLane(ctx, d, &consumerState{Consumer: Consumer{VisibilityTimeout: 30 * time.Second, Enabled: true, MaxInFlight: 1}},
				claim.Target{Source: claim.Queue, AppID: app.ID, Queue: "q", TriggerID: tc.consumer}, new(atomic.Int32))
			t.Cleanup(func() { l.timer.Stop() })
			token := uuid.New()
			if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
				VALUES ($1, 'q', '{}', $2, now(), 1)`, app.ID, token); err != nil {
				t.Fatal(err)
			}
			d.offers.mu.Lock()
			d.offers.byToken[token] = &offer{lane: l}
			d.offers.mu.Unlock()
			fs, err := d.findLeases(ctx, []uuid.UUID{token})
			if err != nil {
				t.Fatal(err)
			}
			if len(fs) != 1 || fs[0].m.Token != token || fs[0].m.VisibilityTimeout != tc.want {
				t.Fatalf("found %+v, want the lease under %s measured by %s", fs, token, tc.want)
			}
		})
	}
}
