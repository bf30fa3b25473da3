package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
)

// setupDemoCommand prepares the docker-compose demo: it creates the app if
// needed and (re)registers the queue's consumer, writing the new signing
// secret to a file the example consumer reads.
func setupDemoCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "setup-demo",
		Usage: "create an app if missing and (re)register a push consumer, writing its secret to a file (for docker-compose)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "app", Required: true, Usage: "app name"},
			&cli.StringFlag{Name: "queue", Required: true, Usage: "queue name"},
			&cli.StringFlag{Name: "url", Required: true, Usage: "consumer URL"},
			&cli.StringFlag{Name: "secret-file", Required: true, Usage: "where to write the signing secret (mode 0600)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			c, pool, err := client(ctx, cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			app, queue := cmd.String("app"), cmd.String("queue")
			if _, err := c.CreateApp(ctx, app); err != nil && !errors.Is(err, bellhop.ErrAppExists) {
				return err
			}
			if old, err := c.ConsumerOf(ctx, app, queue); err == nil {
				if err := c.RemoveConsumer(ctx, app, old.ID); err != nil {
					return err
				}
			}
			con, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: app, Queue: queue, URL: cmd.String("url")})
			if err != nil {
				return err
			}
			if err := os.WriteFile(cmd.String("secret-file"), []byte(con.Secret), 0o600); err != nil {
				return fmt.Errorf("write secret: %w", err)
			}
			fmt.Fprintf(d.stdout, "consumer %s registered for %s/%s; secret written to %s\n", con.ID, app, queue, cmd.String("secret-file"))
			return nil
		},
	}
}

// exampleConsumerCommand is a minimal HTTP push consumer: it verifies each
// request's signature and timestamp, prints the delivery and acks it.
func exampleConsumerCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "example-consumer",
		Usage: "serve an example HTTP push consumer that verifies signatures and acks every message",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "addr", Value: ":8080", Usage: "listen address"},
			&cli.StringFlag{Name: "secret-file", Required: true, Usage: "file holding the consumer's signing secret (read on every request, so re-registration is picked up)"},
			&cli.DurationFlag{Name: "replay-window", Value: 5 * time.Minute, Usage: "reject requests whose timestamp is further than this from now"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			ctx, stop := signalContext(ctx, nopLogger())
			defer stop()
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, err := io.ReadAll(io.LimitReader(r.Body, 2<<20))
				if err != nil {
					http.Error(w, "read body", http.StatusBadRequest)
					return
				}
				secret, err := os.ReadFile(cmd.String("secret-file"))
				if err != nil {
					http.Error(w, "no secret yet", http.StatusServiceUnavailable)
					return
				}
				if err := bellhop.VerifyPush(strings.TrimSpace(string(secret)), r.Header, body, time.Now(), cmd.Duration("replay-window")); err != nil {
					fmt.Fprintf(d.stdout, "rejected a request: %v\n", err)
					http.Error(w, err.Error(), http.StatusUnauthorized)
					return
				}
				fmt.Fprintf(d.stdout, "%s %s/%s message %s attempt %s: %d bytes\n", time.Now().UTC().Format(time.RFC3339Nano),
					r.Header.Get("Bellhop-App"), r.Header.Get("Bellhop-Queue"), r.Header.Get("Bellhop-Message-Id"),
					r.Header.Get("Bellhop-Attempt"), len(body))
				w.WriteHeader(http.StatusNoContent)
			})
			// Listen first, so that a bad --addr is a usage error and the
			// line below shows the real address (also for port 0).
			ln, err := net.Listen("tcp", cmd.String("addr"))
			if err != nil {
				return usagef("--addr %q: %v", cmd.String("addr"), err)
			}
			srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
			go func() {
				<-ctx.Done()
				sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				_ = srv.Shutdown(sctx)
			}()
			fmt.Fprintf(d.stdout, "example consumer listening on %s\n", ln.Addr())
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		},
	}
}
