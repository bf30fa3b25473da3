// Command bellhop runs the Bellhop dispatcher as a service and operates it
// from the command line: migrations, apps, principals, consumers,
// enqueueing, queue and dead-letter inspection, and a one-command demo.
//
// Configuration comes from flags, then environment variables: DATABASE_URL
// for --database-url, and BELLHOP_<FLAG> for the logging flags, --app,
// --allowed-hosts and bellhop run's flags. A flag's help names its
// variable; other flags have none. A BELLHOP_ variable that is set but
// empty is refused, unless the command line gives its flag: unset it for
// the default. A bad configuration, a bad flag or input that
// can never succeed (an invalid name, payload or option, an unknown app or
// consumer) exits with status 2 and one line naming the problem; other
// failures (the database is unreachable, a conflict) exit with status 1.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
)

// buildCommit is the commit the binary was built from, for a build that
// cannot record it itself: the Dockerfile's, whose context leaves .git
// out, sets it with -ldflags "-X main.buildCommit=...". The linker writes
// it; nothing else does.
var buildCommit string

func main() {
	// Log timestamps to the millisecond: zerolog's default (RFC 3339 in
	// whole seconds) makes the console format's .000 always zero and
	// hides the ordering of a delivery's events.
	zerolog.TimeFieldFormat = "2006-01-02T15:04:05.000Z07:00"
	os.Exit(run(context.Background(), os.Args, os.Stdin, os.Stdout, os.Stderr))
}

// usageError marks configuration and flag errors: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// run is main without the process exit, so tests can drive it.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	// Every command stops on SIGINT, SIGTERM or SIGHUP by its context:
	// the statement it has in progress is cancelled on the server (client
	// sets cancelOnServer) and the command fails saying so. A command
	// killed by the signal instead left its statement running, to commit
	// once it got its lock (a `consumer rm` waiting on a row lock removed
	// the consumer 13 s after it "died" silently, in the CLI review). The
	// commands that stop gracefully (run, demo, migrate, ...) watch the
	// signals themselves too, with the same rules.
	ctx, stop := signalContext(ctx, nopLogger())
	defer stop()
	app := newApp(stdin, stdout, stderr)
	err := app.Run(ctx, args)
	if err == nil {
		return 0
	}
	// Errors from connecting may quote the connection string.
	shown := err
	if url := app.String("database-url"); url != "" {
		shown = pgdsn.RedactError(err, url)
	}
	msg := oneLine(shown)
	if isFlagError(err) {
		// The flag package writes one dash; the docs and --help write two.
		msg = singleDashFlag.ReplaceAllString(msg, "${1}--$2")
	}
	// "parse error" alone does not say what a switch takes.
	if m := flagParseRE.FindStringSubmatch(msg); m != nil && isBoolFlag(app, m[1]) {
		msg += ": use true or false"
	}
	if ctx.Err() != nil && !strings.Contains(msg, "interrupted") {
		msg += " (interrupted: a statement in progress was cancelled on the server, and rolled back unless it had committed)"
	}
	fmt.Fprintf(stderr, "bellhop: %s%s\n", msg, hint(err))
	if isUsage(err) {
		return 2
	}
	return 1
}

// hint suggests the likely fix for an error whose text alone would not
// tell: a missing table or function means the schema is not there. The
// library's errors that say so already (migrations.ErrNoSchema,
// migrations.ErrSchemaBehind, which keep the database's error in their
// chain) get none: the advice would be printed twice.
func hint(err error) string {
	if errors.Is(err, migrations.ErrNoSchema) || errors.Is(err, migrations.ErrSchemaBehind) {
		return ""
	}
	// 42P01 undefined_table, 42883 undefined_function
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42883") {
		return " (is the database migrated? run `bellhop migrate`)"
	}
	// 25006 read_only_sql_transaction
	if errors.As(err, &pgErr) && pgErr.Code == "25006" {
		return " (the server is read-only, as a hot standby is: connect to the primary, or add target_session_attrs=read-write to the connection string)"
	}
	return ""
}

// badInput are the library's errors for input that no retry can fix.
var badInput = []error{
	bellhop.ErrInvalidName, bellhop.ErrInvalidQueueName, bellhop.ErrInvalidPayload,
	bellhop.ErrPayloadTooLarge, bellhop.ErrInvalidOptions, bellhop.ErrUnknownApp,
	bellhop.ErrUnknownPrincipal, bellhop.ErrUnknownConsumer, bellhop.ErrUnknownMessage,
}

// isUsage reports whether err is the caller's mistake: exit status 2.
func isUsage(err error) bool {
	return isFlagError(err) || isBadInput(err)
}

// isBadInput reports whether err, from a command's action, refuses its
// input: the CLI's own usage errors and the library's badInput.
func isBadInput(err error) bool {
	var ue usageError
	if errors.As(err, &ue) {
		return true
	}
	for _, target := range badInput {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// oneLine folds a multi-line error into one line. pgx's connect errors
// put each attempt on an indented line after a colon, and sslmode=prefer
// (the default) makes two attempts that fail alike: repeats are dropped.
func oneLine(err error) string {
	var parts []string
	for _, l := range strings.Split(err.Error(), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || len(parts) > 0 && parts[len(parts)-1] == l {
			continue
		}
		parts = append(parts, l)
	}
	var b strings.Builder
	for i, p := range parts {
		switch {
		case i == 0:
		case strings.HasSuffix(parts[i-1], ":"):
			b.WriteString(" ")
		default:
			b.WriteString("; ")
		}
		b.WriteString(p)
	}
	return b.String()
}

// singleDashFlag finds a long flag named with one dash, or none, in the
// flag package's errors ("flag provided but not defined: -x", "invalid
// value ... for flag -x", and for a bad value from its environment
// variable "... for flag x").
var singleDashFlag = regexp.MustCompile(`(not defined: |for flag )-?(\w\w)`)

// isFlagError recognises the CLI library's own parse errors, which it
// gives no type to tell them by: only by their words, and so only among
// errors that no command's action returned. An action's error can hold
// the same words (a server's "invalid value for parameter", a database
// named "invalid value") and is not a flag error for that.
func isFlagError(err error) bool {
	var ae actionError
	if errors.As(err, &ae) {
		return false
	}
	s := err.Error()
	for _, p := range []string{"flag provided but not defined", "invalid value", "Required flag", "required flag",
		"No help topic", "flag needs an argument", "invalid boolean", "from environment variable"} {
		if strings.Contains(s, p) {
			return true
		}
	}
	return false
}

const envPrefix = "BELLHOP_"

// env is the source of a flag's BELLHOP_<name> variable.
func env(name string) cli.ValueSourceChain {
	return cli.NewValueSourceChain(envSource(envPrefix + name))
}

// envSource reads an environment variable as cli.EnvVar does, except that
// a variable set to the empty string gives the flag no value, and
// checkEmptyEnv refuses it. The CLI library skips an empty value for most
// kinds of flag (durations, numbers, lists: the default applies) and takes
// it for others (an empty string, false for a bool): either way it was
// silently not a setting, and BELLHOP_ALLOWED_HOSTS= from a deploy
// template whose variable was missing allowed every host.
type envSource string

// Lookup returns the variable's value, and whether it is set and not empty.
func (s envSource) Lookup() (string, bool) {
	v, ok := os.LookupEnv(string(s))
	return v, ok && v != ""
}

func (s envSource) String() string   { return fmt.Sprintf("environment variable %q", string(s)) }
func (s envSource) GoString() string { return fmt.Sprintf("envSource(%q)", string(s)) }

// IsFromEnv and Key make --help name the variable.
func (s envSource) IsFromEnv() bool { return true }
func (s envSource) Key() string     { return string(s) }

// flagName names a flag in an error about its value: its BELLHOP_
// variable when that holds the value, else --flag. The variable set it,
// unless the command line gave the same value, when either name is right;
// named as the flag, a value the user never typed sent them looking for
// it on the command line.
func flagName(flag string, holds func(env string) bool) string {
	key := envPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
	if v, ok := os.LookupEnv(key); ok && v != "" && holds(v) {
		return key
	}
	return "--" + flag
}

// sameString and sameDuration tell flagName whether a variable holds v.
func sameString(v string) func(string) bool { return func(e string) bool { return e == v } }

// sameList: the variable's comma-separated entries are v's, spaces
// around them aside.
func sameList(v []string) func(string) bool {
	return func(e string) bool {
		parts := strings.Split(e, ",")
		return slices.EqualFunc(parts, v, func(a, b string) bool { return strings.TrimSpace(a) == strings.TrimSpace(b) })
	}
}

func sameDuration(v time.Duration) func(string) bool {
	return func(e string) bool { d, err := time.ParseDuration(e); return err == nil && d == v }
}

// sameBool: the variable parses as v, as the flag reads it.
func sameBool(v bool) func(string) bool {
	return func(e string) bool { b, err := strconv.ParseBool(e); return err == nil && b == v }
}

// sourceNamed names, in err, the BELLHOP_ variable that gave a value the
// error quotes, right after the value: list queues: unknown app "nope"
// (from BELLHOP_APP). The library's errors, and some of the CLI's (no
// dead letter ... in app "shop"), quote a value without knowing where it
// came from, and an operator who had forgotten that BELLHOP_APP was set
// looked for it on the command line. Only errors that refuse the input,
// and only string flags of cmd itself that read a variable (env): other
// kinds of value (durations, lists, switches) are checked by the CLI,
// which names their variable (flagName), as do the root's flags, checked
// before any action; an error that names the variable already is left as
// it is. The value must be quoted after the flag's name (app "nope"): the
// same text may be another flag's value (--principal nope), given on the
// command line.
func sourceNamed(cmd *cli.Command, err error) error {
	if !isBadInput(err) {
		return err
	}
	msg := err.Error()
	for _, f := range cmd.Flags {
		sf, ok := f.(*cli.StringFlag)
		if !ok || len(sf.Sources.Chain) == 0 {
			continue
		}
		v := cmd.String(sf.Name)
		key := flagName(sf.Name, sameString(v))
		if !strings.HasPrefix(key, envPrefix) || strings.Contains(msg, key) {
			continue
		}
		if end := quotedEnd(msg, sf.Name+" ", v); end >= 0 {
			return renamedError{msg: msg[:end] + " (from " + key + ")" + msg[end:], err: err}
		}
	}
	return err
}

// quotedEnd returns where the first quotation of v in msg, right after
// label, ends, or -1 if msg does not quote it so. A value is quoted as
// validate.Shown quotes it, or, past 64 bytes, as the library cuts it
// ("<64 bytes>…").
func quotedEnd(msg, label, v string) int {
	shown, ok := validate.Redact(v)
	if !ok {
		return -1
	}
	forms := []string{label + validate.Shown(v)}
	if len(shown) > 64 {
		q := strconv.Quote(shown[:64])
		forms = append(forms, label+q[:len(q)-1]+`…"`)
	}
	start, end := -1, -1
	for _, q := range forms {
		if i := strings.Index(msg, q); i >= 0 && (start < 0 || i < start) {
			start, end = i, i+len(q)
		}
	}
	return end
}

// checkEmptyEnv refuses a BELLHOP_ variable that is set but empty, for a
// flag of cmd or of the commands above it that the command line does not
// give: unset, the flag has its default; empty, it is a mistake (a
// template's missing variable), not a way to ask for the default.
func checkEmptyEnv(cmd *cli.Command) error {
	for _, c := range cmd.Lineage() {
		for _, f := range c.Flags {
			df, ok := f.(cli.DocGenerationFlag)
			if !ok || f.IsSet() {
				continue
			}
			for _, key := range df.GetEnvVars() {
				if v, set := os.LookupEnv(key); set && v == "" && strings.HasPrefix(key, envPrefix) {
					return usagef("%s is set but empty; %s", key, emptyEnvAdvice(f.Names()[0]))
				}
			}
		}
	}
	return nil
}

// emptyEnvAdvice says what to do instead of leaving flag's variable empty.
func emptyEnvAdvice(flag string) string {
	switch flag {
	case "allowed-hosts":
		return "unset it to allow every host, or list the hosts"
	case "app":
		return "unset it, or name the app"
	}
	return fmt.Sprintf("unset it for the default of --%s, or give a value", flag)
}

// deps carries what commands share.
type deps struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *cli.Command {
	d := &deps{stdin: stdin, stdout: stdout, stderr: stderr}
	root := &cli.Command{
		Name:      "bellhop",
		Usage:     "a PostgreSQL-native durable queue with a push dispatcher",
		Writer:    stdout,
		ErrWriter: stderr,
		// Errors are printed once, by run, as one line.
		ExitErrHandler: func(context.Context, *cli.Command, error) {},
		// Every command checks the logging flags, so that a typo in
		// BELLHOP_LOG_FORMAT fails everywhere, not only in run.
		Before: func(ctx context.Context, cmd *cli.Command) (context.Context, error) {
			_, err := d.logger(cmd)
			return ctx, err
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
			principalCommand(d),
			consumerCommand(d),
			enqueueCommand(d),
			queuesCommand(d),
			deadCommand(d),
			messageCommand(d),
			demoCommand(d),
			setupDemoCommand(d),
			exampleConsumerCommand(d),
			versionCommand(d),
		},
	}
	strict(root)
	return root
}

// strict makes every command of the tree report a bad flag or a missing
// required flag as one line (the library's default prints the whole help
// and "Incorrect Usage", and only the root's OnUsageError would apply),
// refuses an empty BELLHOP_ variable (checkEmptyEnv) before any action,
// makes a command group refuse an unknown subcommand by name, and makes a
// command that takes no arguments (one without ArgsUsage) refuse any,
// which the library would otherwise ignore. It also marks what each
// action returns (actionError), so that it is not taken for a flag error,
// and names in it the variable that gave a value it quotes (sourceNamed).
func strict(cmd *cli.Command) {
	cmd.OnUsageError = func(_ context.Context, cmd *cli.Command, err error, _ bool) error {
		// The library names a missing flag without its dashes (Required
		// flag "app" not set), where every other message names it as
		// --help and the docs do; it gives the error no type to tell it
		// by, only its words.
		if strings.HasPrefix(err.Error(), "Required flag") {
			// BELLHOP_APP= is the likelier mistake than a missing --app.
			if err := checkEmptyEnv(cmd); err != nil {
				return err
			}
			if missing := missingFlags(cmd); len(missing) > 0 {
				return usageError{errors.New(requiredText(missing))}
			}
		}
		return usageError{err}
	}
	switch {
	case len(cmd.Commands) > 0 && cmd.Action == nil:
		cmd.Action = func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Present() {
				return usagef("unknown command %s (see %s --help)", validate.Shown(cmd.Args().First()), cmd.FullName())
			}
			return cli.ShowSubcommandHelp(cmd)
		}
	case len(cmd.Commands) == 0 && cmd.Action != nil && cmd.ArgsUsage == "":
		action := cmd.Action
		cmd.Action = func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Present() {
				return usagef("unexpected argument %s: %s takes no arguments (see %s --help)",
					validate.Shown(cmd.Args().First()), cmd.FullName(), cmd.FullName())
			}
			return action(ctx, cmd)
		}
	}
	if action := cmd.Action; action != nil {
		cmd.Action = func(ctx context.Context, cmd *cli.Command) error {
			if err := checkEmptyEnv(cmd); err != nil {
				return err
			}
			if err := action(ctx, cmd); err != nil {
				return actionError{sourceNamed(cmd, err)}
			}
			return nil
		}
	}
	for _, sub := range cmd.Commands {
		strict(sub)
	}
}

// flagParseRE finds the flag in the library's error for a value it could
// not parse, from the command line or the environment.
var flagParseRE = regexp.MustCompile(`for flag --([a-z0-9-]+): parse error$`)

// isBoolFlag reports whether name is a bool flag of cmd or of a command
// below it.
func isBoolFlag(cmd *cli.Command, name string) bool {
	for _, f := range cmd.Flags {
		if _, ok := f.(*cli.BoolFlag); ok && slices.Contains(f.Names(), name) {
			return true
		}
	}
	for _, sub := range cmd.Commands {
		if isBoolFlag(sub, name) {
			return true
		}
	}
	return false
}

// missingFlags names, with their dashes, the required flags of cmd and of
// the commands above it that are not set: those the library checks.
func missingFlags(cmd *cli.Command) []string {
	var missing []string
	for _, c := range cmd.Lineage() {
		for _, f := range c.Flags {
			if rf, ok := f.(cli.RequiredFlag); ok && rf.IsRequired() && !f.IsSet() {
				missing = append(missing, "--"+f.Names()[0])
			}
		}
	}
	return missing
}

// requiredText is the error for missing required flags: "--app is
// required", "--queue, --url and --secret-file are required".
func requiredText(missing []string) string {
	if len(missing) == 1 {
		return missing[0] + " is required"
	}
	return strings.Join(missing[:len(missing)-1], ", ") + " and " + missing[len(missing)-1] + " are required"
}

// actionError marks an error that a command's action returned, as against
// one from parsing the command line (isFlagError).
type actionError struct{ err error }

func (e actionError) Error() string { return e.err.Error() }
func (e actionError) Unwrap() error { return e.err }

// logger builds the zerolog logger the flags ask for.
func (d *deps) logger(cmd *cli.Command) (zerolog.Logger, error) {
	// zerolog knows more levels; "disabled", "fatal" and "panic" would
	// hide the errors, and "trace" is never written.
	level, ok := map[string]zerolog.Level{
		"debug": zerolog.DebugLevel, "info": zerolog.InfoLevel, "warn": zerolog.WarnLevel, "error": zerolog.ErrorLevel,
	}[strings.ToLower(cmd.String("log-level"))]
	if !ok {
		v := cmd.String("log-level")
		return zerolog.Logger{}, usagef("%s %q: use debug, info, warn or error", flagName("log-level", sameString(v)), v)
	}
	var w io.Writer
	// In any case, as the level is: a deployment that writes
	// BELLHOP_LOG_LEVEL=INFO writes BELLHOP_LOG_FORMAT=JSON beside it.
	switch strings.ToLower(cmd.String("log-format")) {
	case "json":
		w = d.stderr
	case "console":
		// Colours only on a terminal: in a file, a pipe or a container's
		// log (docker-compose sets console) they are escape codes.
		w = zerolog.ConsoleWriter{Out: d.stderr, TimeFormat: "2006-01-02 15:04:05.000", NoColor: !isTerminal(d.stderr)}
	default:
		v := cmd.String("log-format")
		return zerolog.Logger{}, usagef("%s %q: use json or console", flagName("log-format", sameString(v)), v)
	}
	return zerolog.New(w).Level(level).With().Timestamp().Logger(), nil
}

func nopLogger() zerolog.Logger { return zerolog.Nop() }

// isTerminal reports whether w is a character device, as a terminal is.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// poolConfig parses --database-url / DATABASE_URL.
func poolConfig(cmd *cli.Command) (*pgxpool.Config, error) {
	url := cmd.String("database-url")
	if url == "" {
		return nil, usagef("no database: set --database-url or DATABASE_URL")
	}
	return parsePoolConfig(url)
}

// parsePoolConfig parses a connection string, keeping its password out of
// the error.
func parsePoolConfig(url string) (*pgxpool.Config, error) {
	// pgx reads any other scheme as keyword/value settings, and its error
	// hides the whole string, scheme included.
	if m := urlScheme.FindStringSubmatch(url); m != nil && m[1] != "postgres" && m[1] != "postgresql" {
		return nil, usagef("--database-url: scheme %q: use postgres:// or postgresql:// (or keyword/value settings, host=... dbname=...)", m[1])
	}
	// Before parsing: pgx may refuse such a string for a password's
	// start read as the port, and that error would not name the cause.
	if err := pgdsn.CheckURL(url); err != nil {
		return nil, usagef("--database-url: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		// pgx hides the whole string, which may hold a password: say
		// what it should have been.
		hint := ""
		if !strings.Contains(url, "://") && !strings.Contains(url, "=") {
			hint = " (give a postgres:// URL, or keyword/value settings such as host=db dbname=app)"
		}
		return nil, usagef("--database-url: %s%s%s", redactErr(err, url), hint, pgEnvHint())
	}
	if err := pgdsn.CheckHosts(&cfg.ConnConfig.Config); err != nil {
		return nil, usagef("--database-url: %v", err)
	}
	// A server that accepts connections and never answers (a wedged
	// proxy) held every command until the kernel gave up, minutes later.
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	return cfg, nil
}

// urlScheme finds a URL's scheme: RFC 3986's characters, then "://".
var urlScheme = regexp.MustCompile(`^([A-Za-z][A-Za-z0-9+.-]*)://`)

// pgEnv are the environment variables that pgx reads into connection
// settings (pgconn's parseEnvSettings).
var pgEnv = []string{
	"PGAPPNAME", "PGCHANNELBINDING", "PGCONNECT_TIMEOUT", "PGDATABASE", "PGHOST",
	"PGMAXPROTOCOLVERSION", "PGMINPROTOCOLVERSION", "PGOPTIONS", "PGPASSFILE", "PGPASSWORD",
	"PGPORT", "PGREQUIREAUTH", "PGSERVICE", "PGSERVICEFILE", "PGSSLCERT", "PGSSLCERTMODE",
	"PGSSLKEY", "PGSSLMODE", "PGSSLNEGOTIATION", "PGSSLPASSWORD", "PGSSLROOTCERT", "PGSSLSNI",
	"PGTARGETSESSIONATTRS", "PGTZ", "PGUSER",
}

// pgEnvHint names those of pgEnv that are set, since an error about one
// (PGCONNECT_TIMEOUT=abc: "invalid connect_timeout") quotes a connection
// string without it. Values are not shown: PGPASSWORD is one of them.
func pgEnvHint() string {
	var set []string
	for _, name := range pgEnv {
		if _, ok := os.LookupEnv(name); ok {
			set = append(set, name)
		}
	}
	if len(set) == 0 {
		return ""
	}
	return " (also read from the environment: " + strings.Join(set, ", ") + ")"
}

// defaultConnectTimeout bounds each connection attempt of a command, the
// daemon's included, unless the connection string sets a positive
// connect_timeout. pgx parses an explicit 0 (libpq's "wait forever") to
// the same zero as none, so 0 gets the default too; a daemon waiting
// forever on a dead address would never report it.
const defaultConnectTimeout = 10 * time.Second

// redactErr keeps a connection string's password out of an error message.
// The string is mostly one that did not parse, so its password cannot be
// taken from a parsed config: pgdsn finds it in the text.
func redactErr(err error, url string) string {
	return pgdsn.RedactError(err, url).Error()
}

// client opens a pool and a Client for one command. Its statements are
// cancelled on the server when ctx ends (run ends it on a stop signal).
func client(ctx context.Context, cmd *cli.Command) (*bellhop.Client, *pgxpool.Pool, error) {
	cfg, err := poolConfig(cmd)
	if err != nil {
		return nil, nil, err
	}
	cfg.ConnConfig.BuildContextWatcherHandler = cancelOnServer
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
