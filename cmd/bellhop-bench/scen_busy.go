package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// busyModes are the producer-side settings compared while a dispatcher
// drains the queue: the trigger off (no notification at all), the trigger
// with busy marks (the default), and the trigger with marks disabled (every
// producer transaction notifies).
var busyModes = []struct {
	label        string
	trigger      bool
	disableMarks bool
}{
	{"trigger off", false, false},
	{"trigger on, busy marks", true, false},
	{"trigger on, busy marks disabled", true, true},
}

// runBusy measures issue 7's target: enqueue throughput of concurrent
// producers, one message per transaction, while a dispatcher drains the
// queue, with and without busy marks, against the trigger disabled.
func runBusy(ctx context.Context, e *env, run int) error {
	db, err := e.srv.newDatabase(ctx, "busy", true)
	if err != nil {
		return err
	}
	defer db.drop()
	setup, err := openPool(ctx, db.DSN, 2, setupSession)
	if err != nil {
		return err
	}
	defer setup.Close()
	if err := setupConsumers(ctx, setup, []string{"p"}, bellhop.ConsumerSpec{}); err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	for _, p := range []int{8, 32} {
		for _, m := range busyModes {
			verb := "DISABLE"
			if m.trigger {
				verb = "ENABLE"
			}
			if _, err := setup.Exec(ctx, "ALTER TABLE queue_messages "+verb+" TRIGGER queue_messages_notify"); err != nil {
				return err
			}
			if _, err := setup.Exec(ctx, "TRUNCATE queue_messages"); err != nil {
				return err
			}
			n, elapsed, err := produceWhileDraining(ctx, e, db, p, m.disableMarks)
			if err != nil {
				return fmt.Errorf("%d producers, %s: %w", p, m.label, err)
			}
			e.res.Add(Metric{Scenario: "busy", Case: fmt.Sprintf("%d producers, dispatcher draining, %s", p, m.label),
				Name: "enqueues/s (1 msg per transaction)", Unit: "msgs/s"}, rate(n, elapsed))
		}
	}
	if _, err := setup.Exec(ctx, "ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify"); err != nil {
		return err
	}
	e.res.Note("busy", "one queue with a consumer served by a no-op Go handler (max in-flight 10) in a dispatcher in this process; producers as in scenario 6 for %s per case; busy marks disabled with DispatcherConfig.DisableBusyMarks; the trigger disabled with ALTER TABLE ... DISABLE TRIGGER", e.p.producerDuration)
	return nil
}

// produceWhileDraining runs a dispatcher on db and p producers for the
// producer duration, and returns how many messages they enqueued.
func produceWhileDraining(ctx context.Context, e *env, db *database, p int, disableMarks bool) (int, time.Duration, error) {
	cfg, err := pgxpool.ParseConfig(db.DSN)
	if err != nil {
		return 0, 0, err
	}
	cfg.MaxConns = int32(e.p.poolMaxConns)
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: every(noop), Logger: e.log, DisableBusyMarks: disableMarks})
	if err != nil {
		return 0, 0, err
	}
	dctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(dctx) }()
	defer func() {
		cancel()
		<-done
	}()
	deadline := time.Now().Add(10 * time.Second)
	for d.Ready(ctx) != nil {
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("dispatcher not ready")
		}
		if err := sleepCtx(ctx, 2*time.Millisecond); err != nil {
			return 0, 0, err
		}
	}
	n, elapsed, _, err := produceFor(ctx, db, p, e.p.producerDuration)
	return n, elapsed, err
}
