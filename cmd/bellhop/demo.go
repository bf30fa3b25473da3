package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/migrations"
	queries "github.com/bellhopq/bellhop/sql"
)

const (
	demoApp   = "demo"
	demoQueue = "orders"
)

// demoEnqueueTimeout bounds one of the demo's enqueues, which a stop
// lets finish, so that its outcome is known; once the stop began, it has
// demoStopWait left at most, so that a slow database cannot hold a Ctrl-C
// for the whole timeout.
const (
	demoEnqueueTimeout = 10 * time.Second
	demoStopWait       = 2 * time.Second
)

func demoCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name: "demo",
		Usage: "run everything end to end: a throwaway PostgreSQL (unless DATABASE_URL is set), the dispatcher, a demo HTTP consumer and a producer; Ctrl-C stops it; " +
			"logs errors only, in the console format, unless --log-level or --log-format is given",
		Flags: []cli.Flag{
			&cli.DurationFlag{Name: "interval", Value: 250 * time.Millisecond, Usage: "time between enqueued messages"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			// The demo prints its own story, between which JSON lines
			// read badly: it logs in the console format unless a format
			// was asked for (--log-format or BELLHOP_LOG_FORMAT).
			if !cmd.IsSet("log-format") {
				if err := cmd.Set("log-format", "console"); err != nil {
					return fmt.Errorf("demo: log format: %w", err)
				}
			}
			log, err := d.logger(cmd)
			if err != nil {
				return err
			}
			if cmd.Duration("interval") < time.Millisecond {
				return usagef("--interval %s: must be at least 1ms", cmd.Duration("interval"))
			}
			// The dispatcher's info lines would drown that story, and its
			// warnings repeat it: each dead letter, which the demo makes
			// on purpose and prints, is also a warning. It logs errors
			// only, unless a level was asked for (--log-level or
			// BELLHOP_LOG_LEVEL).
			if !cmd.IsSet("log-level") {
				log = log.Level(max(log.GetLevel(), zerolog.ErrorLevel))
			}
			ctx, stop := signalContext(ctx, log)
			defer stop()
			err = runDemo(ctx, d, cmd, log)
			if err != nil && stoppedBySignal(ctx, err) {
				// Ctrl-C while starting up is a normal way to stop; the
				// demo's log shows no info line that would say so.
				fmt.Fprintln(d.stdout, "stopped while starting")
				return nil
			}
			return err
		},
	}
}

func runDemo(ctx context.Context, d *deps, cmd *cli.Command, log zerolog.Logger) error {
	say := func(format string, args ...any) { fmt.Fprintf(d.stdout, format+"\n", args...) }
	url := cmd.String("database-url")
	if url == "" {
		say("starting a throwaway PostgreSQL (set DATABASE_URL to use your own)…")
		cluster, err := pgcluster.Start(ctx, pgcluster.Options{})
		if err != nil {
			if ctx.Err() != nil {
				say("stopped before PostgreSQL was up")
				return nil
			}
			return err
		}
		defer func() {
			if err := cluster.Stop(); err != nil {
				say("stopping PostgreSQL: %v", err)
			}
		}()
		say("PostgreSQL data in %s (removed on exit)", cluster.Dir())
		url = cluster.ConnString("postgres")
	}
	cfg, err := parsePoolConfig(url)
	if err != nil {
		return err
	}
	client, pool, err := openClient(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Migrating on the pool's connection, rather than on one of its own
	// closed just before the pool connected, keeps the demo to one
	// connection: a role's connection limit could refuse the pool while
	// the closed connection's backend was still exiting.
	if err := pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return migrations.Migrate(ctx, c.Conn()) }); err != nil {
		return err
	}
	if _, err := client.CreateApp(ctx, demoApp); err != nil && !errors.Is(err, bellhop.ErrAppExists) {
		return err
	}

	// The run's messages carry its id, so that the deliveries and dead
	// letters counted at the end are this run's: with DATABASE_URL,
	// demo/orders keeps those of earlier runs, and docker-compose's
	// producer and setup-demo's users enqueue there too.
	run := uuid.New()

	// The demo consumer: an HTTP endpoint on loopback that verifies each
	// request's signature and acts on the message's "kind".
	var secret atomic.Value
	secret.Store("")
	var delivered, others atomic.Int64
	consumer := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err := bellhop.VerifyPush(secret.Load().(string), r.Header, body, time.Now(), 5*time.Minute); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		var m struct {
			Run    string `json:"run"`
			N      int    `json:"n"`
			Kind   string `json:"kind"`
			SentAt int64  `json:"sent_at_unix_nano"`
		}
		attempt, _ := strconv.Atoi(r.Header.Get(bellhop.HeaderAttempt))
		if err := json.Unmarshal(body, &m); err != nil || m.Run != run.String() {
			// Not enqueued by this run: it has no n, kind or send time
			// of ours (a latency from a zero send time read as 55
			// years), and it is acked, not tested on.
			others.Add(1)
			// Unsigned, as every header but the timestamp: a replayed
			// request may carry control characters in it.
			say("  message %s (not from this demo run) attempt %d → 200 acked", printable.Line(r.Header.Get(bellhop.HeaderMessageID)), attempt)
			w.WriteHeader(http.StatusNoContent)
			return
		}
		latency := time.Duration(time.Now().UnixNano() - m.SentAt)
		delivered.Add(1)
		switch {
		case m.Kind == "flaky" && attempt < 3:
			say("  #%-4d %-8s attempt %d → 500, will be retried (after %s)", m.N, m.Kind, attempt, latency.Round(time.Millisecond))
			http.Error(w, "flaky failure", http.StatusInternalServerError)
		case m.Kind == "poison":
			say("  #%-4d %-8s attempt %d → 400, rejected: dead-lettered", m.N, m.Kind, attempt)
			http.Error(w, "cannot process this", http.StatusBadRequest)
		default:
			say("  #%-4d %-8s attempt %d → 200 acked, %s after enqueue", m.N, m.Kind, attempt, latency.Round(10*time.Microsecond))
			w.WriteHeader(http.StatusNoContent)
		}
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()

	// Register (or re-register, to learn a fresh secret) the consumer.
	if old, err := client.ConsumerOf(ctx, demoApp, demoQueue); err == nil {
		if err := client.RemoveConsumer(ctx, demoApp, old.ID); err != nil {
			return err
		}
	}
	con, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{
		App: demoApp, Queue: demoQueue, URL: "http://" + ln.Addr().String() + "/hook",
		MaxAttempts: 4, BackoffBase: 200 * time.Millisecond, BackoffCap: 2 * time.Second,
		VisibilityTimeout: 10 * time.Second,
	})
	if err != nil {
		return err
	}
	secret.Store(con.Secret)
	// Served only now that the secret is known: another dispatcher on the
	// database (a daemon with DATABASE_URL) may push as soon as the
	// consumer is registered, and a request checked against no secret
	// was answered 401, which dead-letters. Until now the listener's
	// backlog holds such a connection.
	go consumer.Serve(ln)
	defer consumer.Close()
	say("consumer %s pushes %s/%s to %s", con.ID, demoApp, demoQueue, con.URL)

	disp, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{
		Resolver: newPushResolver(httppush.New(httppush.Options{Logger: log}), log, time.Now), Logger: log,
	})
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- disp.Run(ctx) }()

	say("enqueuing a message every %s: most succeed, every 7th fails twice then succeeds, every 11th is rejected (dead letter), every 5th is delayed 2s. Ctrl-C to stop.", cmd.Duration("interval"))
	tick := time.NewTicker(cmd.Duration("interval"))
	defer tick.Stop()
	n := 0        // the sequence number of the message being enqueued
	enqueued := 0 // those the database took
	var runErr error
	returned := false  // Run has returned runErr
	announced := false // "stopping…" was said
produce:
	for {
		select {
		case <-ctx.Done():
			break produce
		case runErr = <-done:
			returned = true
			if ctx.Err() != nil {
				break produce // it stopped for the stop
			}
			// Run returns before the stop only when it cannot start
			// (the database refuses its connection, say): nothing
			// enqueued would be delivered.
			if runErr == nil {
				runErr = errors.New("it stopped without an error")
			}
			return fmt.Errorf("the demo's dispatcher failed, so the demo stopped after enqueuing %s: %w", plural(enqueued, "message"), runErr)
		case <-tick.C:
			if ctx.Err() != nil {
				break produce // both were ready: the stop wins
			}
		}
		n++
		kind, opts := "ok", bellhop.EnqueueOptions{}
		switch {
		case n%11 == 0:
			kind = "poison"
		case n%7 == 0:
			kind = "flaky"
		case n%5 == 0:
			kind, opts.Delay = "delayed", 2*time.Second
		}
		payload, _ := json.Marshal(map[string]any{"n": n, "kind": kind, "run": run, "sent_at_unix_nano": time.Now().UnixNano()})
		// Only a message the database took counts, and the stop does
		// not cut an enqueue short: cancelled on its way, it may have
		// been taken or not, and the summary could not tell. One that
		// hangs still gives up: after its timeout, or demoStopWait after
		// the stop began, which is announced at once, not once the
		// enqueue returns. A second signal exits at once.
		ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), demoEnqueueTimeout)
		stopWatch := context.AfterFunc(ctx, func() {
			say("stopping… (waiting up to %s for the enqueue in progress)", demoStopWait)
			time.AfterFunc(demoStopWait, cancel)
		})
		_, err := client.Enqueue(ectx, demoApp, demoQueue, payload, opts)
		if !stopWatch() {
			announced = true
		}
		cancel()
		if err == nil {
			enqueued++
		} else {
			say("enqueue #%d failed: %v", n, err)
		}
	}
	if !announced {
		say("stopping…")
	}
	if !returned {
		runErr = <-done
	}
	if runErr != nil {
		return runErr
	}
	dead, err := demoDeadLetters(context.Background(), pool, run)
	kept := cmd.String("database-url") != ""
	say("%s", demoSummary(enqueued, delivered.Load(), dead, err, others.Load(), kept))
	if kept {
		say("%s", demoLeftConsumer)
	}
	return nil
}

// demoLeftConsumer closes a demo on a database that is kept: the consumer
// it registered, which replaced the queue's (docker-compose's included),
// stays, pointing at the demo's own HTTP consumer, gone with it.
const demoLeftConsumer = "demo/orders keeps this demo's consumer, whose URL closed with it: its messages fail until " +
	"`bellhop setup-demo` or `bellhop consumer update` points it somewhere live, or `bellhop consumer rm` removes it"

// demoSummary is the demo's closing line: n messages enqueued (those the
// database took, not those tried), this run's
// deliveries and dead letters (or deadErr, which kept them from being
// counted), and the messages it acked that it had not enqueued, which are
// none of the run's deliveries. Where the database is kept (DATABASE_URL),
// it says where to see the dead letters.
func demoSummary(n int, delivered, dead int64, deadErr error, others int64, kept bool) string {
	s := fmt.Sprintf("done: %s enqueued, ", plural(n, "message"))
	// plural would write "deliverys".
	if delivered == 1 {
		s += "1 delivery"
	} else {
		s += fmt.Sprintf("%d deliveries", delivered)
	}
	if deadErr != nil {
		s += fmt.Sprintf("; counting the dead letters failed: %v", deadErr)
	} else {
		s += ", " + plural(int(dead), "dead letter")
		// A throwaway database is gone by now: nothing to look at.
		if kept && dead > 0 {
			s += " (see `bellhop dead ls --app demo`)"
		}
	}
	if others > 0 {
		s += fmt.Sprintf("; also acked %s not from this demo run", plural(int(others), "message"))
	}
	return s
}

// demoDeadLetters counts the dead letters of the demo's queue whose
// messages run enqueued (their payload's "run"). Listing the queue's dead
// letters instead stopped at the listing's default limit of 100, and took
// in earlier runs' dead letters, which a database given by DATABASE_URL
// keeps.
func demoDeadLetters(ctx context.Context, db *pgxpool.Pool, run uuid.UUID) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, queries.DemoDeadLetters,
		queries.Args{"app_name": demoApp, "queue_name": demoQueue, "run": run.String()}).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count the demo's dead letters: %w", err)
	}
	return n, nil
}
