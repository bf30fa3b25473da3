package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
)

// Latency cases.
const (
	caseGo        = "Go handler"
	caseHTTP      = "HTTP push (httptest server)"
	caseGoNoMarks = "Go handler, busy marks disabled"
	caseGoLease   = "Go handler, leasing at INSERT"
)

// runLatency: an idle dispatcher gets messages one per transaction,
// interval apart; each is timed from just before Client.Enqueue to the
// start of its handler.
func runLatency(ctx context.Context, e *env, run int) error {
	// The third case is the first with DispatcherConfig.DisableBusyMarks:
	// issue 7 asks that busy marks keep idle latency as it was.
	for _, cas := range inRunOrder(run, []string{caseGo, caseHTTP, caseGoNoMarks, caseGoLease}) {
		if _, err := latencyOnce(ctx, e, cas, run, reportAs{"latency", cas}); err != nil {
			return fmt.Errorf("%s: %w", cas, err)
		}
	}
	for _, offer := range []bool{false, true} {
		if err := enqueueAlone(ctx, e, offer); err != nil {
			return fmt.Errorf("enqueue without a dispatcher: %w", err)
		}
	}
	e.res.Note("latency", "'claim pass round trip': each of the dispatcher's claim passes (one batch: claim, next due time, busy marks) from pgx sending it to its results and commit, by a pgx tracer on the dispatcher's pool, while messages were produced")
	e.res.Note("latency", "'Enqueue call' is how long Client.Enqueue took (INSERT, trigger, commit with its WAL flush); 'Enqueue returned → handler' is the rest, from its return to the handler's start (the dispatcher's share, give or take the NOTIFY's travel, which overlaps the return of the commit)")
	e.res.Note("latency", "%d messages to one queue, one Client.Enqueue (one transaction) every %s by the schedule; timed from just before Enqueue to the first line of the handler (Go) or of the HTTP endpoint's handler (push); consumer defaults (max in-flight %d)",
		e.p.latencyN, e.p.latencyInterval, bellhop.DefaultMaxInFlight)
	e.res.Note("latency", "the cases run Go handler, HTTP push, Go handler with busy marks disabled, Go handler with DispatcherConfig.LeaseAtInsert, in reverse order in even runs")
	e.res.Note("latency", "'%s': the dispatcher leaves an offer once the queue is idle, and each producer's trigger leases its message to it and sends it in the notification (docs/lease-at-insert.md); the claim pass figures of this case count only passes not replaced by a lease", caseGoLease)
	return nil
}

// reportAs names where a measurement's figures go: a scenario, and the
// case they are reported under.
type reportAs struct{ scenario, label string }

// latencyOnce measures the latency case cas once, reports its
// percentiles, and those of its parts, under at, and returns them.
func latencyOnce(ctx context.Context, e *env, cas string, run int, at reportAs) (latencyStats, error) {
	db, err := e.srv.newDatabase(ctx, "latency", true)
	if err != nil {
		return latencyStats{}, err
	}
	defer db.drop()
	e.res.Note(at.scenario, "transport: producer %s, dispatcher %s", transport(db.DSN), transport(db.DSN))

	rec := newRecorder(e.base, e.p.latencyN)
	spec := bellhop.ConsumerSpec{}
	var res bellhop.Resolver = every(rec.handler())
	if cas == caseHTTP {
		srv := httptest.NewServer(rec.httpHandler())
		defer srv.Close()
		spec.URL = srv.URL + "/hook"
		pusher := httppush.New(httppush.Options{Logger: e.log})
		defer pusher.CloseIdleConnections()
		res = resolverFunc(func(c bellhop.Consumer) bellhop.Handler {
			h, err := pusher.Handler(c)
			if err != nil {
				e.log.Error().Err(err).Msg("push handler")
				return nil
			}
			return h
		})
	}
	h := &hooks{disableMarks: cas == caseGoNoMarks, leaseAtInsert: cas == caseGoLease, claims: &claimTracer{}}
	if db.s.pss && e.evidenceRun(run) {
		w := &stmtWindow{e: e, db: db, scenario: at.scenario, label: at.scenario + ": " + at.label + " (evidence run)", top: 8}
		h.settled = func(time.Duration, bool) { w.open(ctx) }
		h.delivered = func() { w.close(ctx) }
	}
	st, _, err := latencyRunRate(ctx, e, db, at, run, []string{"lat"}, spec, res, rec, e.p.latencyInterval, 1, h)
	if err != nil {
		return st, err
	}
	if err := rec.dump(e, at.scenario, at.label, run); err != nil {
		return st, err
	}
	enq, after := rec.split()
	addLatency(e.res, at.scenario, at.label, st, true)
	addLatency(e.res, at.scenario, at.label+": Enqueue call", enq, false)
	addLatency(e.res, at.scenario, at.label+": Enqueue returned → handler", after, false)
	addLatency(e.res, at.scenario, at.label+": claim pass round trip", h.claims.stats(), false)
	return st, nil
}

// caseEnqueueAlone names the producer-only measurement; caseEnqueueLeasing
// the same with an offer out before each message.
const (
	caseEnqueueAlone   = "no dispatcher: Enqueue call"
	caseEnqueueLeasing = "no dispatcher, an offer out before each: Enqueue call"
)

// enqueueAlone times Client.Enqueue as the latency cases send it, with no
// dispatcher running, to tell the producer's own cost from contention
// with a dispatcher on the same machine. With offer, an offer of the queue
// is written before each message, off the timed path, as a leasing
// dispatcher leaves one, so that each Enqueue leases its message at
// commit: the producer's cost of leasing at INSERT.
func enqueueAlone(ctx context.Context, e *env, offer bool) error {
	db, setup, err := e.queueDB(ctx, "latency", "lat")
	if err != nil {
		return err
	}
	defer db.drop()
	defer setup.Close()
	prod, err := openPool(ctx, db.DSN, 1, map[string]string{"application_name": "bench-producer"})
	if err != nil {
		return err
	}
	defer prod.Close()
	owner := uuid.New()
	if offer {
		// The lease key (migrations/0045_lease_key.sql) and the offers'
		// owner key (0055), held as a leasing dispatcher's listener holds
		// them: without the first producers do not look for offers, and
		// without the second they leave the owner's offers alone.
		key, err := pgx.Connect(ctx, db.DSN)
		if err != nil {
			return err
		}
		defer key.Close(context.Background())
		if _, err := key.Exec(ctx, `SELECT pg_advisory_lock_shared(1650814063, 0),
		    pg_advisory_lock_shared(hashtextextended($1::text, 1650814064))`, owner); err != nil {
			return err
		}
	}
	client := bellhop.NewClient(prod)
	rec := newRecorder(e.base, e.p.latencyN)
	// Each offer is written right after the previous Enqueue returns, as
	// a leasing dispatcher makes its next offer once the last lease is
	// delivered: so the server is as idle before each Enqueue as in the
	// other cases, and the offer's INSERT does not wake it for the
	// producer.
	makeOffer := func(ctx context.Context) error {
		_, err := setup.Exec(ctx, `INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
		    SELECT gen_random_uuid(), c.app_id, 'lat', $2, 'bellhop_l_bench', now() + interval '1 hour', c.id
		    FROM queue_consumers AS c WHERE c.app_name = $1 AND c.queue_name = 'lat'`, benchApp, owner)
		return err
	}
	if offer {
		if err := makeOffer(ctx); err != nil {
			return err
		}
	}
	_, _, err = pace(ctx, e.p.latencyN, e.p.latencyInterval, 0, 1, func(ctx context.Context, i int, _ time.Time) error {
		body, t := rec.payload(i)
		_, err := client.Enqueue(ctx, benchApp, "lat", body, bellhop.EnqueueOptions{})
		rec.enqueued(i, t)
		rec.seen[i].Store(true)
		if err == nil && offer {
			err = makeOffer(ctx)
		}
		return err
	})
	if err != nil {
		return err
	}
	enq, _ := rec.split()
	if !offer {
		addLatency(e.res, "latency", caseEnqueueAlone, enq, false)
		e.res.Note("latency", "'%s': the same %d Client.Enqueue calls, %s apart, into a queue with a consumer but with no dispatcher running (nobody LISTENs)", caseEnqueueAlone, e.p.latencyN, e.p.latencyInterval)
		return nil
	}
	var leased int
	if err := setup.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`).Scan(&leased); err != nil {
		return err
	}
	if leased != e.p.latencyN {
		return fmt.Errorf("%s: %d of %d messages leased", caseEnqueueLeasing, leased, e.p.latencyN)
	}
	addLatency(e.res, "latency", caseEnqueueLeasing, enq, false)
	e.res.Note("latency", "'%s': as '%s', with an offer of the queue written after each Enqueue returns, for the next one (on another connection, off the timed path, about 10ms before the next Enqueue, as a leasing dispatcher makes its next offer after the last delivery), and the lease key held by a third session (as a leasing dispatcher's listener holds it), so that every message is leased at its commit; the notifications go to a channel nobody LISTENs on", caseEnqueueLeasing, caseEnqueueAlone)
	return nil
}

// hooks let a scenario act at points of a latency run.
type hooks struct {
	// disableMarks starts the dispatcher with DisableBusyMarks.
	disableMarks bool
	// leaseAtInsert starts the dispatcher with LeaseAtInsert.
	leaseAtInsert bool
	// beforeStart runs after setup, just before the dispatcher starts.
	beforeStart func() error
	// whileRunning runs in a goroutine while messages are produced; its
	// context ends when they have all been received.
	whileRunning func(ctx context.Context)
	// settled runs once the dispatcher has settled, before producing,
	// with how long its start-up statements took and whether that is
	// known (settleStatements).
	settled func(d time.Duration, known bool)
	// delivered runs once every message reached its handler, while the
	// dispatcher still runs.
	delivered func()
	// duration, if set, stops producing once it has passed, whether or
	// not every message was sent.
	duration time.Duration
	// claims, if set, times the dispatcher's claim passes.
	claims *claimTracer
	// sampleWaits, if set, names the evidence of the wait events of all
	// the database's sessions, sampled while messages are produced.
	sampleWaits string
	// vacuum, if set, runs VACUUM ANALYZE and CHECKPOINT on the database
	// once the consumers are registered, before the dispatcher starts:
	// registering thousands of them leaves enough new rows for
	// autovacuum to visit them, and enough WAL to bring a checkpoint,
	// in the measured stretch, as a backlog would in the burn-downs
	// (throughputOnce).
	vacuum bool
	// warmup, if set, sends messages at the same rate for this long, and
	// waits for their delivery, before the measured ones: the producers'
	// and the dispatcher's pools open their connections lazily, and the
	// first use of each new server session (forked, its caches cold)
	// takes milliseconds.
	warmup time.Duration
}

// warmupFor is the warm-up (hooks.warmup) before a measured stretch of d
// at a fixed rate: long enough for the pools to have opened the
// connections the rate needs, short against d.
func warmupFor(d time.Duration) time.Duration { return min(2*time.Second, d/4) }

// settleMaxFor is the longest latencyRunRate waits for the start-up
// claims of a dispatcher serving that many queues to settle.
func settleMaxFor(queues int) time.Duration {
	return 5*time.Second + time.Duration(queues)*10*time.Millisecond
}

// latencyRunRate runs one latency measurement on db: consumers on
// queues, a dispatcher, and producers sending rec's messages interval
// apart; it returns their latencies and the rate at which they were sent.
// at and run name the measurement in what it notes.
func latencyRunRate(ctx context.Context, e *env, db *database, at reportAs, run int, queues []string, spec bellhop.ConsumerSpec,
	res bellhop.Resolver, rec *recorder, interval time.Duration, producers int, h *hooks) (_ latencyStats, _ float64, err error) {
	if h == nil {
		h = &hooks{}
	}
	setup, err := openPool(ctx, db.DSN, 8, setupSession)
	if err != nil {
		return latencyStats{}, 0, err
	}
	err = setupConsumers(ctx, setup, queues, spec)
	if err == nil && h.vacuum {
		// The whole database: the registration writes to more than one
		// table, each new to the statistics.
		if _, err = setup.Exec(ctx, "VACUUM ANALYZE"); err == nil {
			err = e.checkpoint(ctx, setup, at.scenario, "after registering the consumers")
		}
	}
	setup.Close()
	if err != nil {
		return latencyStats{}, 0, fmt.Errorf("setup: %w", err)
	}
	// The producers' sessions keep the server's settings.
	prod, err := openPool(ctx, db.DSN, producers, map[string]string{"application_name": "bench-producer"})
	if err != nil {
		return latencyStats{}, 0, err
	}
	defer prod.Close()
	client := bellhop.NewClient(prod)

	if h.beforeStart != nil {
		if err := h.beforeStart(); err != nil {
			return latencyStats{}, 0, err
		}
	}
	var tracer pgx.QueryTracer
	if h.claims != nil {
		tracer = h.claims
	}
	d, err := e.startDispatcherWith(db.DSN, bellhop.DispatcherConfig{Resolver: res, DisableBusyMarks: h.disableMarks, LeaseAtInsert: h.leaseAtInsert}, tracer)
	if err != nil {
		return latencyStats{}, 0, err
	}
	defer d.stopInto(&err)
	if err := d.ready(ctx, 30*time.Second); err != nil {
		return latencyStats{}, 0, err
	}
	// A starting dispatcher claims once on every lane; let that pass, and
	// let it go idle, before the first message.
	settle, settled, err := settleStatements(ctx, db, time.Second, settleMaxFor(len(queues)))
	if err != nil {
		return latencyStats{}, 0, err
	}
	if h.warmup > 0 {
		warmN := int(h.warmup / interval)
		// The warm-up lasts h.warmup, as the measured part lasts
		// h.duration: producers that fall behind stop at its end.
		sent, _, err := pace(ctx, warmN, interval, h.warmup, producers, func(ctx context.Context, i int, _ time.Time) error {
			_, err := client.Enqueue(ctx, benchApp, queues[rand.N(len(queues))], warmupBody, bellhop.EnqueueOptions{})
			return err
		})
		if err != nil {
			return latencyStats{}, 0, fmt.Errorf("warm-up: %w", err)
		}
		deadline := time.Now().Add(60 * time.Second)
		for rec.warm.Load() < int64(sent) {
			if time.Now().After(deadline) {
				return latencyStats{}, 0, fmt.Errorf("warm-up: %d of %d messages delivered in 60s", rec.warm.Load(), sent)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if h.settled != nil {
		h.settled(settle, settled)
	}

	n := len(rec.lat)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	if h.whileRunning != nil {
		go h.whileRunning(wctx)
	}
	var waits map[string]int
	sampled := make(chan struct{})
	if h.sampleWaits != "" {
		waits = map[string]int{}
		go func() {
			defer close(sampled)
			sampleWaits(wctx, db, "", waits)
		}()
	} else {
		close(sampled)
	}
	if h.claims != nil {
		h.claims.arm(true)
	}
	sent, elapsed, err := pace(ctx, n, interval, h.duration, producers, func(ctx context.Context, i int, due time.Time) error {
		q := queues[0]
		if len(queues) > 1 {
			q = queues[rand.N(len(queues))]
		}
		rec.dueAt(i, due)
		body, t := rec.payload(i)
		_, err := client.Enqueue(ctx, benchApp, q, body, bellhop.EnqueueOptions{})
		rec.enqueued(i, t)
		return err
	})
	if err != nil {
		return latencyStats{}, 0, err
	}
	if err := rec.wait(ctx, sent, 60*time.Second); err != nil {
		return latencyStats{}, 0, err
	}
	wcancel()
	if h.claims != nil {
		h.claims.arm(false)
	}
	<-sampled
	if waits != nil {
		e.evidence.WaitEvents = append(e.evidence.WaitEvents, WaitSample{Case: h.sampleWaits, Counts: waits})
	}
	if h.delivered != nil {
		h.delivered()
	}
	if rec.dups.Load() > 0 || rec.bad.Load() > 0 {
		e.res.Note(at.scenario, "warning: %s, run %d: %d duplicate and %d unparsable deliveries", at.label, run, rec.dups.Load(), rec.bad.Load())
	}
	return rec.stats(), rate(sent, elapsed), nil
}
