package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// setupDemoCommand prepares the docker-compose demo: it creates the app if
// needed and makes sure the queue has a push consumer at --url whose
// signing secret is in --secret-file, for the example consumer to read.
// It is safe to re-run: a consumer at that URL whose secret the file holds
// is kept as it is, so that re-running neither rotates the secret under a
// running consumer nor dead-letters the deliveries signed with the old one.
func setupDemoCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name: "setup-demo",
		Usage: "create an app if missing and make sure a queue has a push consumer at a URL with its secret in a file " +
			"(for docker-compose; re-runnable: keeps a consumer whose secret the file holds)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "app", Required: true, Usage: "app name (required)", Sources: env("APP")},
			&cli.StringFlag{Name: "queue", Required: true, Usage: "queue name (required)"},
			&cli.StringFlag{Name: "url", Required: true, Usage: "consumer URL (required)"},
			&cli.StringFlag{Name: "secret-file", Required: true, Usage: "where to write the signing secret (mode 0600, replaced atomically) (required)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			app, queue, url, path := cmd.String("app"), cmd.String("queue"), cmd.String("url"), cmd.String("secret-file")
			// Everything that can be checked without the database is, before
			// anything changes: a failure halfway would leave the queue
			// without a consumer, or with one whose secret nobody has.
			if err := checkAppFlag(cmd); err != nil {
				return err
			}
			if err := validate.QueueName(queue); err != nil {
				return usagef("--queue: %w", err)
			}
			if err := validate.PushURL(url); err != nil {
				return usagef("--url: %w", err)
			}
			if err := httppush.New(httppush.Options{}).CheckURL(url); err != nil {
				return usagef("--url: %w", err)
			}
			secret, err := newSecretFile(path)
			if err != nil {
				return err
			}
			defer secret.discard()
			cfg, err := poolConfig(cmd)
			if err != nil {
				return err
			}
			// Stopped while it waits for the database (docker-compose
			// stops it so during a slow start), it removes its
			// temporary file rather than leave one in the secrets
			// volume each time.
			ctx, stop := notifyStop(ctx)
			defer stop()
			// Until the consumer is replaced, a stop leaves the queue's
			// consumer and the secret file as they were, and says so:
			// re-running is safe.
			const unchanged = "the consumer and the secret file were not changed"
			c, pool, err := openClient(ctx, cfg)
			if err != nil {
				return interruptedBefore(ctx, err, "connecting to the database", "nothing was changed")
			}
			defer pool.Close()
			if _, err := c.CreateApp(ctx, app); err != nil && !errors.Is(err, bellhop.ErrAppExists) {
				return interruptedBefore(ctx, err, fmt.Sprintf("creating app %s", app), unchanged)
			}
			old, err := c.ConsumerOf(ctx, app, queue)
			switch {
			case errors.Is(err, bellhop.ErrUnknownConsumer):
				old = bellhop.Consumer{}
			case err != nil:
				return interruptedBefore(ctx, err, "reading the consumer", unchanged)
			case old.URL == url:
				kept, err := secretMatches(ctx, pool, old.ID, path)
				if err != nil {
					return interruptedBefore(ctx, err, "reading the consumer", unchanged)
				}
				if kept {
					fmt.Fprintf(d.stdout, "consumer %s of %s/%s is registered already; kept it and its secret in %s\n", old.ID, app, queue, path)
					return nil
				}
			}
			// A stop during a step above that finished all the same:
			// nothing is changed after it either.
			if ctx.Err() != nil {
				return interruptedBefore(ctx, ctx.Err(), "reading the consumer", unchanged)
			}
			con, err := replaceConsumer(ctx, c, old.ID, bellhop.ConsumerSpec{App: app, Queue: queue, URL: url}, secret)
			if err != nil {
				return err
			}
			if old.ID != uuid.Nil {
				// It may have been paused or tuned, and its pending invoke
				// deliveries went with it: an operator should know
				// (the CLI review).
				fmt.Fprintf(d.stdout, "replaced consumer %s of %s/%s (its settings and pending invoke deliveries went with it)\n", old.ID, app, queue)
			}
			fmt.Fprintf(d.stdout, "consumer %s registered for %s/%s; secret written to %s\n", con.ID, app, queue, path)
			return nil
		},
	}
}

// replaceTimeout bounds replaceConsumer, which a stop does not cut
// short: well within the 10 s that docker-compose leaves between its
// stop signal and its kill, so that the end is still seen and reported.
const replaceTimeout = 5 * time.Second

// replaceConsumer removes consumer old of spec's queue (none if uuid.Nil),
// registers spec in its place and writes the new consumer's secret. Once
// begun it runs to the end, or to replaceTimeout, whatever ctx does: a
// stop between the removal and the registration left the queue with no
// consumer, and one between the registration and the write a consumer
// whose secret nobody had.
func replaceConsumer(ctx context.Context, c *bellhop.Client, old uuid.UUID, spec bellhop.ConsumerSpec, secret *secretFile) (bellhop.Consumer, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), replaceTimeout)
	defer cancel()
	if old != uuid.Nil {
		if err := c.RemoveConsumer(ctx, spec.App, old); err != nil {
			return bellhop.Consumer{}, err
		}
	}
	// The secret is written once the consumer is registered: the
	// registration makes it, and a file written first would hold a
	// secret nobody signs with if the registration failed. A running
	// daemon may push with the new secret in between; the example
	// consumer answers those 503, which is retried.
	con, err := c.RegisterConsumer(ctx, spec)
	if err != nil {
		if old != uuid.Nil {
			return bellhop.Consumer{}, fmt.Errorf("consumer %s of %s/%s was removed, but its replacement was not registered (re-run setup-demo to register it): %w", old, spec.App, spec.Queue, err)
		}
		return bellhop.Consumer{}, err
	}
	if err := secret.commit(con.Secret); err != nil {
		return bellhop.Consumer{}, fmt.Errorf("consumer %s registered for %s/%s, but its secret was not written (re-run setup-demo to register it again): %w", con.ID, spec.App, spec.Queue, err)
	}
	return con, nil
}

// secretMatches reports whether the file at path holds the signing secret
// of consumer id. The comparison is done by the database, so the secret
// is not read into this process; the library has no call for it because
// its listings never carry secrets. What is sent is a SHA-256 of the
// file's secret (consumer_secret_matches.sql), not the secret: a server that logs bind parameters
// (log_statement = all, log_min_duration_statement = 0) would log it. A
// missing or unreadable file does not match: the consumer is then
// registered again, with a secret written anew.
func secretMatches(ctx context.Context, pool *pgxpool.Pool, id uuid.UUID, path string) (bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return false, nil
	}
	held := strings.TrimSpace(string(b))
	if held == "" {
		return false, nil
	}
	sum := sha256.Sum256([]byte("bellhop secret check:" + held))
	var match bool
	if err := pool.QueryRow(ctx, queries.ConsumerSecretMatches, queries.Args{"id": id, "secret_sha256": sum[:]}).Scan(&match); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil // removed meanwhile
		}
		return false, fmt.Errorf("compare consumer %s's secret with %s: %w", id, path, err)
	}
	return match, nil
}

// secretFile replaces a secret file atomically: a temporary file in the
// same directory, created up front so that an unwritable path is refused
// before anything else changes, is renamed over it once written. Readers
// see the old secret or the new one, never a part.
type secretFile struct {
	path string
	tmp  *os.File // nil once committed or discarded
}

// newSecretFile prepares the replacement of path. Its errors are usage
// errors: the path is wrong, not the database.
func newSecretFile(path string) (*secretFile, error) {
	if err := checkSecretPath(path); err != nil {
		return nil, err
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	// os.CreateTemp creates the file with mode 0600.
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return nil, usagef("--secret-file %q: cannot write in its directory: %w", path, err)
	}
	return &secretFile{path: path, tmp: tmp}, nil
}

// checkSecretPath refuses a --secret-file that cannot name a file. A file
// that does not exist yet is fine: docker-compose writes it later.
func checkSecretPath(path string) error {
	if path == "" || strings.HasSuffix(path, "/") {
		return usagef("--secret-file %q names no file", path)
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return usagef("--secret-file %q is a directory", path)
	}
	return nil
}

// commit writes secret to the temporary file and renames it over the
// secret file.
func (f *secretFile) commit(secret string) error {
	tmp := f.tmp
	f.tmp = nil
	_, err := tmp.WriteString(secret)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), f.path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("write %s: %w", f.path, err)
	}
	return nil
}

// discard removes the temporary file unless commit renamed it.
func (f *secretFile) discard() {
	if f.tmp != nil {
		f.tmp.Close()
		os.Remove(f.tmp.Name())
		f.tmp = nil
	}
}

// exampleShutdownTimeout bounds how long a stopping example consumer
// waits for the requests in flight; compose's grace period is 10 s.
const exampleShutdownTimeout = 5 * time.Second

// countHandling counts in n the requests that h is handling. A request
// counts until its answer has been flushed to the connection, so that
// closing the server once n is zero cuts no answer short.
func countHandling(n *atomic.Int64, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		defer n.Add(-1)
		h.ServeHTTP(w, r)
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
	})
}

// stopServing shuts srv down, waiting up to timeout for the requests it
// is handling (counted in handling). srv.Shutdown alone would also wait
// for connections that were opened and never carried a request, such as
// an HTTP client's spare ones, which it leaves for 5 s: once no request
// is being handled, the server is closed instead. A client that sends a
// request on such a connection in that instant sees it fail before an
// answer, as a push that Bellhop makes again.
func stopServing(srv *http.Server, handling *atomic.Int64, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.Shutdown(ctx) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			if handling.Load() == 0 {
				srv.Close()
				return <-done
			}
		}
	}
}

// exampleConsumerCommand is a minimal HTTP push consumer: it verifies each
// request's signature and timestamp, prints the delivery and acks it. A
// check that fails is answered 503, which Bellhop retries, unless the
// request is not signed at all (401).
func exampleConsumerCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "example-consumer",
		Usage: "serve an example HTTP push consumer that verifies signatures and acks every message",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "addr", Value: ":8080", Usage: "listen address"},
			&cli.StringFlag{Name: "secret-file", Required: true, Usage: "file holding the consumer's signing secret (read on every request, so re-registration is picked up) (required)"},
			&cli.DurationFlag{Name: "replay-window", Value: 5 * time.Minute, Usage: "reject requests whose timestamp is further than this from now"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			// VerifyPush reads a window that is not positive as its
			// default, 5 minutes: given explicitly, it is a mistake.
			if w := cmd.Duration("replay-window"); w <= 0 {
				return usagef("--replay-window %s: must be positive", w)
			}
			// An empty address listens on a random port, which no
			// consumer URL can name.
			if cmd.String("addr") == "" {
				return usagef("--addr is empty: give the address to listen on, such as :8080")
			}
			if err := checkSecretPath(cmd.String("secret-file")); err != nil {
				return err
			}
			ctx, stop := signalContext(ctx, nopLogger())
			defer stop()
			// Whoever watches this consumer answer 503s learns why, once
			// per reason rather than once per request.
			var lastMissing atomic.Value // string
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, err := io.ReadAll(io.LimitReader(r.Body, 2<<20))
				if err != nil {
					http.Error(w, "read body", http.StatusBadRequest)
					return
				}
				// A file not written yet, or caught empty mid-write, has no
				// secret: 503, which Bellhop retries. A 401 would
				// dead-letter the message at once.
				raw, err := os.ReadFile(cmd.String("secret-file"))
				secret := strings.TrimSpace(string(raw))
				if err != nil || secret == "" {
					why := "it is empty"
					if err != nil {
						why = err.Error()
					}
					if lastMissing.Swap(why) != why {
						fmt.Fprintf(d.stdout, "no signing secret yet (%s): answering 503 until there is one\n", why)
					}
					http.Error(w, "no secret yet", http.StatusServiceUnavailable)
					return
				}
				lastMissing.Store("")
				if err := bellhop.VerifyPush(secret, r.Header, body, time.Now(), cmd.Duration("replay-window")); err != nil {
					// A signature that does not match, or a timestamp out
					// of the window, may be Bellhop's all the same: signed
					// with a secret the file does not hold yet (setup-demo
					// registers the consumer, which a running daemon
					// pushes for at once, before it can write the new
					// secret here) or no longer holds (a daemon that has
					// not reloaded yet), or by a host whose clock is off.
					// 503 is retried with the consumer's backoff, which
					// spreads the attempts wider than a short Retry-After
					// would; 401 would dead-letter the message at once.
					// A request with no signature at all is not Bellhop's.
					code := http.StatusUnauthorized
					if errors.Is(err, bellhop.ErrBadSignature) || errors.Is(err, bellhop.ErrStaleSignature) {
						code = http.StatusServiceUnavailable
					}
					fmt.Fprintf(d.stdout, "rejected a request with %d: %v\n", code, err)
					http.Error(w, err.Error(), code)
					return
				}
				// The signature does not cover these headers: a replayed
				// request may carry anything that HTTP allows in them,
				// bidi overrides and C1 controls included.
				fmt.Fprintf(d.stdout, "%s %s/%s message %s attempt %s: %d bytes\n", time.Now().UTC().Format(time.RFC3339Nano),
					printable.Line(r.Header.Get(bellhop.HeaderApp)), printable.Line(r.Header.Get(bellhop.HeaderQueue)),
					printable.Line(r.Header.Get(bellhop.HeaderMessageID)), printable.Line(r.Header.Get(bellhop.HeaderAttempt)), len(body))
				w.WriteHeader(http.StatusNoContent)
			})
			// Listen first, so that a bad or busy --addr is refused before
			// anything is served (exit 2, or 1 when it is in use: listen)
			// and the line below shows the real address (also for port 0).
			ln, err := listen("--addr", cmd.String("addr"))
			if err != nil {
				return err
			}
			// Deadlines for every read, write and idle connection. Idle
			// connections are kept longer than the pusher keeps its own
			// (90 s), so that it is the pusher that closes them: a POST on
			// a connection the server has just closed fails.
			var handling atomic.Int64
			srv := &http.Server{Handler: countHandling(&handling, h), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
				WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
			stopped := make(chan error, 1)
			go func() {
				<-ctx.Done()
				fmt.Fprintf(d.stdout, "example consumer stopping: finishing the requests in flight (up to %s)\n", exampleShutdownTimeout)
				stopped <- stopServing(srv, &handling, exampleShutdownTimeout)
			}()
			fmt.Fprintf(d.stdout, "example consumer listening on %s\n", ln.Addr())
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			// Serve returns as soon as Shutdown begins. Returning then
			// would end the process under a request in flight, whose
			// message Bellhop would push again once its lease ran out.
			if err := <-stopped; err != nil {
				return fmt.Errorf("example consumer: requests still in flight after %s: %w", exampleShutdownTimeout, err)
			}
			return nil
		},
	}
}
