package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/internal/metrics"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
	"github.com/bellhopq/bellhop/notify"
)

func runCommand(d *deps) *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run the dispatcher: HTTP push to every consumer with a URL, reclaim, /metrics, /healthz and /readyz",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "http-addr", Value: ":9090", Usage: "address for /metrics, /healthz and /readyz", Sources: env("HTTP_ADDR")},
			&cli.DurationFlag{Name: "poll-interval", Value: bellhop.DefaultPollInterval, Usage: "fallback poll period, at least 1s (catches lost notifications only)", Sources: env("POLL_INTERVAL")},
			&cli.DurationFlag{Name: "shutdown-grace", Value: bellhop.DefaultShutdownGrace, Usage: "on SIGINT, SIGTERM or SIGHUP, how long in-flight deliveries may finish", Sources: env("SHUTDOWN_GRACE")},
			&cli.StringSliceFlag{Name: "allowed-hosts", Usage: "if set, only push to these hosts (exact, or *.suffix)", Sources: env("ALLOWED_HOSTS")},
			&cli.BoolFlag{Name: "block-private-addresses", Usage: "refuse to push to an address that is not public (loopback, private, link-local such as a cloud's metadata service, ...), checked after the name is resolved; not with a proxy", Sources: env("BLOCK_PRIVATE_ADDRESSES")},
			&cli.BoolFlag{Name: "lease-at-insert", Usage: "let producers lease new messages of idle queues to this dispatcher, saving a claim round trip (docs/lease-at-insert.md)", Sources: env("LEASE_AT_INSERT")},
			&cli.BoolFlag{Name: "queue-depths", Value: true, Usage: "report queue depths on /metrics: a scrape scans the queue list, at most once a second, at a cost that grows with the messages and dead letters held (--queue-depths=false leaves them out)", Sources: env("QUEUE_DEPTHS")},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			log, err := d.logger(cmd)
			if err != nil {
				return err
			}
			// From here on, SIGINT, SIGTERM or SIGHUP stops the daemon
			// cleanly, also while it starts up.
			ctx, stop := signalContext(ctx, log)
			defer stop()
			// The flags are checked before the database's configuration,
			// so that a bad one is named whether or not a database is
			// configured: it is the more specific mistake.
			if p := cmd.Duration("poll-interval"); p < time.Second {
				return usagef("%s %s: must be at least 1s", flagName("poll-interval", sameDuration(p)), p)
			}
			if g := cmd.Duration("shutdown-grace"); g <= 0 {
				return usagef("%s %s: must be positive", flagName("shutdown-grace", sameDuration(g)), g)
			}
			if g := cmd.Duration("shutdown-grace"); g > validate.MaxVisibility {
				return usagef("%s %s: must be at most %s, the longest visibility timeout", flagName("shutdown-grace", sameDuration(g)), g, validate.MaxVisibility)
			}
			hosts, err := allowedHosts(cmd)
			if err != nil {
				return err
			}
			if err := httppush.CheckProxyEnv(os.Getenv); err != nil {
				return usageError{err}
			}
			blockPrivate := cmd.Bool("block-private-addresses")
			if blockPrivate {
				if err := httppush.CheckBlockPrivate(os.Getenv); err != nil {
					return usagef("%s: %v", flagName("block-private-addresses", sameBool(true)), err)
				}
			}
			// An empty address would listen on a random port of every
			// interface, where nobody looks for the probes.
			if cmd.String("http-addr") == "" {
				return usagef("--http-addr is empty: give the address for /metrics, /healthz and /readyz, such as :9090")
			}
			addr := cmd.String("http-addr")
			addrFlag := flagName("http-addr", sameString(addr))
			if err := checkListenAddr(addrFlag, addr); err != nil {
				return err
			}
			cfg, err := poolConfig(cmd)
			if err != nil {
				return err
			}
			// Only now: a configuration refused after listening would
			// have held the port for nothing.
			ln, err := listen(addrFlag, addr)
			if err != nil {
				return err
			}
			warnStrayEnv(log, cmd)
			// Once the database has answered: a start-up that fails says
			// one line, its error, which names the database.
			settings := func(schema int) {
				log.Info().Str("database", describeDB(cfg)).Int("schema_version", schema).Str("http_addr", ln.Addr().String()).
					Stringer("poll_interval", cmd.Duration("poll-interval")).Stringer("shutdown_grace", cmd.Duration("shutdown-grace")).
					Bool("lease_at_insert", cmd.Bool("lease-at-insert")).Bool("queue_depths", cmd.Bool("queue-depths")).Strs("allowed_hosts", hosts).
					Bool("block_private_addresses", blockPrivate).
					Str("log_level", strings.ToLower(cmd.String("log-level"))).Msg("settings")
				// A rollback, or a rolling upgrade under way: fine, as
				// migrations only add, but this binary uses none of
				// what the newer ones added, which an operator
				// looking for a feature should be told.
				if latest, err := migrations.Latest(); err == nil && schema > latest {
					log.Info().Int("schema_version", schema).Int("binary_schema_version", latest).
						Msg("the database's schema is newer than this bellhop's migrations: running on it, since migrations only add; this bellhop uses nothing they added")
				}
			}
			pusher := httppush.New(httppush.Options{AllowedHosts: hosts, BlockPrivate: blockPrivate, Logger: log})
			// Once serve returns no push is in flight: the consumers'
			// kept-alive connections are closed now rather than at exit.
			defer pusher.CloseIdleConnections()
			err = serve(ctx, log, cfg, ln, pusher, settings, cmd.Bool("queue-depths"), bellhop.DispatcherConfig{
				PollInterval: cmd.Duration("poll-interval"), ShutdownGrace: cmd.Duration("shutdown-grace"),
				LeaseAtInsert: cmd.Bool("lease-at-insert"),
			})
			if err != nil && stoppedBySignal(ctx, err) {
				// A signal while starting up (connecting, checking the
				// schema, loading the consumers) is a normal way to stop.
				return nil
			}
			return err
		},
	}
}

// describeDB names the database of cfg for the settings line: user, the
// hosts and ports in the order they are tried (a multi-host DSN's
// fallbacks, each once: pgconn also adds one per host for sslmode=prefer
// and allow) and database, never the password or other parameters.
func describeDB(cfg *pgxpool.Config) string {
	c := cfg.ConnConfig
	addrs := []string{net.JoinHostPort(c.Host, strconv.Itoa(int(c.Port)))}
	for _, f := range c.Fallbacks {
		if a := net.JoinHostPort(f.Host, strconv.Itoa(int(f.Port))); !slices.Contains(addrs, a) {
			addrs = append(addrs, a)
		}
	}
	return fmt.Sprintf("%s@%s/%s", c.User, strings.Join(addrs, ","), c.Database)
}

// warnStrayEnv warns of each BELLHOP_ variable set that cmd reads no flag
// from: misspelled (BELLHOP_SHUTDOWN_GRAC), or another command's, it has
// no effect, and the default applies where the operator meant a setting.
// A warning, not a refusal: one environment often serves several
// commands (a compose file's shared variables).
func warnStrayEnv(log zerolog.Logger, cmd *cli.Command) {
	mine := map[string]bool{}
	for _, c := range cmd.Lineage() {
		for _, f := range c.Flags {
			for _, k := range envKeys(f) {
				mine[k] = true
			}
		}
	}
	var all []string
	var walk func(c *cli.Command)
	walk = func(c *cli.Command) {
		for _, f := range c.Flags {
			all = append(all, envKeys(f)...)
		}
		for _, sub := range c.Commands {
			walk(sub)
		}
	}
	walk(cmd.Root())
	var set []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, envPrefix) && !mine[k] {
			set = append(set, k)
		}
	}
	slices.Sort(set)
	known := slices.Sorted(maps.Keys(mine))
	for _, k := range set {
		ev := log.Warn().Str("variable", k)
		near := closestEnv(k, known)
		switch {
		case slices.Contains(all, k):
			ev.Msgf("%s is set, but only other commands read it: bellhop %s ignores it", k, cmd.Name)
		case near != "":
			ev.Msgf("%s is set, but no flag reads it: it has no effect (did you mean %s?)", k, near)
		default:
			ev.Msgf("%s is set, but no flag reads it: it has no effect", k)
		}
	}
}

// envKeys lists the environment variables that f reads.
func envKeys(f cli.Flag) []string {
	if df, ok := f.(cli.DocGenerationFlag); ok {
		return df.GetEnvVars()
	}
	return nil
}

// closestEnv is the name among known nearest to name, if a typo or two
// away (an edit distance of at most 2), else ""; a tie goes to the first
// in known's order.
func closestEnv(name string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// stopSignals stop a command gracefully. SIGHUP is one (a closed terminal
// or ssh session sends it): its default action killed the daemon with no
// stop sequence, in-flight deliveries cut short and their leases left to
// run out. There is no configuration to reload on it: consumers are
// reloaded from the database.
var stopSignals = []os.Signal{os.Interrupt, syscall.SIGTERM, syscall.SIGHUP}

// watchedStopSignals is stopSignals less those the process was started
// ignoring: signal.Notify undoes an inherited "ignore", and `nohup
// bellhop run` (SIGHUP ignored), or a background job of a script
// (SIGINT), stopped when the session closed or the script was
// interrupted. At least SIGTERM, unless that is ignored too.
func watchedStopSignals() []os.Signal {
	var watch []os.Signal
	for _, s := range stopSignals {
		if !signal.Ignored(s) {
			watch = append(watch, s)
		}
	}
	return watch
}

// notifyStop is signal.NotifyContext for the stop signals watched
// (watchedStopSignals); with none, a context only its stop ends, as
// NotifyContext with no signals would end it on any (a resized terminal).
func notifyStop(ctx context.Context) (context.Context, context.CancelFunc) {
	watch := watchedStopSignals()
	if len(watch) == 0 {
		return context.WithCancel(ctx)
	}
	return signal.NotifyContext(ctx, watch...)
}

// repeatWindow is how long after the first stop signal a stop signal is
// taken for the same request delivered twice, not for a second one: GNU
// timeout signals its child and then the child's process group, so the
// child gets its signal twice, about a millisecond apart; systemd with
// SendSIGHUP=yes sends SIGHUP just after SIGTERM, and a terminal that
// closes sends SIGHUP and may leave a SIGINT or SIGTERM from whoever closed
// it.
const repeatWindow = time.Second

// listen listens on TCP address addr, given by flag. Where the system
// refuses an address that is well formed, because another process has it
// (EADDRINUSE), this user may not bind its port (EACCES) or this host has
// no such address yet (EADDRNOTAVAIL: an interface or a floating address
// not up at boot, say), the error is an operational one, exit status 1,
// as a conflict is: the same command may succeed once the port is free,
// the address is up, or as another user. Any other error,
// such as a bad port or an unknown host, is the address's own: a usage
// error, exit status 2.
func listen(flag, addr string) (net.Listener, error) {
	if err := checkListenAddr(flag, addr); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, listenError(flag, addr, err)
	}
	return ln, nil
}

// checkListenAddr refuses, without listening, a TCP address that no
// listen can take: one without a port, or whose port is no port number
// or service name. What only listening tells (an unknown host, a port
// in use) is left to listen.
func checkListenAddr(flag, addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return usagef("%s %q: %v", flag, addr, err)
	}
	// ":" (say, ":${PORT}" with PORT unset) would listen on a random
	// port, where nobody looks; ":0" asks for that.
	if port == "" {
		return usagef("%s %q has no port: give one, such as :9090", flag, addr)
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return usagef("%s %q: %v", flag, addr, err)
	}
	return nil
}

// listenError is listen's error for net.Listen's err.
func listenError(flag, addr string, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EADDRNOTAVAIL) {
		return fmt.Errorf("%s %q: %w", flag, addr, err)
	}
	return usagef("%s %q: %v", flag, addr, err)
}

// signalContext is cancelled by the first SIGINT, SIGTERM or SIGHUP (a
// graceful stop); a second one exits at once, with status 128 plus its
// number, unless it comes within repeatWindow of the first, when it is
// ignored.
//
// Once the stop has begun it ignores SIGPIPE. Go exits on SIGPIPE when a
// write to stdout or stderr finds the pipe closed, and the stop's first
// log line is such a write when the log goes through a pipe whose reader
// the same signal ended (`bellhop run 2>&1 | tee run.log` in an ssh
// session that closes, or Ctrl-C): the stop never ran, and the messages in
// flight stayed leased, an attempt spent, until their visibility timeout.
// Ignored, the write fails with EPIPE, the line is lost, and the stop goes
// on. Before the stop, a reader gone still ends the process, as a
// supervisor that restarts it where its log is read would want.
//
// Contexts nest: run gives every command one, and the commands that stop
// gracefully make their own inside it, to log the stop. Both hear the
// signal; when the outer one cancels first, the inner one takes the
// signal from the cancellation's cause (stopSignal), so that its stop is
// logged all the same: it returned silently, and CI saw no "stopping
// gracefully" line after a SIGINT. The stop function returned waits for
// that line, so that a command cancelled so cannot return, and the
// process exit, before it is written.
func signalContext(parent context.Context, log zerolog.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	sigs := make(chan os.Signal, 4)
	// Said once, at the start, so that a stop that does nothing is not a
	// mystery: a background job of a non-interactive shell, for one,
	// starts with SIGINT ignored. Go keeps only SIGINT and SIGHUP ignored
	// so (os/signal); SIGHUP's, nohup's, is meant. SIGTERM always stops.
	if signal.Ignored(os.Interrupt) {
		log.Info().Str("signal", "SIGINT").Msg("SIGINT was ignored when bellhop started, and stays ignored: stop it with SIGTERM")
	}
	if watch := watchedStopSignals(); len(watch) > 0 { // none would mean every signal
		signal.Notify(sigs, watch...)
	}
	firstDone := make(chan struct{}) // closed once the first signal is handled, or none came
	go func() {
		var first os.Signal
		select {
		case first = <-sigs:
		case <-ctx.Done():
			var s stopSignal
			if !errors.As(context.Cause(ctx), &s) {
				close(firstDone)
				return
			}
			first = s.sig
		}
		signal.Ignore(syscall.SIGPIPE)
		log.Info().Str("signal", first.String()).Msg("stopping gracefully; send a stop signal again, a second from now or later, to stop at once")
		cancel(stopSignal{first})
		close(firstDone)
		firstAt := time.Now()
		for s := range sigs {
			if time.Since(firstAt) < repeatWindow {
				log.Debug().Str("signal", s.String()).Str("first", first.String()).Stringer("after", time.Since(firstAt)).
					Msg("a stop signal again at once: taken for the same request, ignored")
				continue
			}
			log.Warn().Str("signal", s.String()).Msg("second signal: exiting now")
			code := 130 // SIGINT's
			if n, ok := s.(syscall.Signal); ok {
				code = 128 + int(n)
			}
			os.Exit(code)
		}
	}()
	return ctx, func() { signal.Stop(sigs); cancel(nil); <-firstDone }
}

// stopSignal is the cause of a context that signalContext cancelled: the
// signal that asked for the stop.
type stopSignal struct{ sig os.Signal }

func (s stopSignal) Error() string { return "stopped by " + s.sig.String() }

// stoppedBySignal reports whether err is what a start-up cut short by
// signalContext's ctx returns: the context's own error, or a connection's
// that the cancellation ended.
func stoppedBySignal(ctx context.Context, err error) bool {
	if ctx.Err() == nil {
		return false
	}
	return errors.Is(err, context.Canceled) || pgconn.Timeout(err)
}

// pushResolver serves every consumer that has a URL with HTTP push.
type pushResolver struct {
	pusher *httppush.Pusher
	log    zerolog.Logger

	// refused holds, by consumer id, the refusals logged: consumers are
	// resolved again on every reload (any consumer's change, any listener
	// reconnect), and each refusal was logged again every time. One is
	// logged again when its URL or error changes, or once it is forgotten:
	// when the consumer is served, or has not been resolved for
	// refusalMemory (a consumer gone, whose id is never reused).
	mu       sync.Mutex
	refused  map[uuid.UUID]refusal
	prunedAt time.Time
	now      func() time.Time // the clock refusals are timed by
}

type refusal struct {
	url, err string
	at       time.Time // last resolved
}

// refusalMemory is how long a refusal not seen again is remembered.
const refusalMemory = 24 * time.Hour

// newPushResolver returns a resolver that serves consumers with pusher and
// logs their refusals to log, timing them by now (time.Now, but for tests).
func newPushResolver(pusher *httppush.Pusher, log zerolog.Logger, now func() time.Time) *pushResolver {
	return &pushResolver{pusher: pusher, log: log, refused: make(map[uuid.UUID]refusal), now: now}
}

// Resolve implements bellhop.Resolver: a handler for c if it has a URL
// that pusher serves, nil otherwise.
func (r *pushResolver) Resolve(c bellhop.Consumer) bellhop.Handler {
	if c.URL == "" {
		r.forget(c.ID)
		return nil
	}
	h, err := r.pusher.Handler(c)
	if err == nil {
		r.forget(c.ID)
		return h
	}
	if r.refusedBefore(c.ID, refusal{url: c.URL, err: err.Error(), at: r.now()}) {
		r.log.Debug().Err(err).Str("app_id", c.AppID.String()).Str("app", c.App).Str("queue", c.Queue).
			Str("consumer_id", c.ID.String()).Msg("consumer still not served")
		return nil
	}
	r.log.Error().Err(err).Str("app_id", c.AppID.String()).Str("app", c.App).Str("queue", c.Queue).
		Str("consumer_id", c.ID.String()).Msg("consumer not served")
	return nil
}

// refusedBefore records ref for consumer id and reports whether the same
// refusal (URL and error) was recorded before.
func (r *pushResolver) refusedBefore(id uuid.UUID, ref refusal) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ref.at.Sub(r.prunedAt) > time.Hour {
		for k, v := range r.refused {
			if ref.at.Sub(v.at) > refusalMemory {
				delete(r.refused, k)
			}
		}
		r.prunedAt = ref.at
	}
	prev, ok := r.refused[id]
	r.refused[id] = ref
	return ok && prev.url == ref.url && prev.err == ref.err
}

func (r *pushResolver) forget(id uuid.UUID) {
	r.mu.Lock()
	delete(r.refused, id)
	r.mu.Unlock()
}

// serve runs a dispatcher and the HTTP endpoints until ctx is cancelled.
// dc holds the dispatcher's settings from flags; serve adds the resolver,
// the logger and the observer. Once the dispatcher has stopped, it waits
// at most closeWait for the HTTP server and its own pool to close.
// settings logs the settings line, with the database's schema version,
// once the database has answered.
//
// The endpoints answer from the start, while the database is reached and
// its schema checked (each bounded by the connect timeout, and by every
// host a connection string names): /healthz "ok", /readyz and /metrics
// 503 "starting" until the dispatcher is made, with nothing logged, so
// that a start-up that fails still says one line. The port was bound and
// silent meanwhile, so that a liveness probe got no answer at all and
// could restart a daemon that was about to start.
func serve(ctx context.Context, log zerolog.Logger, cfg *pgxpool.Config, ln net.Listener, pusher *httppush.Pusher, settings func(schema int), depths bool, dc bellhop.DispatcherConfig) error {
	reg := prometheus.NewRegistry()
	var disp *bellhop.Dispatcher
	var made atomic.Pointer[madeHandlers]
	srv := probeServer(probeMux(
		untilMade(&made, func(h *madeHandlers) http.Handler { return h.metrics }),
		untilMade(&made, func(h *madeHandlers) http.Handler { return h.ready })))
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error().Err(err).Msg("http server failed")
		}
	}()
	client, pool, err := openClient(ctx, cfg)
	if err != nil {
		srv.Close()
		return err
	}
	var closeBy time.Time // once the dispatcher has stopped
	defer func() { closePool(pool, log, closeBy) }()
	version, err := checkSchema(ctx, pool, cfg.ConnConfig.ConnectTimeout)
	if err != nil {
		srv.Close()
		return err
	}
	settings(version)
	// ctx bounds the depth reads: a scrape in flight when the stop begins
	// gives up its read rather than hold a connection of pool.
	var queues func(context.Context) ([]bellhop.QueueInfo, error)
	if depths {
		queues = func(ctx context.Context) ([]bellhop.QueueInfo, error) { return client.Queues(ctx, "") }
	}
	rec := metrics.New(ctx, reg, log, func() notify.Stats { return disp.ListenerStats() }, queues)
	metrics.RegisterLeases(reg, func() bellhop.LeaseStats { return disp.LeaseStats() })
	dc.Resolver, dc.Logger, dc.Observer = newPushResolver(pusher, log, time.Now), log, rec
	disp, err = bellhop.NewDispatcher(cfg, dc)
	if err != nil {
		srv.Close()
		return err
	}
	// readyz is made now: its start-up grace is the dispatcher's.
	made.Store(&madeHandlers{metrics: metricsHandler(reg, log), ready: readyz(ctx, disp.Ready, log, time.Now)})
	log.Info().Str("http_addr", ln.Addr().String()).Msg("serving /metrics, /healthz and /readyz")
	runErr := disp.Run(ctx)
	closeBy = time.Now().Add(closeWait)
	sctx, cancel := context.WithDeadline(context.Background(), closeBy)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn().Err(err).Stringer("close_wait", closeWait).
			Msg("stopped waiting for the /metrics, /healthz and /readyz requests in flight to end; exiting without their answers")
	}
	return runErr
}

// madeHandlers serve /metrics and /readyz once the dispatcher is made.
type madeHandlers struct{ metrics, ready http.Handler }

// untilMade answers 503 "starting" until made is set, and then passes to
// the handler pick chooses from it: before, the metrics' collectors are
// not registered (an empty answer would read as a daemon with nothing to
// report), and there is no dispatcher to ask whether it is ready.
func untilMade(made *atomic.Pointer[madeHandlers], pick func(*madeHandlers) http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := made.Load()
		if h == nil {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		pick(h).ServeHTTP(w, r)
	})
}

// closeWait bounds how long `bellhop run`, once its dispatcher has
// stopped (within the stop's bound, see bellhop.Dispatcher.Run), waits
// for its HTTP server to shut down and its own connections to close,
// both together.
const closeWait = 2 * time.Second

// closePool closes pool, waiting until by at the latest (closeWait from
// now if by is zero, as on an error). pgx closes a connection whose
// statement was cancelled in the background, and against a server that
// stopped answering (a failover seen from the old side) it waits up to 15s
// for it; pool.Close waits for that, and held the exit that long past the
// stop's bound. Past by, what it stopped waiting for is logged and the
// close goes on in the background, for as long as the process lives.
func closePool(pool *pgxpool.Pool, log zerolog.Logger, by time.Time) {
	if by.IsZero() {
		by = time.Now().Add(closeWait)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		pool.Close()
	}()
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		log.Warn().Stringer("close_wait", closeWait).
			Msg("stopped waiting for the database connections to close (the server does not answer); exiting, which closes them")
	}
}

// probeMux routes the daemon's endpoints: /metrics to metrics, /readyz to
// ready, and /healthz, which answers "ok". They answer GET and HEAD only:
// any other method gets 405 Method Not Allowed with an Allow header (a
// method pattern of net/http's ServeMux does that; every method got 200).
func probeMux(metrics, ready http.Handler) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.Handle("GET /readyz", ready)
	return mux
}

// maxScrapes is how many /metrics answers are built at once: the two
// Prometheus servers of a pair. Anyone who reaches the port may ask, and
// an answer is held until its client has read it or WriteTimeout ends:
// at 10,000 queues delivered from, 52 MB, built in 2 to 3 s of CPU. With
// no limit, twelve clients that asked and never read took the daemon past
// a gigabyte and kept both cores busy.
const maxScrapes = 2

// metricsHandler serves reg, answering 503 at once to a request beyond
// maxScrapes in flight. A collector that fails leaves out its series, not
// the whole answer (which was a 500 with no metric and no line logged);
// the failure is logged at error, at most once a minute.
func metricsHandler(reg prometheus.Gatherer, log zerolog.Logger) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		MaxRequestsInFlight: maxScrapes,
		ErrorHandling:       promhttp.ContinueOnError,
		ErrorLog:            scrapeErrorLog{log: log, throttle: logthrottle.New(1, time.Minute)},
	})
}

// scrapeErrorLog is promhttp's ErrorLog: a line per failed /metrics build.
type scrapeErrorLog struct {
	log      zerolog.Logger
	throttle *logthrottle.Throttle
}

func (l scrapeErrorLog) Println(v ...any) {
	if ok, held := l.throttle.Allow(); ok {
		l.log.Error().Str("error", strings.TrimSpace(fmt.Sprintln(v...))).Int("held_back", held).
			Msg("/metrics: some series could not be collected and were left out (logged at most once a minute; held_back counts the failures not logged)")
	}
}

// readyz answers 200 while ready reports nil. The endpoint is not
// authenticated and a database error can name the server's host, user and
// database, so why it is not ready goes to the log, not to the caller; at
// most once every 10s, since anyone may ask as often as they like. Not
// being ready is normal while the daemon starts (until it was first ready,
// for up to readyStartGrace) and once a stop began (ctx done): logged at
// info then, at warn otherwise. The first line of each of these phases is
// logged at once. now is the clock the grace is measured by (time.Now,
// but for tests); the 10s between lines are measured by the real one.
func readyz(ctx context.Context, ready func(context.Context) error, log zerolog.Logger, now func() time.Time) http.Handler {
	created := now()
	var wasReady atomic.Bool
	var mu sync.Mutex
	var phase string
	var throttle *logthrottle.Throttle
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		err := ready(rctx)
		if err == nil {
			wasReady.Store(true)
			fmt.Fprintln(w, "ready")
			return
		}
		level, why := zerolog.WarnLevel, "failing"
		switch {
		case ctx.Err() != nil:
			level, why = zerolog.InfoLevel, "stopping"
		case !wasReady.Load() && now().Sub(created) < readyStartGrace:
			level, why = zerolog.InfoLevel, "starting"
		}
		mu.Lock()
		if why != phase {
			phase, throttle = why, logthrottle.New(1, 10*time.Second)
		}
		ok, held := throttle.Allow()
		mu.Unlock()
		if ok {
			log.WithLevel(level).Err(err).Str("phase", why).Int("held_back", held).
				Msg("not ready (logged at most once every 10s; held_back counts the answers not logged)")
		}
		http.Error(w, "not ready", http.StatusServiceUnavailable)
	})
}

// readyStartGrace is how long a daemon that has not yet been ready logs
// why not at info: past it, a daemon that never got ready says so at warn.
const readyStartGrace = 30 * time.Second

// probeServer serves the daemon's /metrics, /healthz and /readyz, which
// no one authenticates: every read, write and idle connection has a
// deadline, so that clients that open connections and go quiet cannot
// hold them, and the daemon's file descriptors, for ever.
func probeServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
	}
}

// checkSchema refuses to serve a database whose schema is older than this
// binary's migrations (or absent), before anything is started: otherwise
// the dispatcher fails later, or worse, half works. A newer schema is
// fine: migrations are applied before a rolling upgrade of the daemons.
// It returns the schema's version.
//
// It is bounded by the connect timeout (10s if none): a lock on the
// version table (a migration under way elsewhere), or a server that
// stopped answering, held the start-up, silent, for as long as it lasted.
func checkSchema(ctx context.Context, pool *pgxpool.Pool, bound time.Duration) (version int, err error) {
	if bound <= 0 {
		bound = 10 * time.Second
	}
	cctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	err = migrations.Check(cctx, pool)
	if err == nil {
		version, err = migrations.Current(cctx, pool)
	}
	if err != nil && ctx.Err() == nil && cctx.Err() != nil {
		return 0, fmt.Errorf("check the schema: no answer within %s (the connect timeout; is a migration holding %s?): %w",
			bound, migrations.VersionTable, err)
	}
	return version, err
}
