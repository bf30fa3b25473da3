package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
)

func migrateCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "migrate",
		Usage: "apply the database migrations (idempotent; safe to run from several processes at once)",
		Action: func(ctx context.Context, cmd *cli.Command) error {
			cfg, err := poolConfig(cmd)
			if err != nil {
				return err
			}
			// SIGINT, SIGTERM or SIGHUP cancels the statement in progress on the
			// server (a cancel request), and its transaction rolls back;
			// a second signal (not another stop signal within a second of
			// the first: signalContext) exits at once. Without it, the process died
			// and left its backend queued for the ACCESS EXCLUSIVE lock a
			// migration takes, which blocks every producer behind it
			// until the lock is granted.
			ctx, stop := signalContext(ctx, nopLogger())
			defer stop()
			cc := cfg.ConnConfig.Copy()
			cc.BuildContextWatcherHandler = cancelOnServer
			conn, err := pgx.ConnectConfig(ctx, cc)
			if err != nil {
				return interruptedBefore(ctx, fmt.Errorf("connect to the database: %w", err), "connecting to the database", "nothing was applied")
			}
			defer conn.Close(context.Background())
			// A migration waiting for a lock is otherwise silent for up
			// to LockPatience.
			waiting := migrations.OnLockWait(func(file string, patience time.Duration) {
				fmt.Fprintf(d.stderr, "bellhop: %s is waiting for a lock that another transaction holds (see pg_stat_activity); "+
					"trying again for up to %s\n", file, patience)
			})
			if err := migrations.Migrate(ctx, conn, waiting); err != nil {
				if ctx.Err() != nil {
					return fmt.Errorf("interrupted: %w; the migration in progress was rolled back, those before it stay applied: run `bellhop migrate` again", err)
				}
				return err
			}
			latest, err := migrations.Latest()
			if err != nil {
				return err
			}
			v, err := migrations.Current(ctx, conn)
			if err != nil {
				return err
			}
			if open, user, err := migrations.PublicSchemaOpen(ctx, conn); err != nil {
				return err
			} else if open {
				fmt.Fprintf(d.stderr, "bellhop: warning: every role may create objects in schema public, where Bellhop's are, "+
					"and so run code as Bellhop's roles; as the schema's owner run GRANT CREATE ON SCHEMA public TO %s; "+
					"REVOKE CREATE ON SCHEMA public FROM PUBLIC (docs/roles.sql does both)\n", pgx.Identifier{user}.Sanitize())
			} else if creators, err := migrations.PublicSchemaCreators(ctx, conn); err != nil {
				return err
			} else {
				me := pgx.Identifier{user}.Sanitize()
				if len(creators.Granted) > 0 {
					fix := "revoke the grant from the role that holds it"
					if len(creators.Grantees) > 0 {
						fix = "run REVOKE CREATE ON SCHEMA public FROM " + quoteRoles(creators.Grantees)
					}
					fmt.Fprintf(d.stderr, "bellhop: warning: %s may create objects in schema public, where Bellhop's are, by a grant "+
						"(its own, or of a role it is a member of), and so run code as %s, which owns them; give each a schema of its own "+
						"and, as the schema's owner, %s\n", quoteRoles(creators.Granted), me, fix)
				}
				if owners := creators.Owners; len(owners) > 0 {
					fmt.Fprintf(d.stderr, "bellhop: warning: %s may create objects in schema public, where Bellhop's are, as its owner "+
						"(or a member of its owner; from PostgreSQL 15 on, the database's owner owns it), and so run code as %s, "+
						"which owns them; migrate as the database's owner, or have a superuser run ALTER SCHEMA public OWNER TO %s\n",
						quoteRoles(owners), me, me)
				}
			}
			// An index of a migration already run that a failed build
			// left invalid: nothing migrate does mends it, and claims
			// read without it.
			if invalid, err := migrations.InvalidIndexes(ctx, conn); err != nil {
				return err
			} else {
				for _, x := range invalid {
					fmt.Fprintf(d.stderr, "bellhop: warning: index %s is invalid (a CREATE INDEX CONCURRENTLY or REINDEX of it failed), so no query uses it; %s\n", x.Name, x.Fix())
				}
			}
			if v > latest {
				fmt.Fprintf(d.stdout, "database schema is at version %d, newer than this bellhop's %d: nothing to apply\n", v, latest)
				return nil
			}
			// The version counts the files applied; the last one's name
			// is what the README's upgrade notes refer to.
			fmt.Fprintf(d.stdout, "database is at schema version %d (%s)\n", v, migrations.Name(v))
			return nil
		},
	}
}

// interruptedBefore is err, unless ctx was cancelled (a stop signal):
// then it says that the command was interrupted while doing what, and
// what it left unchanged, as the exit status 1 alone would not say that
// retrying is safe. The cancelled step's own error ("context canceled")
// would tell neither.
func interruptedBefore(ctx context.Context, err error, doing, unchanged string) error {
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted while %s: %s", doing, unchanged)
	}
	return err
}

// cancelOnServer makes a cancelled context cancel the connection's
// statement on the server: pgx sends a cancel request, and closes the
// connection only if the server has not answered within 5 s. pgx's
// default closes the connection at once and sends the cancel request from
// a goroutine, which the command's exit right after can cut short; a
// backend waiting for a lock does not notice a closed connection.
func cancelOnServer(pgConn *pgconn.PgConn) ctxwatch.Handler {
	return &pgconn.CancelRequestContextWatcherHandler{Conn: pgConn, DeadlineDelay: 5 * time.Second}
}

func appCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "app",
		Usage: "create and list apps",
		Commands: []*cli.Command{{
			Name:      "create",
			Usage:     "create an app (and its \"default\" principal)",
			ArgsUsage: "NAME",
			Action: func(ctx context.Context, cmd *cli.Command) error {
				name, err := oneArg(cmd, "NAME")
				if err != nil {
					return err
				}
				// Checked before connecting, as CreateApp checks it, so
				// that a bad name is named even with the database away.
				if err := validate.Name("app", name); err != nil {
					return fmt.Errorf("create app: %w", err)
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				a, err := c.CreateApp(ctx, name)
				if err != nil {
					return err
				}
				fmt.Fprintf(d.stdout, "app %s created: id %s\ndefault principal: id %s\n", a.Name, a.ID, a.DefaultPrincipal)
				return nil
			},
		}, {
			Name:  "ls",
			Usage: "list apps",
			Action: func(ctx context.Context, cmd *cli.Command) error {
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				apps, err := c.Apps(ctx)
				if err != nil {
					return err
				}
				tw := tabwriter.NewWriter(d.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "NAME\tID\tCREATED")
				for _, a := range apps {
					fmt.Fprintf(tw, "%s\t%s\t%s\n", a.Name, a.ID, a.CreatedAt.UTC().Format(time.RFC3339))
				}
				return tw.Flush()
			},
		}},
	}
}

// deadCursor parses dead ls --after: ID:SOURCE, or ID alone; "" is none.
func deadCursor(s string) (uuid.UUID, string, error) {
	if s == "" {
		return uuid.Nil, "", nil
	}
	idText, source, _ := strings.Cut(s, ":")
	id, err := uuid.Parse(idText)
	if err != nil || id == uuid.Nil || (source != "" && source != "queue" && source != "invoke") {
		return uuid.Nil, "", usagef("--after %s: not a dead letter, given as ID:SOURCE (SOURCE queue or invoke) or ID", validate.Shown(s))
	}
	return id, source, nil
}

// deadAt finds the dead letter that --after names, for its place in the
// listing: by id, and by source if given, which it must be when a message
// and an invoke delivery share the id.
func deadAt(ctx context.Context, c *bellhop.Client, app string, id uuid.UUID, source string) (*bellhop.DeadLetter, error) {
	ds, err := c.DeadLetters(ctx, bellhop.DeadFilter{App: app, ID: id, Limit: 2, OmitPayload: true})
	if err != nil {
		return nil, err
	}
	ds = slices.DeleteFunc(ds, func(x bellhop.DeadLetter) bool { return source != "" && x.Source != source })
	switch len(ds) {
	case 0:
		return nil, usagef("--after: no dead letter %s in app %q (redriven or purged since it was listed?); list again from the newest", id, app)
	case 1:
		return &ds[0], nil
	}
	return nil, usagef("--after %s: a message and an invoke delivery share this id: give %s:queue or %s:invoke", id, id, id)
}

// principalCommand lists principals, which `consumer add --principal`
// names; apps make their "default" one, and the Go client's
// CreatePrincipal the others.
func principalCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "principal",
		Usage: "list principals (an app's identities that register consumers and enqueue)",
		Commands: []*cli.Command{{
			Name:  "ls",
			Usage: "list principals, by app and name",
			Flags: []cli.Flag{&cli.StringFlag{Name: "app", Usage: "only this app's", Sources: env("APP")}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				ps, err := c.Principals(ctx, cmd.String("app"))
				if err != nil {
					return err
				}
				tw := tabwriter.NewWriter(d.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "APP\tNAME\tID\tCREATED")
				for _, p := range ps {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", p.App, p.Name, p.ID, p.CreatedAt.UTC().Format(time.RFC3339))
				}
				return tw.Flush()
			},
		}},
	}
}

func oneArg(cmd *cli.Command, what string) (string, error) {
	if cmd.Args().Len() != 1 {
		// Without the program's name, which the error's prefix gives.
		name := strings.Join(cmd.Path()[1:], " ")
		return "", usagef("%s takes exactly one argument, %s (see %s --help)", name, what, cmd.FullName())
	}
	return cmd.Args().First(), nil
}

// allowedHosts reads --allowed-hosts (or BELLHOP_ALLOWED_HOSTS) and
// refuses an entry that can never match, and a list of blank entries,
// which httppush would take as allowing no host at all. An empty
// BELLHOP_ALLOWED_HOSTS, which would leave the list unset (every host
// allowed), is refused before, by checkEmptyEnv.
func allowedHosts(cmd *cli.Command) ([]string, error) {
	hosts := cmd.StringSlice("allowed-hosts")
	if err := httppush.CheckAllowedHosts(hosts); err != nil {
		return nil, usagef("%s: %w", flagName("allowed-hosts", sameList(hosts)), err)
	}
	return hosts, nil
}

// checkPushURL refuses a --url that the library would refuse, or that the
// daemon would not push to under these allowed hosts, naming the flag. A
// refusal by the allowed hosts names where they came from (hostsFrom,
// flagName's): from BELLHOP_ALLOWED_HOSTS, a list the user did not type
// sent them looking for it on the command line.
func checkPushURL(url string, hosts []string, hostsFrom string) error {
	if err := validate.PushURL(url); err != nil {
		return usagef("--url: %w", err)
	}
	if err := httppush.New(httppush.Options{AllowedHosts: hosts}).CheckURL(url); err != nil {
		if len(hosts) > 0 && httppush.New(httppush.Options{}).CheckURL(url) == nil {
			return usagef("--url: %w (allowed hosts from %s)", err, hostsFrom)
		}
		return usagef("--url: %w", err)
	}
	return nil
}

// checkAppFlag refuses an --app that can name no app, before connecting,
// so that it is named even with the database away, and by the variable
// that set it if one did.
func checkAppFlag(cmd *cli.Command) error {
	app := cmd.String("app")
	if err := validate.Name("app", app); err != nil {
		return usagef("%s: %w", flagName("app", sameString(app)), err)
	}
	return nil
}

// Consumer flag defaults are the library's defaults.
func consumerSettingFlags(withDefaults bool) []cli.Flag {
	def := func(v time.Duration) time.Duration {
		if withDefaults {
			return v
		}
		return 0
	}
	defInt := func(v int) int {
		if withDefaults {
			return v
		}
		return 0
	}
	// An update changes only the flags given, so its flags show no
	// default; --timeout describes its default in words.
	hide := !withDefaults
	timeoutUsage := "HTTP request timeout (default: the visibility timeout less a fifth, at most 5s less)"
	if !withDefaults {
		timeoutUsage = "HTTP request timeout; 0s restores the default (the visibility timeout less a fifth, at most 5s less)"
	}
	return []cli.Flag{
		&cli.DurationFlag{Name: "visibility-timeout", Value: def(bellhop.DefaultVisibilityTimeout), HideDefault: hide, Usage: "lease on a delivered message (whole seconds, 1s to 12h)"},
		&cli.IntFlag{Name: "max-attempts", Value: defInt(bellhop.DefaultMaxAttempts), HideDefault: hide, Usage: "deliveries before a message is dead-lettered (1 to 1000), for messages enqueued from now on without their own --max-attempts, with bellhop enqueue, the Go client or the enqueue() SQL function; messages already queued keep theirs, redriven ones too, and a plain INSERT gets the column default, 3"},
		&cli.DurationFlag{Name: "backoff-min", Value: def(bellhop.DefaultBackoffBase), HideDefault: hide, Usage: "retry delay after the first failure, doubling per attempt; up to half of each delay is taken off as jitter"},
		&cli.DurationFlag{Name: "backoff-max", Value: def(bellhop.DefaultBackoffCap), HideDefault: hide, Usage: "longest retry delay (by default, at least --backoff-min)"},
		&cli.IntFlag{Name: "max-in-flight", Value: defInt(bellhop.DefaultMaxInFlight), HideDefault: hide, Usage: "deliveries at once, per dispatcher process"},
		&cli.DurationFlag{Name: "timeout", HideDefault: true, Usage: timeoutUsage},
	}
}

// checkGivenSettings refuses a zero or negative consumer setting that was
// given explicitly: the library reads zero as "the default", so without
// this `--max-attempts 0` would silently register 5 attempts.
func checkGivenSettings(cmd *cli.Command) error {
	for _, name := range []string{"visibility-timeout", "backoff-min", "backoff-max"} {
		if cmd.IsSet(name) && cmd.Duration(name) <= 0 {
			return usagef("--%s %s: must be positive", name, cmd.Duration(name))
		}
	}
	// Worded as enqueue's --max-attempts and dead ls's --limit are.
	for _, f := range []struct {
		name string
		max  int
	}{{"max-attempts", validate.MaxAttempts}, {"max-in-flight", validate.MaxInFlight}} {
		if n := cmd.Int(f.name); cmd.IsSet(f.name) && (n <= 0 || n > f.max) {
			return usagef("--%s %d: must be 1 to %d", f.name, n, f.max)
		}
	}
	if cmd.IsSet("timeout") && cmd.Duration("timeout") < 0 {
		return usagef("--timeout %s: must not be negative", cmd.Duration("timeout"))
	}
	return nil
}

// settingFlags rewrites the names the library's errors give a consumer's
// settings ("backoff base 0s is outside 1ms..24h0m0s") as the flags that
// set them. The library checks the settings, some against the consumer's
// stored ones in the same transaction as the update: naming its errors'
// settings here keeps one set of checks and limits.
var settingFlags = strings.NewReplacer(
	"backoff base", "--backoff-min",
	"backoff cap", "--backoff-max",
	"push timeout", "--timeout",
	"visibility timeout", "--visibility-timeout",
	"max attempts", "--max-attempts",
	"max in-flight", "--max-in-flight",
	"keep previous secret", "--keep-previous",
)

// flagNamed returns an ErrInvalidOptions error from registering or
// updating a consumer with its settings named as flags (settingFlags);
// it still unwraps to err. Other errors are returned as they are.
func flagNamed(err error) error {
	if !errors.Is(err, bellhop.ErrInvalidOptions) {
		return err
	}
	return renamedError{msg: settingFlags.Replace(err.Error()), err: err}
}

// whenFlags rewrites the names validate.DeliverAt's errors give a
// message's time of delivery ("delay 87601h0m0s is more than the limit",
// "deliver-after 2199-01-02T15:04:05Z is ...") as enqueue's flags that set
// it, keeping the library's one set of checks and limits, as
// settingFlags does for a consumer's settings.
var whenFlags = strings.NewReplacer(": delay ", ": --delay ", ": deliver-after ", ": --at ")

// whenNamed returns an ErrInvalidOptions error of validate.DeliverAt with the
// time of delivery named as enqueue's flags (whenFlags); it still unwraps
// to err. Other errors are returned as they are.
func whenNamed(err error) error {
	if !errors.Is(err, bellhop.ErrInvalidOptions) {
		return err
	}
	return renamedError{msg: whenFlags.Replace(err.Error()), err: err}
}

// renamedError is err with its text reworded.
type renamedError struct {
	msg string
	err error
}

func (e renamedError) Error() string { return e.msg }
func (e renamedError) Unwrap() error { return e.err }

// defaultKeepPrevious is how long `consumer rotate-secret` keeps the old
// secret signing unless told: a day, for a receiver's deploy.
const defaultKeepPrevious = 24 * time.Hour

func consumerCommand(d *deps) *cli.Command {
	appFlag := &cli.StringFlag{Name: "app", Usage: "app name (required)", Required: true, Sources: env("APP")}
	// idArg reads the consumer's id and checks --app, which every command
	// that takes an id has, before connecting.
	idArg := func(cmd *cli.Command) (uuid.UUID, error) {
		s, err := oneArg(cmd, "CONSUMER_ID")
		if err != nil {
			return uuid.Nil, err
		}
		id, err := uuid.Parse(s)
		if err != nil {
			return uuid.Nil, usagef("consumer id %s is not a UUID", validate.Shown(s))
		}
		return id, checkAppFlag(cmd)
	}
	setEnabled := func(enabled bool) cli.ActionFunc {
		return func(ctx context.Context, cmd *cli.Command) error {
			id, err := idArg(cmd)
			if err != nil {
				return err
			}
			c, pool, err := client(ctx, cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := c.SetConsumerEnabled(ctx, cmd.String("app"), id, enabled); err != nil {
				return err
			}
			// Said, as add and update say theirs: a script's log, or a
			// user who typed the wrong command, sees which state it is in.
			state := "paused"
			if enabled {
				state = "resumed"
			}
			fmt.Fprintf(d.stdout, "consumer %s %s\n", id, state)
			return nil
		}
	}
	return &cli.Command{
		Name:  "consumer",
		Usage: "register and manage HTTP push consumers",
		Commands: []*cli.Command{{
			Name:  "add",
			Usage: "register the consumer of a queue; prints its id and signing secret (shown once)",
			Flags: append([]cli.Flag{appFlag,
				&cli.StringFlag{Name: "queue", Usage: "queue name (required)", Required: true},
				&cli.StringFlag{Name: "url", Usage: "http(s) URL that receives each message as a POST (required)", Required: true},
				&cli.StringFlag{Name: "principal", Usage: "registering principal (default: the app's \"default\")"},
				&cli.StringSliceFlag{Name: "allowed-hosts", Usage: "if set, the URL's host must match one of these (exact, or *.suffix)", Sources: env("ALLOWED_HOSTS")},
			}, consumerSettingFlags(true)...),
			Action: func(ctx context.Context, cmd *cli.Command) error {
				if err := checkGivenSettings(cmd); err != nil {
					return err
				}
				if err := checkAppFlag(cmd); err != nil {
					return err
				}
				// Empty is the app's "default".
				if p := cmd.String("principal"); p != "" {
					if err := validate.Name("principal", p); err != nil {
						return usagef("--principal: %w", err)
					}
				}
				hosts, err := allowedHosts(cmd)
				if err != nil {
					return err
				}
				if err := checkPushURL(cmd.String("url"), hosts, flagName("allowed-hosts", sameList(hosts))); err != nil {
					return err
				}
				if err := validate.QueueName(cmd.String("queue")); err != nil {
					return usagef("--queue: %w", err)
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				// Unless given, the cap is left to the library, which raises
				// its default to a larger --backoff-min.
				backoffCap := time.Duration(0)
				if cmd.IsSet("backoff-max") {
					backoffCap = cmd.Duration("backoff-max")
				}
				con, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{
					App: cmd.String("app"), Queue: cmd.String("queue"), Principal: cmd.String("principal"),
					URL: cmd.String("url"), Timeout: cmd.Duration("timeout"),
					MaxAttempts: int(cmd.Int("max-attempts")), BackoffBase: cmd.Duration("backoff-min"),
					BackoffCap: backoffCap, VisibilityTimeout: cmd.Duration("visibility-timeout"),
					MaxInFlight: int(cmd.Int("max-in-flight")),
				})
				if err != nil {
					return flagNamed(err)
				}
				fmt.Fprintf(d.stdout, "consumer %s registered for %s/%s\n", con.ID, con.App, con.Queue)
				fmt.Fprintf(d.stdout, "signing secret (shown only now): %s\n", con.Secret)
				return nil
			},
		}, {
			Name:  "ls",
			Usage: "list consumers",
			Flags: []cli.Flag{&cli.StringFlag{Name: "app", Usage: "only this app's", Sources: env("APP")}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				cs, err := c.Consumers(ctx, cmd.String("app"))
				if err != nil {
					return err
				}
				tw := tabwriter.NewWriter(d.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tAPP\tQUEUE\tENABLED\tURL\tTIMEOUT\tVISIBILITY\tATTEMPTS\tBACKOFF\tIN-FLIGHT\tLAST FIRED")
				for _, x := range cs {
					last := "-"
					if x.LastFiredAt != nil {
						last = x.LastFiredAt.UTC().Format(time.RFC3339)
					}
					url := printable.Line(x.URL) // registered before URLs had to be printable
					// The push request's timeout: a Go handler has none.
					timeout := "-"
					switch {
					case url == "":
						url = "(go handler)"
					case x.Timeout > 0:
						timeout = x.Timeout.String()
					default:
						timeout = "default"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%s\t%s\t%s\t%d\t%s..%s\t%d\t%s\n", x.ID, x.App, x.Queue, x.Enabled, url, timeout,
						x.VisibilityTimeout, x.MaxAttempts, x.BackoffBase, x.BackoffCap, x.MaxInFlight, last)
				}
				return tw.Flush()
			},
		}, {
			Name:      "update",
			Usage:     "change a consumer's settings (only the flags given)",
			ArgsUsage: "CONSUMER_ID",
			Flags: append([]cli.Flag{appFlag,
				&cli.StringFlag{Name: "url", Usage: "new URL"},
				&cli.StringSliceFlag{Name: "allowed-hosts", Usage: "if set, the URL's host must match one of these", Sources: env("ALLOWED_HOSTS")},
			}, consumerSettingFlags(false)...),
			Action: func(ctx context.Context, cmd *cli.Command) error {
				id, err := idArg(cmd)
				if err != nil {
					return err
				}
				// Before connecting, as add checks them: the library
				// checks the settings too, but only once connected.
				if err := checkGivenSettings(cmd); err != nil {
					return err
				}
				hosts, err := allowedHosts(cmd)
				if err != nil {
					return err
				}
				var u bellhop.ConsumerUpdate
				if cmd.IsSet("url") {
					url := cmd.String("url")
					if err := checkPushURL(url, hosts, flagName("allowed-hosts", sameList(hosts))); err != nil {
						return err
					}
					u.URL = &url
				}
				dur := func(name string) *time.Duration {
					if !cmd.IsSet(name) {
						return nil
					}
					v := cmd.Duration(name)
					return &v
				}
				num := func(name string) *int {
					if !cmd.IsSet(name) {
						return nil
					}
					v := int(cmd.Int(name))
					return &v
				}
				u.VisibilityTimeout, u.BackoffBase, u.BackoffCap, u.Timeout = dur("visibility-timeout"), dur("backoff-min"), dur("backoff-max"), dur("timeout")
				u.MaxAttempts, u.MaxInFlight = num("max-attempts"), num("max-in-flight")
				if u == (bellhop.ConsumerUpdate{}) {
					return usagef("nothing to update: give --url or a setting flag (see %s --help)", cmd.FullName())
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				if err := c.UpdateConsumer(ctx, cmd.String("app"), id, u); err != nil {
					return flagNamed(err)
				}
				fmt.Fprintf(d.stdout, "consumer %s updated\n", id)
				return nil
			},
		}, {
			Name:      "rotate-secret",
			Usage:     "give a push consumer a new signing secret (shown once); the old one signs too for --keep-previous",
			ArgsUsage: "CONSUMER_ID",
			Flags: []cli.Flag{appFlag,
				&cli.DurationFlag{Name: "keep-previous", Value: defaultKeepPrevious,
					Usage: "how long requests also carry a signature under the old secret, so that receivers can move to the new one meanwhile (at most " +
						bellhop.MaxKeepPreviousSecret.String() + "; 0 drops it at once, for a secret that may have leaked)"},
			},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				id, err := idArg(cmd)
				if err != nil {
					return err
				}
				keep := cmd.Duration("keep-previous")
				if keep < 0 || keep > bellhop.MaxKeepPreviousSecret || keep%time.Millisecond != 0 {
					return usagef("--keep-previous %s: must be 0 to %s, in whole milliseconds", keep, bellhop.MaxKeepPreviousSecret)
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				con, err := c.RotateConsumerSecret(ctx, cmd.String("app"), id, keep)
				if err != nil {
					return flagNamed(err)
				}
				fmt.Fprintf(d.stdout, "consumer %s of %s/%s has a new signing secret\n", con.ID, con.App, con.Queue)
				fmt.Fprintf(d.stdout, "signing secret (shown only now): %s\n", con.Secret)
				if con.PreviousSecretUntil.IsZero() {
					fmt.Fprintln(d.stdout, "the previous secret no longer signs: requests sent from the daemons' next reload on carry only the new one's signature")
				} else {
					fmt.Fprintf(d.stdout, "the previous secret signs too until %s\n", con.PreviousSecretUntil.UTC().Format(time.RFC3339))
				}
				return nil
			},
		}, {
			Name: "pause", Usage: "stop deliveries to a consumer (messages stay queued)", ArgsUsage: "CONSUMER_ID",
			Flags: []cli.Flag{appFlag}, Action: setEnabled(false),
		}, {
			Name: "resume", Usage: "resume deliveries to a paused consumer", ArgsUsage: "CONSUMER_ID",
			Flags: []cli.Flag{appFlag}, Action: setEnabled(true),
		}, {
			Name: "rm", Usage: "remove a consumer (its queue's messages and dead letters stay; its pending invoke deliveries are deleted)", ArgsUsage: "CONSUMER_ID",
			Flags: []cli.Flag{appFlag},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				id, err := idArg(cmd)
				if err != nil {
					return err
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				if err := c.RemoveConsumer(ctx, cmd.String("app"), id); err != nil {
					return err
				}
				fmt.Fprintf(d.stdout, "consumer %s removed\n", id)
				return nil
			},
		}},
	}
}

// streamBatch bounds a batch of `enqueue -`: it goes to the database, as
// one statement, once it holds lines messages or its payloads bytes bytes.
// Every batch of a stream shares one transaction.
type streamBatch struct {
	lines, bytes int
}

// The batch of `enqueue -`: at most enqueueBatchLines lines, and its
// payloads go once they reach enqueueBatchBytes. The lines alone let 500
// payloads of up to 1 MiB make one batch: 2.5 GB of memory for the lines,
// their copies and the statement's arguments, and a 520 MB bind message,
// which the server holds whole too. 8 MiB keeps a batch of large payloads
// to tens of MB on either side, and is still 500 typical payloads of a few
// KB, which keep their batches of 500 lines.
const (
	enqueueBatchLines = 500
	enqueueBatchBytes = 8 << 20
)

// maxLine bounds one stdin line: twice the payload limit leaves room for
// surrounding white space, and a longer line cannot be a payload.
const maxLine = 2 * validate.MaxPayloadBytes

func enqueueCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:      "enqueue",
		Usage:     "enqueue one JSON message, or with - one JSON value per line from stdin (all or nothing)",
		ArgsUsage: "JSON|-",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "app", Usage: "app name (required)", Required: true, Sources: env("APP")},
			&cli.StringFlag{Name: "queue", Usage: "queue name (required)", Required: true},
			&cli.DurationFlag{Name: "delay", Usage: "deliver after this long"},
			&cli.StringFlag{Name: "at", Usage: "deliver at this time (RFC 3339, e.g. 2030-01-02T15:04:05Z)"},
			&cli.IntFlag{Name: "max-attempts", HideDefault: true, Usage: "attempts before dead-lettering, kept by the message (default: the queue consumer's, or 3 if it has none)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			body, err := oneArg(cmd, "JSON or -")
			if err != nil {
				return err
			}
			if n := cmd.Int("max-attempts"); cmd.IsSet("max-attempts") && (n < 1 || n > validate.MaxAttempts) {
				// The library reads 0 as "the default"; given explicitly it is
				// a mistake, and the library's message would say otherwise.
				return usagef("--max-attempts %d: must be 1 to %d", n, validate.MaxAttempts)
			}
			if cmd.Duration("delay") < 0 {
				return usagef("--delay %s: must not be negative", cmd.Duration("delay"))
			}
			opts := bellhop.EnqueueOptions{Delay: cmd.Duration("delay"), MaxAttempts: int(cmd.Int("max-attempts"))}
			if cmd.IsSet("at") {
				s := cmd.String("at")
				at, err := time.Parse(time.RFC3339Nano, s)
				if err != nil {
					return usagef("--at %q is not an RFC 3339 time", s)
				}
				opts.DeliverAfter = at
			}
			if cmd.IsSet("delay") && cmd.IsSet("at") {
				return usagef("use --delay or --at, not both")
			}
			// What can be checked without the database is checked before
			// connecting, so that it is named even with the database away.
			if err := checkAppFlag(cmd); err != nil {
				return err
			}
			if err := validate.QueueName(cmd.String("queue")); err != nil {
				return usagef("--queue: %w", err)
			}
			if _, err := validate.DeliverAt(time.Now(), opts.DeliverAfter, opts.Delay); err != nil {
				return usageError{whenNamed(err)}
			}
			if body != "-" {
				if err := validate.Payload([]byte(body)); err != nil {
					return usagef("enqueue: %w", err)
				}
			}
			c, pool, err := client(ctx, cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			app, queue := cmd.String("app"), cmd.String("queue")
			if body != "-" {
				id, err := c.Enqueue(ctx, app, queue, []byte(body), opts)
				if err != nil {
					return err
				}
				fmt.Fprintln(d.stdout, id)
				return nil
			}
			return enqueueStream(ctx, c, pool, app, queue, opts,
				streamBatch{lines: enqueueBatchLines, bytes: enqueueBatchBytes}, d.stdin, d.stdout)
		},
	}
}

// enqueueStream reads one JSON value per line and inserts them in batches
// bounded by limit, all in one transaction: a bad line, or any other
// failure, writes nothing, so that the stream can be fixed and re-run
// without duplicates. The messages become visible, and their consumers
// are notified, at the end.
func enqueueStream(ctx context.Context, c *bellhop.Client, pool *pgxpool.Pool, app, queue string, opts bellhop.EnqueueOptions,
	limit streamBatch, in io.Reader, out io.Writer) error {
	// What is the same for every line is checked once, up front: it would
	// otherwise surface only with the first batch, as a position in it.
	if err := validate.QueueName(queue); err != nil {
		return usageError{err}
	}
	if err := validate.MaxAttemptsOption(opts.MaxAttempts); err != nil {
		return usageError{err}
	}
	if _, err := validate.DeliverAt(time.Now(), opts.DeliverAfter, opts.Delay); err != nil {
		return usageError{whenNamed(err)}
	}
	// The app too, which takes the database: an empty stream would
	// otherwise succeed, and a bad app be blamed on the first batch. Not
	// in the transaction, whose locks would then be held from the start
	// of a slow stream instead of from its first batch.
	if _, err := c.EnqueueMany(ctx, app, nil); err != nil {
		return fmt.Errorf("%w; nothing was enqueued", err)
	}
	// Begun with the first batch: a slow stream (a pipe that waits on
	// its producer, a person typing) would otherwise hold a session idle
	// in its transaction from the start, where idle_in_transaction_
	// session_timeout ends it, blamed on the lines read by then.
	var tx pgx.Tx
	defer func() {
		if tx != nil {
			// After Commit this is a no-op; before, it undoes every batch.
			_ = tx.Rollback(context.Background())
		}
	}()

	// A stop signal ends the read too (run cancels ctx): a read blocked
	// on a terminal or a pipe would otherwise hold the command until the
	// next line came.
	sc := bufio.NewScanner(untilDone(ctx, in))
	sc.Buffer(make([]byte, 64*1024), maxLine)
	var (
		batch []bellhop.NewMessage
		lines []int // of batch's messages
		size  int   // of batch's payloads, in bytes
		line  int
		total int
	)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if tx == nil {
			var err error
			if tx, err = pool.Begin(ctx); err != nil {
				return fmt.Errorf("enqueue from stdin: begin: %w; nothing was enqueued", err)
			}
		}
		if _, err := c.EnqueueManyTx(ctx, tx, app, batch); err != nil {
			var at interface{ Position() int }
			if errors.As(err, &at) && at.Position() < len(lines) {
				return fmt.Errorf("line %d: %w; nothing was enqueued", lines[at.Position()], err)
			}
			if len(lines) == 1 {
				return fmt.Errorf("line %d: %w; nothing was enqueued", lines[0], err)
			}
			return fmt.Errorf("lines %d to %d: %w; nothing was enqueued", lines[0], lines[len(lines)-1], err)
		}
		total += len(batch)
		// Cleared, so that the flushed payloads can be collected.
		clear(batch)
		batch, lines, size = batch[:0], lines[:0], 0
		return nil
	}
	for sc.Scan() {
		if ctx.Err() != nil {
			// The stop ended the read: the scanner hands over what it
			// had of a line as if at its end, which was blamed as a bad
			// line (exit 2) or taken as a whole one. sc.Err() says why.
			break
		}
		line++
		// JSON's white space only: bytes.TrimSpace also takes Unicode's
		// (NBSP, NEL), which would let through lines that Enqueue refuses.
		text := bytes.Trim(sc.Bytes(), " \t\r\n")
		if len(text) == 0 {
			continue
		}
		if err := validate.Payload(text); err != nil {
			return usagef("line %d: %w; nothing was enqueued", line, err)
		}
		// The scanner reuses its buffer: the payload needs its own copy.
		batch = append(batch, bellhop.NewMessage{Queue: queue, Payload: bytes.Clone(text), Options: opts})
		lines = append(lines, line)
		size += len(text)
		if len(batch) >= limit.lines || size >= limit.bytes {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if err := sc.Err(); errors.Is(err, bufio.ErrTooLong) {
		return usagef("line %d is longer than the %d-byte limit of a line (a payload is at most %d bytes); nothing was enqueued",
			line+1, maxLine, validate.MaxPayloadBytes)
	} else if err != nil {
		return fmt.Errorf("read stdin at line %d: %w; nothing was enqueued", line+1, err)
	}
	if err := flush(); err != nil {
		return err
	}
	if tx == nil {
		fmt.Fprintf(out, "enqueued %s\n", plural(0, "message"))
		return nil
	}
	if err := tx.Commit(ctx); err != nil {
		// A commit that fails in transit may still have happened: no
		// claim that nothing was enqueued here.
		return fmt.Errorf("enqueue from stdin: commit %d messages: %w", total, err)
	}
	fmt.Fprintf(out, "enqueued %s\n", plural(total, "message"))
	return nil
}

// untilDone reads r until ctx ends, and then fails with ctx's error, even
// while a read of r is blocked: that read's goroutine is left to end with
// the process, as a read of a terminal or a pipe cannot be cancelled. The
// writer's half is closed, not the reader's, whose reads would fail with
// io.ErrClosedPipe, which says nothing of the stop; the first close wins.
func untilDone(ctx context.Context, r io.Reader) io.Reader {
	pr, pw := io.Pipe()
	go func() {
		_, err := io.Copy(pw, r)
		pw.CloseWithError(err)
	}()
	context.AfterFunc(ctx, func() { pw.CloseWithError(ctx.Err()) })
	return pr
}

func queuesCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "queues",
		Usage: "show queues: ready, delayed, in flight, dead, oldest ready age, consumer",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "app", Usage: "only this app's", Sources: env("APP")},
			&cli.BoolFlag{Name: "watch", Usage: "refresh every 2s until interrupted"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			c, pool, err := client(ctx, cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			if cmd.Bool("watch") {
				// Ctrl-C, SIGTERM or a closed terminal (SIGHUP) ends watching
				// normally: exit 0.
				var stop context.CancelFunc
				ctx, stop = notifyStop(ctx)
				defer stop()
			}
			for {
				qs, err := c.Queues(ctx, cmd.String("app"))
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				if cmd.Bool("watch") {
					fmt.Fprint(d.stdout, "\033[H\033[2J")
				}
				tw := tabwriter.NewWriter(d.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "APP\tQUEUE\tREADY\tDELAYED\tIN FLIGHT\tDEAD\tOLDEST READY\tCONSUMER")
				for _, q := range qs {
					consumer := "-"
					if q.ConsumerID != nil {
						consumer = q.ConsumerID.String()
						if !q.ConsumerEnabled {
							consumer += " (paused)"
						}
					}
					// No ready message has no age: 0s would read as one
					// ready this instant.
					oldest := "-"
					if q.Ready > 0 {
						oldest = q.OldestReady.Round(time.Millisecond).String()
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%s\t%s\n", q.App, q.Queue, q.Ready, q.Delayed, q.InFlight, q.Dead,
						oldest, consumer)
				}
				if err := tw.Flush(); err != nil || !cmd.Bool("watch") {
					return err
				}
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(2 * time.Second):
				}
			}
		},
	}
}

// messageID parses a message's id, of a dead letter or a queue message.
// The nil UUID is refused: the library reads it as "no id", so `dead
// purge` with it would act on every dead letter of the queue, or of the
// app, instead of on none.
func messageID(s string) (uuid.UUID, error) {
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, usagef("message id %s is not a UUID", validate.Shown(s))
	}
	if id == uuid.Nil {
		return uuid.Nil, usagef("message id %s is the nil UUID, which is no message's id", s)
	}
	return id, nil
}

// messageArg reads a command's one argument, a MESSAGE_ID (messageID).
func messageArg(cmd *cli.Command) (uuid.UUID, error) {
	s, err := oneArg(cmd, "MESSAGE_ID")
	if err != nil {
		return uuid.Nil, err
	}
	return messageID(s)
}

// quoteRoles lists role names as SQL identifiers, comma-separated.
func quoteRoles(roles []string) string {
	quoted := make([]string, len(roles))
	for i, r := range roles {
		quoted[i] = pgx.Identifier{r}.Sanitize()
	}
	return strings.Join(quoted, ", ")
}

// plural is n with noun, in the plural unless n is 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// noDeadLetter is the error for an id that names no dead letter of app:
// like an unknown consumer, input that a retry cannot fix (exit status 2).
func noDeadLetter(id uuid.UUID, app string) error {
	return usagef("no dead letter %s in app %q", id, app)
}

// nonEmptyApp refuses an empty --app where the library would read it as
// "every app": the dead-letter commands act on one app.
func nonEmptyApp(cmd *cli.Command) error {
	if cmd.String("app") == "" {
		return usagef("--app is empty: name the app whose dead letters to read")
	}
	return nil
}

func deadCommand(d *deps) *cli.Command {
	appFlag := &cli.StringFlag{Name: "app", Usage: "app name (required)", Required: true, Sources: env("APP")}
	selector := func(cmd *cli.Command) (string, uuid.UUID, error) {
		queue := cmd.String("queue")
		var id uuid.UUID
		if cmd.Args().Len() > 1 {
			return "", uuid.Nil, usagef("give at most one MESSAGE_ID")
		}
		// An empty argument is an id too, and a bad one: read as none,
		// it would turn "this message" into "the whole queue".
		if cmd.Args().Len() == 1 {
			var err error
			if id, err = messageID(cmd.Args().First()); err != nil {
				return "", uuid.Nil, err
			}
		}
		if queue == "" && id == uuid.Nil {
			return "", uuid.Nil, usagef("name a MESSAGE_ID or --queue")
		}
		// Both would act on the id only if it is of that queue: a
		// mistake either way, which is refused rather than guessed at.
		if queue != "" && id != uuid.Nil {
			return "", uuid.Nil, usagef("give a MESSAGE_ID or --queue, not both")
		}
		return queue, id, nil
	}
	bulk := func(verb string, op func(*bellhop.Client, context.Context, string, string, uuid.UUID) (int64, error)) cli.ActionFunc {
		return func(ctx context.Context, cmd *cli.Command) error {
			queue, id, err := selector(cmd)
			if err != nil {
				return err
			}
			c, pool, err := client(ctx, cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			n, err := op(c, ctx, cmd.String("app"), queue, id)
			if errors.Is(err, bellhop.ErrNotRedriven) {
				// Some moved, some cannot until something changes: say
				// both; the error names what to do (exit status 2).
				fmt.Fprintf(d.stdout, "%s %s\n", verb, plural(int(n), "dead letter"))
				return usagef("%s", oneLine(err))
			}
			if err != nil {
				if n > 0 {
					// Batches before the failed one stay done.
					fmt.Fprintf(d.stdout, "%s %s before the error\n", verb, plural(int(n), "dead letter"))
				}
				return err
			}
			if n == 0 && id != uuid.Nil {
				return noDeadLetter(id, cmd.String("app"))
			}
			fmt.Fprintf(d.stdout, "%s %s\n", verb, plural(int(n), "dead letter"))
			return nil
		}
	}
	return &cli.Command{
		Name:  "dead",
		Usage: "inspect, redrive and purge dead letters",
		Commands: []*cli.Command{{
			Name:  "ls",
			Usage: "list dead letters, newest first",
			Flags: []cli.Flag{appFlag, &cli.StringFlag{Name: "queue", Usage: "only this queue's"},
				&cli.IntFlag{Name: "limit", Value: bellhop.DefaultDeadLimit, Usage: fmt.Sprintf("at most this many (1 to %d)", bellhop.MaxDeadLimit)},
				&cli.StringFlag{Name: "after", Usage: "only those after this dead letter in the list, given as ID:SOURCE (as the note of a listing cut at its --limit gives it) or ID"}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				if err := nonEmptyApp(cmd); err != nil {
					return err
				}
				// The library reads 0 as "the default": given explicitly,
				// it and a negative limit are mistakes.
				if n := cmd.Int("limit"); n < 1 || n > bellhop.MaxDeadLimit {
					return usagef("--limit %d: must be 1 to %d", n, bellhop.MaxDeadLimit)
				}
				afterID, afterSource, err := deadCursor(cmd.String("after"))
				if err != nil {
					return err
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				var after *bellhop.DeadLetter
				if afterID != uuid.Nil {
					if after, err = deadAt(ctx, c, cmd.String("app"), afterID, afterSource); err != nil {
						return err
					}
				}
				// The table shows no payload: reading them held every
				// listed one in memory, up to 10,000 of up to 1 MiB.
				ds, err := c.DeadLetters(ctx, bellhop.DeadFilter{App: cmd.String("app"), Queue: cmd.String("queue"),
					Limit: int(cmd.Int("limit")), After: after, OmitPayload: true})
				if err != nil {
					return err
				}
				tw := tabwriter.NewWriter(d.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tQUEUE\tSOURCE\tATTEMPTS\tDIED\tLAST ERROR")
				for _, x := range ds {
					// A handler's error may quote what a producer sent:
					// shown as it is, an escape sequence in it would run
					// on the operator's terminal.
					errText := printable.Line(x.LastError)
					if len(errText) > 80 {
						cut := 80
						for cut > 0 && !utf8.RuneStart(errText[cut]) {
							cut-- // never split a character
						}
						errText = errText[:cut] + "…"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%d/%d\t%s\t%s\n", x.ID, x.Queue, x.Source, x.Attempt, x.MaxAttempts,
						x.DiedAt.UTC().Format(time.RFC3339), errText)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				// A listing cut at its limit said nothing of it, and a
				// script counting its lines took 100 for all there were
				// (the CLI review).
				if n := int(cmd.Int("limit")); len(ds) == n {
					fmt.Fprintf(d.stderr, "bellhop: showing %d dead letters; there may be more: --after %s:%s lists the next (`bellhop queues` counts them; --limit takes up to %d, --queue narrows the list)\n",
						n, ds[n-1].ID, ds[n-1].Source, bellhop.MaxDeadLimit)
				}
				return nil
			},
		}, {
			Name:      "show",
			Usage:     "show a dead letter in full, as JSON (each one, if a message and an invoke delivery share the id)",
			ArgsUsage: "MESSAGE_ID",
			Flags:     []cli.Flag{appFlag},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				id, err := messageArg(cmd)
				if err != nil {
					return err
				}
				if err := nonEmptyApp(cmd); err != nil {
					return err
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				// A message and an invoke delivery may share an id, and
				// redrive and purge act on both: show both.
				ds, err := c.DeadLetters(ctx, bellhop.DeadFilter{App: cmd.String("app"), ID: id})
				if err != nil {
					return err
				}
				if len(ds) == 0 {
					return noDeadLetter(id, cmd.String("app"))
				}
				var buf bytes.Buffer
				enc := json.NewEncoder(&buf)
				enc.SetIndent("", "  ")
				for _, x := range ds {
					v := shownDead(x)
					if err := encodeShown(enc, d.stderr, &v, x.ID, &v.Payload); err != nil {
						return err
					}
				}
				// Payloads and errors are producers' and consumers' text:
				// bidi overrides and C1 controls in them are escaped too.
				_, err = d.stdout.Write(printable.JSON(buf.Bytes()))
				return err
			},
		}, {
			Name: "redrive", Usage: "move dead letters back to their queue, attempts counted from 0 again against each one's own max attempts: one MESSAGE_ID, or all of --queue (not both)",
			ArgsUsage: "[MESSAGE_ID]", Flags: []cli.Flag{appFlag, &cli.StringFlag{Name: "queue", Usage: "every dead letter of this queue (instead of a MESSAGE_ID)"}},
			Action: bulk("redrove", (*bellhop.Client).Redrive),
		}, {
			Name: "purge", Usage: "delete dead letters for good: one MESSAGE_ID, or all of --queue (not both)",
			ArgsUsage: "[MESSAGE_ID]", Flags: []cli.Flag{appFlag, &cli.StringFlag{Name: "queue", Usage: "every dead letter of this queue (instead of a MESSAGE_ID)"}},
			Action: bulk("purged", (*bellhop.Client).PurgeDead),
		}},
	}
}

// deadView is a DeadLetter as dead show prints it: the same fields in the
// same order, with the times as RFC 3339 text in UTC, as every listing
// prints them (pgx gives them in the host's zone), which, unlike
// time.Time's MarshalJSON, takes any year: plain SQL may write times
// before year 0 or after 9999, and one such dead letter made dead show
// fail.
type deadView struct {
	ID           uuid.UUID
	Source       string
	App          string
	Queue        string
	ConsumerID   *uuid.UUID
	Payload      json.RawMessage
	EnqueuedAt   string
	DeliverAfter *string
	Attempt      int
	MaxAttempts  int
	EnqueuedBy   *uuid.UUID
	LastError    string
	DiedAt       string
	RedriveAfter *string
}

// encodeShown encodes v, a shown message whose payload is at payload. A
// payload that nests deeper than encoding/json reads (10,000 levels;
// plain SQL can store deeper) is shown as a string instead, and stderr
// says so.
func encodeShown(enc *json.Encoder, stderr io.Writer, v any, id uuid.UUID, payload *json.RawMessage) error {
	if err := enc.Encode(v); err == nil {
		return nil
	}
	*payload, _ = json.Marshal(string(*payload))
	if err := enc.Encode(v); err != nil {
		return err
	}
	fmt.Fprintf(stderr, "bellhop: the payload of %s nests too deep to show as JSON: shown as a string\n", id)
	return nil
}

// shownAt is a time as shown messages give it: RFC 3339 in UTC (see
// deadView); nil for nil.
func shownAt(t *time.Time) *string {
	if t == nil {
		return nil
	}
	s := t.UTC().Format(time.RFC3339Nano)
	return &s
}

func shownDead(x bellhop.DeadLetter) deadView {
	at := shownAt
	return deadView{ID: x.ID, Source: x.Source, App: x.App, Queue: x.Queue, ConsumerID: x.ConsumerID, Payload: x.Payload,
		EnqueuedAt: *at(&x.EnqueuedAt), DeliverAfter: at(x.DeliverAfter), Attempt: x.Attempt, MaxAttempts: x.MaxAttempts,
		EnqueuedBy: x.EnqueuedBy, LastError: x.LastError, DiedAt: *at(&x.DiedAt), RedriveAfter: at(x.RedriveAfter)}
}

// versionCommand prints what the binary was built from and the newest
// migration it knows: the upgrade notes name migrations, and a binary
// must not be rolled back past some of them.
func versionCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the build (module version, commit, Go) and the newest migration this binary knows",
		Action: func(ctx context.Context, cmd *cli.Command) error {
			latest, err := migrations.Latest()
			if err != nil {
				return err
			}
			version, commit, goVersion := "(unknown)", "(not recorded: built outside a git checkout, or with -buildvcs=false, and without -X main.buildCommit)", runtime.Version()
			if buildCommit != "" {
				commit = buildCommit + " (given at build)"
			}
			if bi, ok := debug.ReadBuildInfo(); ok {
				version = bi.Main.Version
				var rev, at string
				modified := false
				for _, s := range bi.Settings {
					switch s.Key {
					case "vcs.revision":
						rev = s.Value
					case "vcs.time":
						at = s.Value
					case "vcs.modified":
						modified = s.Value == "true"
					}
				}
				if rev != "" {
					commit = rev
					if at != "" {
						commit += " (" + at + ")"
					}
					if modified {
						commit += ", with uncommitted changes"
					}
				}
			}
			fmt.Fprintf(d.stdout, "bellhop %s\ncommit: %s\ngo: %s\nschema: version %d (%s)\n", version, commit, goVersion, latest, migrations.Name(latest))
			return nil
		},
	}
}
