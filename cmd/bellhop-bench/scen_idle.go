package main

import (
	"context"
	"fmt"
	"time"

	"github.com/bellhopq/bellhop"
)

// runIdle: a dispatcher serving many consumers with nothing to do; count
// what it costs the database.
func runIdle(ctx context.Context, e *env, run int) (err error) {
	db, err := e.srv.newDatabase(ctx, "idle", true)
	if err != nil {
		return err
	}
	defer db.drop()
	cas := idleCase(e.p)
	setup, err := openPool(ctx, db.DSN, 8, setupSession)
	if err != nil {
		return err
	}
	err = setupConsumers(ctx, setup, queueNames(e.p.idleConsumers), bellhop.ConsumerSpec{})
	setup.Close()
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	var startDealloc deallocs
	if db.s.pss {
		if err := db.resetStatements(ctx); err != nil {
			// The start-up and window counts need the resets: without
			// them they would hold the set-up's statements too.
			return fmt.Errorf("reset pg_stat_statements (the user needs EXECUTE on pg_stat_statements_reset): %w", err)
		}
		startDealloc.begin(ctx, db.s)
	}
	obs := newObserver(0)
	d, err := e.startDispatcher(db.DSN, every(noop), obs)
	if err != nil {
		return err
	}
	defer d.stopInto(&err)
	if err := d.ready(ctx, 30*time.Second); err != nil {
		return err
	}
	// Wait for the start-up claims to end, then for the statistics of
	// everything before the window to reach pg_stat_database (backends
	// flush them within about ten seconds of going idle).
	settleFrom := time.Now()
	const settleMax = 2 * time.Minute
	settled, known, err := settleStatements(ctx, db, time.Second, settleMax)
	if err != nil {
		return err
	}
	addSettled(e.res, Metric{Scenario: "idle", Case: cas, Name: "start-up: Run → claims settled", Unit: "s", LowerIsBetter: true},
		settleFrom.Sub(d.Start)+settled, known, db.s.pss, run, settleMax)
	// The start-up statements are counted before autovacuums reads db,
	// on a connection of db's own, which must fall neither among them nor
	// into the window.
	var st []stmtStat
	if db.s.pss {
		if st, err = db.statements(ctx); err != nil {
			return err
		}
		startDealloc.end(ctx, db.s)
	}
	av0, err := db.autovacuums(ctx)
	if err != nil {
		return err
	}
	if err := sleepCtx(ctx, e.p.idleSettle); err != nil {
		return err
	}
	var windowDealloc deallocs
	if db.s.pss {
		addStatementCount(e.res, Metric{Scenario: "idle", Case: cas, Name: "start-up statements", Unit: "statements", LowerIsBetter: true}, float64(sumCalls(st)), run, startDealloc)
		if run == 1 {
			e.evidence.addStatements("idle: start-up statements (run 1)", st, 6)
		}
		if err := db.resetStatements(ctx); err != nil {
			return fmt.Errorf("reset pg_stat_statements (the user needs EXECUTE on pg_stat_statements_reset): %w", err)
		}
		windowDealloc.begin(ctx, db.s)
	}
	// The window's bounds are read alike: the transaction count, the
	// poll count and the clock at its start, and the same right at its
	// end. A backend's statistics reach pg_stat_database up to about ten
	// seconds after its commits (PGSTAT_IDLE_INTERVAL), so each read may
	// lack the last few seconds' transactions, the start's as much as the
	// end's: the difference counts one window's worth. (Until 2026-12-05
	// the end was read idleSettle after the window, which counted its
	// transactions and polls too, over the window's minutes.)
	x0, err := db.transactions(ctx)
	if err != nil {
		return err
	}
	polls0 := obs.polls.Load()
	t0 := time.Now()
	if err := sleepCtx(ctx, e.p.idleDuration); err != nil {
		return err
	}
	polls1 := obs.polls.Load()
	x1, err := db.transactions(ctx)
	if err != nil {
		return err
	}
	minutes := time.Since(t0).Minutes()
	if db.s.pss {
		st, err := db.statements(ctx)
		if err != nil {
			return err
		}
		windowDealloc.end(ctx, db.s)
		addStatementCount(e.res, Metric{Scenario: "idle", Case: cas, Name: mIdleStatements, Unit: "stmts/min", LowerIsBetter: true}, float64(sumCalls(st))/minutes, run, windowDealloc)
		if run == 1 {
			e.evidence.addStatements("idle: statements in the idle window (run 1)", st, 10)
		}
	} else {
		e.res.Note("idle", "pg_stat_statements is not available on this server: statements not counted")
	}
	e.res.Add(Metric{Scenario: "idle", Case: cas, Name: "transactions/min (pg_stat_database)", Unit: "xacts/min", LowerIsBetter: true}, float64(x1-x0)/minutes)
	e.res.Add(Metric{Scenario: "idle", Case: cas, Name: "fallback polls in the window", Unit: "polls"}, float64(polls1-polls0))
	av1, err := db.autovacuums(ctx)
	if err != nil {
		return err
	}
	e.res.Add(Metric{Scenario: "idle", Case: cas, Name: "autovacuum + autoanalyze runs (not the dispatcher's)", Unit: "runs"}, float64(av1-av0))
	e.res.Note("idle", "%d consumers (one queue each) all served by one no-op Go handler through a Resolver; default PollInterval (%s ±10%%); pg_stat_statements reset (for this database) once the start-up claims have settled plus %s, then counted over %s; xact_commit+xact_rollback of the database from pg_stat_database over the same window, read at its start and at its end alike (statistics reach pg_stat_database up to about 10 s after a commit, at either read; they include autovacuum's transactions, whose runs are counted separately from pg_stat_all_tables); fallback polls counted over the same window; pg_stat_statements_info.dealloc is read at both ends of the start-up and of the window, and a run in which it changed (entries were evicted, whose calls may be missing) has that count left out and noted",
		e.p.idleConsumers, bellhop.DefaultPollInterval, e.p.idleSettle, e.p.idleDuration)
	return nil
}

// addSettled records m, a start-up time that ends when the start-up
// statements settled (settleStatements), if that end is known: without
// pg_stat_statements the wait was a fixed maxWait, and if the count still
// grew at maxWait it only says the start-up took longer. Either way the
// run's figure is left out, and noted, rather than recorded as a time it
// is not.
func addSettled(r *Results, m Metric, d time.Duration, known, pss bool, run int, maxWait time.Duration) {
	switch {
	case !pss:
		r.Note(m.Scenario, "'%s' not measured: pg_stat_statements is not available, so the end of the start-up statements cannot be seen (the run waited %s instead)", m.Name, maxWait)
	case !known:
		r.Note(m.Scenario, "run %d: '%s' left out: the statement count still grew after %s, so the start-up had not settled", run, m.Name, maxWait)
	default:
		r.Add(m, d.Seconds())
	}
}

// mIdleStatements is the idle scenario's statement rate, the target's
// figure.
const mIdleStatements = "statements/min (pg_stat_statements)"

// deallocs are pg_stat_statements_info.dealloc at the two ends of a
// stretch whose statements are counted.
type deallocs struct {
	before, after int64
	err           error
}

func (d *deallocs) begin(ctx context.Context, s *server) { d.before, d.err = s.stmtDeallocs(ctx) }

func (d *deallocs) end(ctx context.Context, s *server) {
	if d.err == nil {
		d.after, d.err = s.stmtDeallocs(ctx)
	}
}

// addStatementCount records v, a count of statements from
// pg_stat_statements over a stretch of run, unless entries were evicted
// in that stretch: the evicted may have been this database's, and their
// calls would be missing from v, so a low count could pass the target.
// Such a run's figure is left out, and noted. The counter also changes
// when pg_stat_statements is reset in full, which drops this database's
// counts too. Where the counter cannot be read (pg_stat_statements older
// than 1.9), v is recorded with a note that it was not checked.
func addStatementCount(r *Results, m Metric, v float64, run int, d deallocs) {
	switch {
	case d.err != nil:
		r.Note(m.Scenario, "'%s' not checked for evictions: reading pg_stat_statements_info failed (%v)", m.Name, d.err)
	case d.after != d.before:
		r.Note(m.Scenario, "run %d: '%s' left out: pg_stat_statements evicted entries (or was reset in full) while it was counted (pg_stat_statements_info.dealloc %d → %d), so it may have lost calls; raise pg_stat_statements.max", run, m.Name, d.before, d.after)
		return
	}
	r.Add(m, v)
}

func sumCalls(st []stmtStat) int64 {
	var n int64
	for _, s := range st {
		n += s.Calls
	}
	return n
}
