// Command bellhop runs the Bellhop dispatcher as a service and operates it
// from the command line: migrations, apps, consumers, enqueueing, queue and
// dead-letter inspection, and a one-command demo.
//
// Configuration comes from flags, then environment variables (each flag's
// help names its variable). A bad configuration exits with status 2 and
// one line naming the problem.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
)

func main() {
	os.Exit(run(context.Background(), os.Args, os.Stdin, os.Stdout, os.Stderr))
}

// usageError marks configuration and flag errors: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// run is main without the process exit, so tests can drive it.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	app := newApp(stdin, stdout, stderr)
	err := app.Run(ctx, args)
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "bellhop: %s\n", oneLine(err))
	var ue usageError
	if errors.As(err, &ue) || isFlagError(err) {
		return 2
	}
	return 1
}

func oneLine(err error) string {
	return strings.ReplaceAll(strings.TrimSpace(err.Error()), "\n", "; ")
}

// isFlagError recognises the CLI library's own parse errors.
func isFlagError(err error) bool {
	s := err.Error()
	for _, p := range []string{"flag provided but not defined", "invalid value", "Required flag", "required flag", "No help topic", "flag needs an argument", "invalid boolean"} {
		if strings.Contains(s, p) {
			return true
		}
	}
	return false
}

const envPrefix = "BELLHOP_"

func env(name string) cli.ValueSourceChain { return cli.EnvVars(envPrefix + name) }

// deps carries what commands share.
type deps struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *cli.Command {
	d := &deps{stdin: stdin, stdout: stdout, stderr: stderr}
	return &cli.Command{
		Name:      "bellhop",
		Usage:     "a PostgreSQL-native durable queue with a push dispatcher",
		Writer:    stdout,
		ErrWriter: stderr,
		// Errors are printed once, by run, as one line.
		ExitErrHandler: func(context.Context, *cli.Command, error) {},
		OnUsageError: func(_ context.Context, _ *cli.Command, err error, _ bool) error {
			return usageError{err}
		},
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "database-url", Usage: "PostgreSQL connection string", Sources: cli.EnvVars("DATABASE_URL")},
			&cli.StringFlag{Name: "log-format", Value: "json", Usage: "log format: json or console", Sources: env("LOG_FORMAT")},
			&cli.StringFlag{Name: "log-level", Value: "info", Usage: "log level: debug, info, warn, error", Sources: env("LOG_LEVEL")},
		},
		Commands: []*cli.Command{
			migrateCommand(d),
			runCommand(d),
			appCommand(d),
			consumerCommand(d),
			enqueueCommand(d),
			queuesCommand(d),
			deadCommand(d),
			demoCommand(d),
			setupDemoCommand(d),
			exampleConsumerCommand(d),
		},
	}
}

// logger builds the zerolog logger the flags ask for.
func (d *deps) logger(cmd *cli.Command) (zerolog.Logger, error) {
	level, err := zerolog.ParseLevel(cmd.String("log-level"))
	if err != nil || cmd.String("log-level") == "" {
		return zerolog.Logger{}, usagef("--log-level %q: use debug, info, warn or error", cmd.String("log-level"))
	}
	var w io.Writer
	switch cmd.String("log-format") {
	case "json":
		w = d.stderr
	case "console":
		w = zerolog.ConsoleWriter{Out: d.stderr, TimeFormat: "15:04:05.000"}
	default:
		return zerolog.Logger{}, usagef("--log-format %q: use json or console", cmd.String("log-format"))
	}
	return zerolog.New(w).Level(level).With().Timestamp().Logger(), nil
}

func nopLogger() zerolog.Logger { return zerolog.Nop() }

// poolConfig parses --database-url / DATABASE_URL.
func poolConfig(cmd *cli.Command) (*pgxpool.Config, error) {
	url := cmd.String("database-url")
	if url == "" {
		return nil, usagef("no database: set --database-url or DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, usagef("--database-url: %s", redactErr(err, url))
	}
	return cfg, nil
}

// redactErr keeps a connection string's password out of an error message.
func redactErr(err error, url string) string {
	msg := err.Error()
	if cfg, perr := pgx.ParseConfig(url); perr == nil && cfg.Password != "" {
		msg = strings.ReplaceAll(msg, cfg.Password, "xxxxx")
	}
	return msg
}

// client opens a pool and a Client for one command.
func client(ctx context.Context, cmd *cli.Command) (*bellhop.Client, *pgxpool.Pool, error) {
	cfg, err := poolConfig(cmd)
	if err != nil {
		return nil, nil, err
	}
	return openClient(ctx, cfg)
}

// openClient connects a pool and wraps it in a Client.
func openClient(ctx context.Context, cfg *pgxpool.Config) (*bellhop.Client, *pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, cfg.Copy())
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("connect to the database: %w", err)
	}
	return bellhop.NewClient(pool), pool, nil
}
