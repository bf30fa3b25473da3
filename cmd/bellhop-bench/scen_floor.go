package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// runFloor measures the physical floor under a delivery: a round trip, a
// committed one-row INSERT, a NOTIFY from commit to receipt and an INSERT
// committed with a NOTIFY, from before the INSERT to receipt.
func runFloor(ctx context.Context, e *env, _ int) error {
	db, err := e.srv.newDatabase(ctx, "floor", false)
	if err != nil {
		return err
	}
	defer db.drop()
	n := e.p.floorN

	type target struct{ name, dsn string }
	for _, t := range []target{{"TCP", db.TCP}, {"unix socket", db.DSN}} {
		if t.dsn == "" {
			e.res.Note("floor", "SELECT 1 over TCP skipped: no TCP DSN for this server")
			continue
		}
		if t.name == "unix socket" && transport(t.dsn) == "TCP" {
			e.res.Note("floor", "the server from DATABASE_URL is reached over TCP; the 'unix socket' rows are TCP too")
		}
		lat, err := roundTrips(ctx, t.dsn, n, 0)
		if err != nil {
			return fmt.Errorf("SELECT 1 over %s: %w", t.name, err)
		}
		addLatency(e.res, "floor", "SELECT 1 round trip ("+t.name+")", summarize(lat), false)
	}
	// A dispatcher's claim follows an idle pause, like this, not a busy
	// stretch: on a VM the wake-up of idle CPUs is part of its cost.
	lat, err := roundTrips(ctx, db.DSN, n, e.p.notifyInterval)
	if err != nil {
		return fmt.Errorf("SELECT 1, paced: %w", err)
	}
	addLatency(e.res, "floor", caseFloorPacedSelect, summarize(lat), false)

	conn, err := pgx.Connect(ctx, db.DSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE TABLE scratch (id bigserial PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL DEFAULT now())"); err != nil {
		return err
	}
	lat = make([]int64, 0, n)
	for i := range n + n/10 {
		t0 := time.Now()
		if _, err := conn.Exec(ctx, "INSERT INTO scratch (v) VALUES ($1)", i); err != nil {
			return err
		}
		if i >= n/10 { // the first tenth warms up
			lat = append(lat, int64(time.Since(t0)))
		}
	}
	addLatency(e.res, "floor", "INSERT 1 row + commit (unix socket)", summarize(lat), false)

	// The same paced like the latency scenario's messages: a connection
	// idle for 10ms between statements costs more on a VM than one kept
	// busy.
	lat = lat[:0]
	begin := time.Now()
	for i := range n {
		if d := time.Until(begin.Add(time.Duration(i) * e.p.notifyInterval)); d > 0 {
			time.Sleep(d)
		}
		t0 := time.Now()
		if _, err := conn.Exec(ctx, "INSERT INTO scratch (v) VALUES ($1)", i); err != nil {
			return err
		}
		lat = append(lat, int64(time.Since(t0)))
	}
	addLatency(e.res, "floor", "INSERT 1 row + commit, one every 10ms (unix socket)", summarize(lat), false)

	lat, err = notifyRoundTrips(ctx, db.DSN, n, e.p.notifyInterval, func(ctx context.Context, c *pgx.Conn, i int) error {
		_, err := c.Exec(ctx, "SELECT pg_notify('bench_floor', $1)", strconv.Itoa(i))
		return err
	})
	if err != nil {
		return fmt.Errorf("NOTIFY: %w", err)
	}
	addLatency(e.res, "floor", "NOTIFY commit → receipt (unix socket)", summarize(lat), false)

	// What a producer's enqueue costs before a listener hears of it: the
	// row and its notification committed together, as the message INSERT
	// and its notify trigger are.
	lat, err = notifyRoundTrips(ctx, db.DSN, n, e.p.notifyInterval, func(ctx context.Context, c *pgx.Conn, i int) error {
		_, err := c.Exec(ctx, "WITH i AS (INSERT INTO scratch (v) VALUES ($2) RETURNING 1) SELECT pg_notify('bench_floor', $1) FROM i", strconv.Itoa(i), i)
		return err
	})
	if err != nil {
		return fmt.Errorf("INSERT + NOTIFY: %w", err)
	}
	addLatency(e.res, "floor", caseFloorInsertNotify, summarize(lat), false)
	if err := seedTableFloor(ctx, e); err != nil {
		return fmt.Errorf("INSERT into queue_messages + NOTIFY: %w", err)
	}
	e.res.Note("floor", "'%s': the same SELECT 1, one every %s as the latency scenario's messages come, so that the server's and this process's CPUs are idle before each, as they are before a dispatcher's claim; the 'latency p50 vs physical floor' target uses the back-to-back SELECT 1, as the issue defines it", caseFloorPacedSelect, e.p.notifyInterval)
	e.res.Note("floor", "SELECT 1 and INSERT: %d round trips back to back on one connection (after %d warm-up); extended protocol, as the dispatcher uses; the INSERT is into a 3-column scratch table with a bigserial primary key; 'one every 10ms': the same INSERT paced like the latency scenario's messages", n, n/10)
	e.res.Note("floor", "NOTIFY: %d notifications (after %d warm-up), one every %s (as in the latency scenario, so the listener is idle when each arrives); from just before `SELECT pg_notify(...)` (autocommit, so it includes the commit and its WAL flush) on one connection to WaitForNotification returning on another", n, n/10, e.p.notifyInterval)
	e.res.Note("floor", "INSERT + NOTIFY: the same, with the scratch-table INSERT and the notification in one autocommit statement, `WITH i AS (INSERT INTO scratch ... RETURNING 1) SELECT pg_notify(...) FROM i`, so one transaction and one commit, as the latency scenario's message INSERT and its notify trigger; from just before the statement to WaitForNotification returning on the other connection. It is the floor of the 'latency p50 vs physical floor' target")
	return nil
}

// caseFloorSeedInsertNotify is the INSERT + NOTIFY floor on the message
// table itself.
const caseFloorSeedInsertNotify = "INSERT into queue_messages + NOTIFY in one transaction → receipt (unix socket)"

// seedTableFloor is the INSERT + NOTIFY floor with the row going into
// queue_messages, whose columns, indexes and foreign key the seed fixes,
// instead of a scratch table: what any producer of this schema pays
// before a listener can hear of its message. The notify trigger is
// disabled, so the statement's own pg_notify is the only work besides the
// INSERT.
func seedTableFloor(ctx context.Context, e *env) error {
	db, setup, err := e.queueDB(ctx, "floor", "floor")
	if err != nil {
		return err
	}
	defer db.drop()
	// pgtype.UUID, as Bellhop's own statements pass uuids, so that the
	// floor is what a producer in any of pgx's exec modes pays.
	var appID pgtype.UUID
	err = setup.QueryRow(ctx, "SELECT id FROM apps WHERE name = $1", benchApp).Scan(&appID)
	if err == nil {
		_, err = setup.Exec(ctx, "ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify")
	}
	setup.Close()
	if err != nil {
		return err
	}
	lat, err := notifyRoundTrips(ctx, db.DSN, e.p.floorN, e.p.notifyInterval, func(ctx context.Context, c *pgx.Conn, i int) error {
		_, err := c.Exec(ctx, "WITH i AS (INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($2, 'floor', $3) RETURNING 1) SELECT pg_notify('bench_floor', $1) FROM i",
			strconv.Itoa(i), appID, `{"n":`+strconv.Itoa(i)+`}`)
		return err
	})
	if err != nil {
		return err
	}
	addLatency(e.res, "floor", caseFloorSeedInsertNotify, summarize(lat), false)
	e.res.Note("floor", "'%s': INSERT + NOTIFY as above, with the row going into queue_messages (the seed's columns, 5 indexes and foreign key) instead of the scratch table, and Bellhop's notify trigger disabled; what any producer of this schema pays before a listener hears of its message. Not a target's floor: it shows how much of the message INSERT the schema costs", caseFloorSeedInsertNotify)
	return nil
}

// caseFloorPacedSelect is the SELECT 1 round trip after an idle pause.
const caseFloorPacedSelect = "SELECT 1 round trip, one every 10ms (unix socket)"

// roundTrips times n SELECT 1 round trips on one connection, after a
// warm-up of n/10: back to back, or interval apart if it is not zero.
func roundTrips(ctx context.Context, dsn string, n int, interval time.Duration) ([]int64, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	lat := make([]int64, 0, n)
	var v int
	begin := time.Now()
	for i := range n + n/10 {
		if d := time.Until(begin.Add(time.Duration(i) * interval)); interval > 0 && d > 0 {
			time.Sleep(d)
		}
		t0 := time.Now()
		if err := conn.QueryRow(ctx, "SELECT 1").Scan(&v); err != nil {
			return nil, err
		}
		if i >= n/10 {
			lat = append(lat, int64(time.Since(t0)))
		}
	}
	return lat, nil
}

// caseFloorInsertNotify is the floor case the latency target compares with.
const caseFloorInsertNotify = "INSERT + NOTIFY in one transaction → receipt (unix socket)"

// notifyRoundTrips sends n notifications, interval apart, from one
// connection and times each to its receipt on another, after n/10 more
// that warm up both connections and are not counted, as the other floor
// cases do. send must notify channel bench_floor with payload
// strconv.Itoa(i) and commit it.
func notifyRoundTrips(ctx context.Context, dsn string, n int, interval time.Duration, send func(ctx context.Context, c *pgx.Conn, i int) error) ([]int64, error) {
	warm := n / 10
	n += warm
	listener, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer listener.Close(context.Background())
	sender, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer sender.Close(context.Background())
	if _, err := listener.Exec(ctx, "LISTEN bench_floor"); err != nil {
		return nil, err
	}
	base := time.Now()
	sent := make([]int64, n)
	recv := make([]int64, n)
	got := make(chan error, 1)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		for k := 0; k < n; {
			nt, err := listener.WaitForNotification(lctx)
			if err != nil {
				got <- err
				return
			}
			at := int64(time.Since(base))
			i, err := strconv.Atoi(nt.Payload)
			if err != nil || i < 0 || i >= n {
				continue
			}
			recv[i] = at
			k++
		}
		got <- nil
	}()
	begin := time.Now()
	for i := range n {
		if d := time.Until(begin.Add(time.Duration(i) * interval)); d > 0 {
			time.Sleep(d)
		}
		sent[i] = int64(time.Since(base))
		if err := send(ctx, sender, i); err != nil {
			return nil, err
		}
	}
	select {
	case err := <-got:
		if err != nil {
			return nil, err
		}
	case <-time.After(30 * time.Second):
		return nil, fmt.Errorf("notifications missing after 30s")
	}
	lat := make([]int64, n-warm)
	for i := range lat {
		lat[i] = recv[warm+i] - sent[warm+i]
	}
	return lat, nil
}

// addLatency records a latency summary's percentiles (µs), unless it
// summarises nothing: the zeros of an empty summary would go into the
// medians as figures (a "claim pass round trip" of 0 µs when every
// message was leased at its INSERT and no claim pass ran). Such a run is
// noted instead, and the case's medians are over the runs that measured
// something.
func addLatency(r *Results, scenario, cas string, st latencyStats, withP90 bool) {
	if st.N == 0 {
		r.Note(scenario, "run %d: '%s' not recorded: nothing was measured (no values to take percentiles of)", r.run, cas)
		return
	}
	m := func(name string) Metric {
		return Metric{Scenario: scenario, Case: cas, Name: name, Unit: "µs", LowerIsBetter: true}
	}
	r.Add(m("p50"), st.P50)
	if withP90 {
		r.Add(m("p90"), st.P90)
	}
	r.Add(m("p99"), st.P99)
	if withP90 {
		r.Add(m("max"), st.Max)
	}
}
