package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/httppush"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

var (
	stoppingRE = regexp.MustCompile(`stopping gracefully`)
	repeatRE   = regexp.MustCompile(`"level":"debug".*a stop signal again at once`)
	// the repeat ignored, or heeded as a second signal
	repeatOrExitRE = regexp.MustCompile(`"level":"debug".*a stop signal again at once|second signal: exiting now`)
	// how long after the first the repeat came, as text with its unit,
	// as every duration in the logs (it was a bare number of ms)
	repeatAfterRE = regexp.MustCompile(`"after":"[0-9.]+(ns|µs|ms|s)"`)
)

// TestGracefulStop: SIGTERM during a delivery lets it finish (or, past
// the grace period, releases its message, attempt refunded, to be retried
// when its lease would have ended: the consumer never answered and may
// still be working on it); so does SIGHUP, which used to kill the daemon
// with no stop at all. A second signal exits at once, with 128 plus its
// number, unless it comes within a second of the first, whichever signal
// it is: GNU timeout sends its signal twice (to the child, then to its
// process group), which used to exit at once, and systemd with
// SendSIGHUP=yes sends SIGHUP just after SIGTERM, which exited at once
// (found by the lifecycle review) with the deliveries left leased.
func TestGracefulStop(t *testing.T) {
	t.Parallel()
	const (
		release     = iota + 1 // release the handler
		repeat                 // a stop signal (again) at once, then release
		repeatLater            // a stop signal (again) until it is heeded
	)
	tests := []struct {
		name  string
		grace string
		sig   syscall.Signal // the first; SIGTERM if 0
		// after the first signal, one of the above, or nothing (the
		// grace period runs out)
		then int
		// the signal then sent again; sig if 0
		again    syscall.Signal
		wantCode int
		maxExit  time.Duration
		// what must become of the message
		wantAcked, wantReleased bool
	}{
		{name: "delivery finishes", grace: "20s", then: release, wantCode: 0, maxExit: 15 * time.Second, wantAcked: true},
		{name: "grace runs out", grace: "1s", wantCode: 0, maxExit: 15 * time.Second, wantReleased: true},
		{name: "SIGHUP", grace: "20s", sig: syscall.SIGHUP, then: release, wantCode: 0, maxExit: 15 * time.Second, wantAcked: true},
		{name: "SIGTERM twice at once", grace: "20s", then: repeat, wantCode: 0, maxExit: 15 * time.Second, wantAcked: true},
		{name: "SIGHUP twice at once", grace: "20s", sig: syscall.SIGHUP, then: repeat, wantCode: 0, maxExit: 15 * time.Second, wantAcked: true},
		{name: "SIGTERM, then SIGHUP at once", grace: "20s", then: repeat, again: syscall.SIGHUP, wantCode: 0, maxExit: 15 * time.Second, wantAcked: true},
		{name: "second signal, SIGINT later", grace: "60s", then: repeatLater, again: syscall.SIGINT, wantCode: 130, maxExit: 5 * time.Second},
		{name: "second signal, SIGTERM later", grace: "60s", then: repeatLater, wantCode: 143, maxExit: 5 * time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sig := tc.sig
			if sig == 0 {
				sig = syscall.SIGTERM
			}
			again := cmp.Or(tc.again, sig)
			dsn, h, _ := setup(t, "--visibility-timeout", "60s")
			releaseCh := make(chan struct{})
			entered := make(chan struct{}, 1)
			h.respond = func(w http.ResponseWriter, r *http.Request, _ delivery, _ int) {
				entered <- struct{}{}
				select {
				case <-releaseCh:
					w.WriteHeader(http.StatusOK)
				case <-r.Context().Done(): // the daemon gave up on the request
				}
			}
			t.Cleanup(func() { close(releaseCh) }) // before the hook server closes
			d := startDaemon(t, dsn, "--shutdown-grace", tc.grace, "--log-level", "debug")
			id := enqueue(t, dsn, "shop", "orders", `{"slow":true}`)
			select {
			case <-entered:
			case <-time.After(20 * time.Second):
				t.Fatal("the message was not delivered")
			}

			sentAt := time.Now()
			d.signal(sig)
			d.waitLine(true, stoppingRE, 10*time.Second)
			stopAt := time.Now()
			switch tc.then {
			case release:
				releaseCh <- struct{}{}
			case repeat:
				// The line is written once the first signal is handled,
				// so this one is a delivery of its own, not merged with
				// the first by the kernel. The daemon's window starts
				// as it writes the line: a repeat sent within a quarter
				// of the window of the test reading it is ignored, unless
				// the daemon takes the rest of the window to read it.
				d.signal(again)
				if late := time.Since(stopAt); late > repeatWindow/4 {
					// A loaded machine: the daemon may take it for a
					// repeat, or, past its window, for a second signal.
					// Either is right.
					t.Logf("the repeat went %s after the first signal's line", late)
					m := d.waitLine(true, repeatOrExitRE, 10*time.Second)
					if strings.Contains(m[0], "exiting now") {
						if code, want := d.wait(5*time.Second), 128+int(again); code != want {
							t.Fatalf("a second signal past the window: exit code %d, want %d", code, want)
						}
						return
					}
					if !repeatAfterRE.MatchString(m[0]) {
						t.Errorf("the repeat's line %s: want its after field as a duration with its unit", m[0])
					}
				} else if m := d.waitLine(true, repeatRE, 10*time.Second); !repeatAfterRE.MatchString(m[0]) {
					t.Errorf("the repeat's line %s: want its after field as a duration with its unit", m[0])
				}
				releaseCh <- struct{}{}
			case repeatLater:
				// Every 100ms until the daemon exits: those within the
				// window are ignored, the first after it is heeded.
				tick := time.NewTicker(100 * time.Millisecond)
				defer tick.Stop()
				deadline := time.After(tc.maxExit)
			loop:
				for {
					select {
					case <-d.done:
						break loop
					case <-deadline:
						t.Fatalf("the daemon did not exit within %s of repeated signals", tc.maxExit)
					case <-tick.C:
						_ = d.cmd.Process.Signal(again) // fails once it has exited
					}
				}
				if took := time.Since(sentAt); took < repeatWindow {
					t.Errorf("exited %s after the first signal: a repeat within the %s window was heeded", took, repeatWindow)
				}
			}
			if code := d.wait(tc.maxExit); code != tc.wantCode {
				t.Fatalf("exit code %d, want %d", code, tc.wantCode)
			}
			took := time.Since(stopAt)
			t.Logf("exited %s after the first signal", took.Round(time.Millisecond))

			pool := db(t, dsn)
			var rows, claimed, attempt int
			var dueIn float64 // seconds from now to deliver_after
			if err := pool.QueryRow(context.Background(),
				`SELECT count(*), count(claim_token), coalesce(max(attempt), 0),
				        coalesce(extract(epoch FROM max(deliver_after) - now())::float8, 0)
				 FROM queue_messages WHERE id = $1`, id).
				Scan(&rows, &claimed, &attempt, &dueIn); err != nil {
				t.Fatal(err)
			}
			switch {
			case tc.wantAcked && rows != 0:
				t.Errorf("message not acked: %d rows", rows)
			case tc.wantReleased && (rows != 1 || claimed != 0 || attempt != 0):
				t.Errorf("message not released: rows %d, claimed %d, attempt %d (want 1, 0, 0)", rows, claimed, attempt)
			case tc.wantReleased && (dueIn < 30 || dueIn > 60):
				// The consumer may still be working on the request the
				// stop cut short: the message waits for the end of its
				// 60s lease, which began before the signal.
				t.Errorf("released message is due in %.1fs, want at its lease's end (30 - 60s from now)", dueIn)
			case tc.then == repeatLater && took > repeatWindow+3*time.Second:
				t.Errorf("second signal: exit took %s", took)
			}
		})
	}
}

// metric returns the value of the sample of name whose labels include
// labels (e.g. `outcome="acked"`), and whether there is one.
func metric(text, name string, labels ...string) (float64, bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		series, value, found := strings.Cut(line, " ")
		if !found {
			continue
		}
		n, lbls, _ := strings.Cut(series, "{")
		if n != name {
			continue
		}
		all := true
		for _, l := range labels {
			if !strings.Contains(lbls, l) {
				all = false
			}
		}
		if !all {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		return v, err == nil
	}
	return 0, false
}

// TestMetricsAndHealth: after a known workload /metrics shows the right
// counters and gauges; /readyz follows the listener connection.
func TestMetricsAndHealth(t *testing.T) {
	t.Parallel()
	dsn, h, _ := setup(t, "--backoff-min", "50ms", "--backoff-max", "100ms")
	h.respond = func(w http.ResponseWriter, _ *http.Request, d delivery, nth int) {
		var p struct{ Kind string }
		_ = json.Unmarshal(d.body, &p)
		switch {
		case p.Kind == "flaky" && nth == 1:
			http.Error(w, "try again", http.StatusInternalServerError)
		case p.Kind == "poison":
			http.Error(w, "never", http.StatusUnprocessableEntity)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	}
	d := startDaemon(t, dsn)
	var stdin strings.Builder
	for i := range 5 {
		fmt.Fprintf(&stdin, `{"kind":"ok","n":%d}`+"\n", i)
	}
	stdin.WriteString(`{"kind":"flaky"}` + "\n" + `{"kind":"poison"}` + "\n")
	if r := exe(t, dsn, stdin.String(), "enqueue", "--app", "shop", "--queue", "orders", "-"); r.code != 0 {
		t.Fatalf("enqueue: %s", r)
	}
	h.waitCount(t, 8, 30*time.Second) // 5 ok, flaky twice, poison once
	pool := db(t, dsn)
	waitFor(t, 10*time.Second, "the queue to drain", func() bool {
		return queryInt(t, pool, "SELECT count(*) FROM queue_messages") == 0
	})

	lq := []string{`app="shop"`, `queue="orders"`}
	want := []struct {
		name   string
		labels []string
		value  float64
	}{
		{"bellhop_delivered_total", lq, 8},
		{"bellhop_settled_total", append(lq, `outcome="acked"`), 6},
		{"bellhop_settled_total", append(lq, `outcome="nacked"`), 1},
		{"bellhop_settled_total", append(lq, `outcome="dead_lettered"`), 1},
		{"bellhop_listener_connected", nil, 1},
		{"bellhop_listener_reconnects_total", nil, 0},
		{"bellhop_queue_messages", append(lq, `state="ready"`), 0},
		{"bellhop_queue_messages", append(lq, `state="delayed"`), 0},
		{"bellhop_queue_messages", append(lq, `state="in_flight"`), 0},
		{"bellhop_queue_messages", append(lq, `state="dead"`), 1},
		{"bellhop_handler_duration_seconds_count", lq, 8},
		{"bellhop_latency_to_ack_seconds_count", lq, 6},
	}
	var text string
	mismatch := func() string {
		_, text = d.get(t, "/metrics")
		for _, w := range want {
			if v, found := metric(text, w.name, w.labels...); !found || v != w.value {
				return fmt.Sprintf("%s%v = %v (present %t), want %v", w.name, w.labels, v, found, w.value)
			}
		}
		return ""
	}
	// Outcomes are reported once written, and queue depths are cached for
	// a second: poll.
	deadline := time.Now().Add(10 * time.Second)
	for m := mismatch(); m != ""; m = mismatch() {
		if time.Now().After(deadline) {
			t.Fatalf("metrics: %s\n%s", m, filterMetrics(text))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Run("in-flight gauge back to 0", func(t *testing.T) {
		// Nothing is in flight once the queue is drained and every
		// outcome is counted.
		if v, found := metric(text, "bellhop_in_flight", lq...); !found || v != 0 {
			t.Errorf("bellhop_in_flight%v = %v (present %t) with nothing in flight, want 0", lq, v, found)
		}
	})
	if v, found := metric(text, "bellhop_listener_notifications_total"); !found || v < 1 {
		t.Errorf("bellhop_listener_notifications_total = %v (present %t), want >= 1", v, found)
	}
	if _, found := metric(text, "go_goroutines"); !found {
		t.Error("no Go runtime metrics")
	}

	if code, body := d.get(t, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d %s", code, body)
	}
	if code, body := d.get(t, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz: %d %s", code, body)
	}

	// Kill the LISTEN connection: not ready until the listener is back.
	var killed int
	if err := pool.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = 'bellhop-listener' AND datname = current_database()`).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminated %d listener connections (%v), want 1", killed, err)
	}
	waitFor(t, 10*time.Second, "/readyz to report 503", func() bool {
		code, _ := d.get(t, "/readyz")
		return code == http.StatusServiceUnavailable
	})
	waitFor(t, 15*time.Second, "/readyz to recover", func() bool {
		code, _ := d.get(t, "/readyz")
		return code == http.StatusOK
	})
	if code, _ := d.get(t, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d while the listener reconnected", code)
	}
	_, text = d.get(t, "/metrics")
	if v, _ := metric(text, "bellhop_listener_reconnects_total"); v != 1 {
		t.Errorf("bellhop_listener_reconnects_total = %v after one kill, want 1", v)
	}
	// And deliveries go on over the new connection.
	enqueue(t, dsn, "shop", "orders", `{"kind":"ok","after":"reconnect"}`)
	h.waitCount(t, 9, 20*time.Second)
}

// filterMetrics keeps bellhop's own samples, for readable failures.
func filterMetrics(text string) string {
	var b strings.Builder
	for l := range strings.SplitSeq(text, "\n") {
		if strings.HasPrefix(l, "bellhop_") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// TestLeaseAtInsertDaemon: `bellhop run --lease-at-insert` pushes messages
// that producers leased to it at INSERT, signed as usual, and counts them
// in /metrics.
func TestLeaseAtInsertDaemon(t *testing.T) {
	t.Parallel()
	dsn, h, _ := setup(t)
	d := startDaemon(t, dsn, "--lease-at-insert")
	pool := db(t, dsn)
	const n = 5
	for i := range n {
		// The first goes the usual way; the lane then offers, and each
		// next one waits for the offer so that it is leased.
		if i > 0 {
			waitFor(t, 10*time.Second, "an offer", func() bool {
				return queryInt(t, pool, "SELECT count(*) FROM bellhop_offers") == 1
			})
		}
		if r := exe(t, dsn, "", "enqueue", "--app", "shop", "--queue", "orders", fmt.Sprintf(`{"n":%d,"s":"a:b"}`, i)); r.code != 0 {
			t.Fatalf("enqueue: %s", r)
		}
		h.waitCount(t, i+1, 10*time.Second)
	}
	for i, got := range h.deliveries() {
		if want := fmt.Sprintf(`{"n": %d, "s": "a:b"}`, i); string(got.body) != want || got.verify != nil {
			t.Errorf("delivery %d: body %s (signature: %v), want %s, signed", i, got.body, got.verify, want)
		}
	}
	var text string
	waitFor(t, 10*time.Second, "the leases counted", func() bool {
		_, text = d.get(t, "/metrics")
		v, found := metric(text, "bellhop_leased_at_insert_total", `found="notification"`)
		return found && v == n-1
	})
	if v, found := metric(text, "bellhop_offers_total"); !found || v < n-1 {
		t.Errorf("bellhop_offers_total = %v (present %t), want at least %d", v, found, n-1)
	}
}

// TestConsumerNotServedLog: a consumer the daemon refuses to serve (its
// host is not allowed) is logged once with the house fields, app_id
// among them, and the daemon serves on; the reloads that follow (here,
// five other consumers added) do not log it again, at error, while its
// URL and the error stay the same: a new URL is logged. It was logged on
// every reload: 7 lines for the five additions and the URL change.
func TestConsumerNotServedLog(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	m := appCreatedRE.FindStringSubmatch(strings.TrimSpace(ok(t, dsn, "app", "create", "shop")))
	if m == nil {
		t.Fatal("app create printed no id")
	}
	appID := m[2]
	consumerID, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	p := start(t, []string{"DATABASE_URL=" + dsn, "BELLHOP_LOG_LEVEL=debug"}, "run", "--http-addr", "127.0.0.1:0", "--allowed-hosts", "hooks.example.com")
	d := &daemon{proc: p, addr: p.waitLine(true, servingRE, 30*time.Second)[1]}
	line := d.waitLine(true, regexp.MustCompile(`^\{.*"message":"consumer not served".*$`), 20*time.Second)[0]
	var got map[string]any
	if err := json.Unmarshal([]byte(line), &got); err != nil {
		t.Fatalf("log line %q: %v", line, err)
	}
	want := map[string]any{"level": "error", "app_id": appID, "app": "shop", "queue": "orders", "consumer_id": consumerID}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("log field %s = %v, want %v (line %s)", k, got[k], v, line)
		}
	}
	if e, _ := got["error"].(string); !strings.Contains(e, `host "127.0.0.1" is not in the allowed hosts`) {
		t.Errorf("log error %q does not say why", e)
	}
	if code, _ := d.get(t, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d", code)
	}
	notServed := regexp.MustCompile(`"level":"error".*"message":"consumer not served"`)
	resolved := regexp.MustCompile(`"consumer_id":"` + consumerID + `".*"message":"consumer (still )?not served"`)
	// Each consumer added reloads them all: the refused one is resolved
	// again, which a line shows, at error or debug.
	for i := range 5 {
		addConsumer(t, dsn, "--app", "shop", "--queue", fmt.Sprintf("other%d", i), "--url", "https://hooks.example.com/hook")
		waitFor(t, 20*time.Second, fmt.Sprintf("reload %d", i+1), func() bool { return d.countErrLines(resolved) >= i+2 })
	}
	if n := d.countErrLines(notServed); n != 1 {
		t.Errorf("%d error lines after 5 reloads, want 1:\n%s", n, d.stderr())
	}
	ok(t, dsn, "consumer", "update", "--app", "shop", "--url", "http://127.0.0.2:9/hook", consumerID)
	d.waitLine(true, regexp.MustCompile(`^\{.*"level":"error".*127\.0\.0\.2.*"message":"consumer not served"`), 20*time.Second)
	if n := d.countErrLines(notServed); n != 2 {
		t.Errorf("%d error lines after the URL changed, want 2:\n%s", n, d.stderr())
	}
}

// TestPushResolverRefusals: a refusal is logged at error once per consumer
// until its URL or the error changes, and at debug while it stays the
// same; a consumer served, or moved away from push, is forgotten, so that
// its next refusal is logged at error again.
func TestPushResolverRefusals(t *testing.T) {
	t.Parallel()
	var logs syncbuf.Buffer
	r := newPushResolver(httppush.New(httppush.Options{AllowedHosts: []string{"hooks.example.com"}}), zerolog.New(&logs).Level(zerolog.DebugLevel), time.Now)
	c := bellhop.Consumer{ID: uuid.New(), AppID: uuid.New(), App: "shop", Queue: "orders", URL: "http://127.0.0.1:9/hook", Secret: "s3cret"}
	lines := func() (errs, debugs int) {
		s := logs.String()
		return strings.Count(s, `{"level":"error"`), strings.Count(s, `{"level":"debug"`)
	}
	for _, step := range []struct {
		name         string
		url, secret  string
		served       bool
		errs, debugs int
	}{
		{"refused", "http://127.0.0.1:9/hook", "s3cret", false, 1, 0},
		{"refused again", "http://127.0.0.1:9/hook", "s3cret", false, 1, 1},
		{"refused again", "http://127.0.0.1:9/hook", "s3cret", false, 1, 2},
		{"another URL refused", "http://127.0.0.2:9/hook", "s3cret", false, 2, 2},
		{"served", "https://hooks.example.com/hook", "s3cret", true, 2, 2},
		{"refused after being served", "http://127.0.0.2:9/hook", "s3cret", false, 3, 2},
		{"no URL", "", "s3cret", false, 3, 2},
		{"refused after having no URL", "http://127.0.0.2:9/hook", "s3cret", false, 4, 2},
		{"no secret", "https://hooks.example.com/hook", "", false, 5, 2},
		{"no secret again", "https://hooks.example.com/hook", "", false, 5, 3},
	} {
		c.URL, c.Secret = step.url, step.secret
		h := r.Resolve(c)
		if errs, debugs := lines(); (h != nil) != step.served || errs != step.errs || debugs != step.debugs {
			t.Fatalf("%s: handler %v, %d error and %d debug lines, want served %t, %d and %d:\n%s",
				step.name, h, errs, debugs, step.served, step.errs, step.debugs, logs.String())
		}
	}
	other := c
	other.ID = uuid.New()
	if r.Resolve(other); func() int { errs, _ := lines(); return errs }() != 6 {
		t.Errorf("another consumer refused the same way: not logged at error:\n%s", logs.String())
	}

	// The same URL refused for another reason is a new refusal. The
	// pusher above refuses a URL for one reason only, so this asks
	// refusedBefore, which Resolve logs by, directly.
	id, at := uuid.New(), time.Now()
	for _, step := range []struct {
		name     string
		ref      refusal
		repeated bool
	}{
		{"first", refusal{url: "http://a/hook", err: "host not allowed"}, false},
		{"same", refusal{url: "http://a/hook", err: "host not allowed"}, true},
		{"another error", refusal{url: "http://a/hook", err: "no signing secret"}, false},
		{"same again", refusal{url: "http://a/hook", err: "no signing secret"}, true},
		{"another URL", refusal{url: "http://b/hook", err: "no signing secret"}, false},
	} {
		step.ref.at = at
		if got := r.refusedBefore(id, step.ref); got != step.repeated {
			t.Errorf("%s: refusedBefore(url %q, err %q) = %t, want %t", step.name, step.ref.url, step.ref.err, got, step.repeated)
		}
	}
}

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *fakeClock) advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// TestPushResolverForgetsOldRefusals: a refusal not seen again for
// refusalMemory (a consumer gone, whose id is never reused) is forgotten,
// so that the map does not grow with every consumer ever refused: that
// consumer's next refusal is logged at error again, while one seen within
// refusalMemory is still remembered (debug). The sweep runs at most once
// an hour, so an entry past refusalMemory lasts until the next one.
func TestPushResolverForgetsOldRefusals(t *testing.T) {
	t.Parallel()
	var logs syncbuf.Buffer
	clock := newFakeClock()
	r := newPushResolver(httppush.New(httppush.Options{AllowedHosts: []string{"hooks.example.com"}}), zerolog.New(&logs).Level(zerolog.DebugLevel), clock.now)
	consumer := func(name string) bellhop.Consumer {
		return bellhop.Consumer{ID: uuid.New(), AppID: uuid.New(), App: "shop", Queue: name, URL: "http://127.0.0.1:9/hook", Secret: "s3cret"}
	}
	a, b, c, d := consumer("a"), consumer("b"), consumer("c"), consumer("d")
	start := clock.now()
	for _, step := range []struct {
		at    time.Duration // since start
		c     bellhop.Consumer
		level string
		why   string
	}{
		{0, a, "error", "first refusal"},
		{30 * time.Minute, d, "error", "first refusal"},
		{2 * time.Hour, b, "error", "first refusal; a sweep, nothing old"},
		{refusalMemory + 10*time.Minute, c, "error", "first refusal; a sweep forgets a, seen 24h10m ago"},
		{refusalMemory + 50*time.Minute, d, "debug", "d, seen 24h20m ago, not swept: the last sweep was 40m ago"},
		{refusalMemory + 50*time.Minute, a, "error", "a was forgotten"},
		{refusalMemory + 50*time.Minute, b, "debug", "b, seen 22h50m ago, is remembered"},
		{refusalMemory + 50*time.Minute, c, "debug", "c, seen 40m ago, is remembered"},
	} {
		clock.advance(start.Add(step.at).Sub(clock.now()))
		before := len(logs.String())
		if h := r.Resolve(step.c); h != nil {
			t.Fatalf("consumer %s served", step.c.Queue)
		}
		var l map[string]any
		if err := json.Unmarshal([]byte(logs.String()[before:]), &l); err != nil {
			t.Fatalf("consumer %s at %s: log line %q: %v", step.c.Queue, step.at, logs.String()[before:], err)
		}
		if l["level"] != step.level || l["queue"] != step.c.Queue || l["consumer_id"] != step.c.ID.String() {
			t.Errorf("consumer %s at %s logged %v, want level %s (%s)", step.c.Queue, step.at, l, step.level, step.why)
		}
	}
}

// TestRunStopsCleanlyWhileStarting: SIGINT while `bellhop run` starts up
// (connecting, checking the schema, loading the consumers) stops it with
// status 0 and no error line, as SIGINT once it serves does. It used to
// exit 1 with "context canceled".
func TestRunStopsCleanlyWhileStarting(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		// prepare returns the database to run on once something there
		// will hold up the start-up, and a condition that holds once
		// the daemon is held up.
		prepare func(t *testing.T) (dsn string, held func() bool)
	}{
		{"connecting", silentServer},
		{"checking the schema", func(t *testing.T) (string, func() bool) {
			return lockedTable(t, "bellhop_schema_version")
		}},
		{"loading consumers", func(t *testing.T) (string, func() bool) {
			return lockedTable(t, "queue_consumers")
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dsn, held := tc.prepare(t)
			p := start(t, []string{"DATABASE_URL=" + dsn}, "run", "--http-addr", "127.0.0.1:0")
			waitFor(t, 30*time.Second, "the daemon to be held up "+tc.name, held)
			p.signal(os.Interrupt)
			if code := p.wait(15 * time.Second); code != 0 {
				t.Errorf("exit %d after SIGINT while %s, want 0", code, tc.name)
			}
			p.waitLine(true, stoppingRE, time.Second)
			for _, line := range strings.Split(p.stderr(), "\n") {
				if strings.HasPrefix(line, "bellhop: ") || strings.Contains(line, "context canceled") {
					t.Errorf("stderr has an error: %s", line)
				}
			}
		})
	}
}

// lockedTable returns a migrated database whose table an open transaction
// holds in ACCESS EXCLUSIVE mode until the test ends, and a condition that
// holds once another backend waits for it.
func lockedTable(t *testing.T, table string) (string, func() bool) {
	t.Helper()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(context.Background(), "LOCK TABLE "+table+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	return dsn, func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks
			WHERE NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND relation = to_regclass($1)`, table) > 0
	}
}

// TestReadyzHidesTheError: /readyz is not authenticated, so a database
// error, which can name the server, its user and database, is logged and
// not shown to the caller.
func TestReadyzHidesTheError(t *testing.T) {
	t.Parallel()
	const detail = "failed to connect to `user=bellhop_ops database=orders_prod`: 10.1.2.3:5432"
	tests := []struct {
		name     string
		err      error
		wantCode int
		wantBody string
	}{
		{"ready", nil, http.StatusOK, "ready\n"},
		{"database down", fmt.Errorf("database: %s", detail), http.StatusServiceUnavailable, "not ready\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var logs strings.Builder
			h := readyz(context.Background(), func(context.Context) error { return tt.err }, zerolog.New(&logs), time.Now)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			if rec.Code != tt.wantCode || rec.Body.String() != tt.wantBody {
				t.Errorf("/readyz = %d %q, want %d %q", rec.Code, rec.Body.String(), tt.wantCode, tt.wantBody)
			}
			if tt.err != nil && !strings.Contains(logs.String(), detail) {
				t.Errorf("the reason is not logged: %q", logs.String())
			}
			// Anyone may ask as often as they like: the log does not
			// grow with them.
			for range 20 {
				h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/readyz", nil))
			}
			if n := strings.Count(logs.String(), "not ready"); tt.err != nil && n != 1 {
				t.Errorf("21 answers of not ready logged %d lines, want 1: %s", n, logs.String())
			}
		})
	}
}

// TestReadyzQuietWhileStartingAndStopping: not being ready before the
// first ready answer (the listener still connecting) and once a stop began
// is logged at info; after having been ready, at warn. Each was a warning:
// one at every start and every graceful stop.
func TestReadyzQuietWhileStartingAndStopping(t *testing.T) {
	t.Parallel()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var mu sync.Mutex
	var state error
	set := func(err error) { mu.Lock(); state = err; mu.Unlock() }
	var logs syncbuf.Buffer
	h := readyz(ctx, func(context.Context) error { mu.Lock(); defer mu.Unlock(); return state }, zerolog.New(&logs), time.Now)
	for _, step := range []struct {
		err  error
		stop bool
		code int
	}{
		{errors.New("listener not connected"), false, http.StatusServiceUnavailable},
		{nil, false, http.StatusOK},
		{errors.New("database down"), false, http.StatusServiceUnavailable},
		{errors.New("dispatcher stopped"), true, http.StatusServiceUnavailable},
	} {
		set(step.err)
		if step.stop {
			stop()
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if rec.Code != step.code {
			t.Fatalf("/readyz with %v = %d, want %d", step.err, rec.Code, step.code)
		}
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var l map[string]any
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		got = append(got, fmt.Sprintf("%v: %v", l["level"], l["error"]))
	}
	want := []string{"info: listener not connected", "warn: database down", "info: dispatcher stopped"}
	if !slices.Equal(got, want) {
		t.Errorf("logged %q, want %q", got, want)
	}
}

// TestReadyzPhases: why /readyz is not ready is logged with its phase:
// starting (info) until the daemon was first ready, for up to
// readyStartGrace; failing (warn) once that grace is over, or after it was
// ready, even within the grace; stopping (info) once the stop began. The
// first line of a phase is logged at once, inside the previous phase's 10s
// between lines; further lines of one phase wait out those 10s. The grace
// runs on a fake clock, the 10s on the real one: the test never gets near
// them.
func TestReadyzPhases(t *testing.T) {
	t.Parallel()
	type step struct {
		advance time.Duration // the fake clock, before asking
		err     error         // what ready reports
		stop    bool          // the stop begins, before asking
		logged  string        // "level/phase: error", or "" if nothing is
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"never ready", []step{
			{0, errors.New("listener not connected"), false, "info/starting: listener not connected"},
			{time.Second, errors.New("listener not connected"), false, ""},
			{readyStartGrace - 2*time.Second, errors.New("listener not connected"), false, ""},
			{2 * time.Second, errors.New("listener not connected"), false, "warn/failing: listener not connected"},
			{time.Second, errors.New("listener not connected"), false, ""},
			{0, errors.New("dispatcher stopped"), true, "info/stopping: dispatcher stopped"},
			{time.Second, errors.New("dispatcher stopped"), true, ""},
		}},
		{"ready, then failing within the grace", []step{
			{0, errors.New("listener not connected"), false, "info/starting: listener not connected"},
			{time.Second, nil, false, ""},
			{time.Second, errors.New("database down"), false, "warn/failing: database down"},
			{time.Second, errors.New("database down"), false, ""},
			{0, errors.New("dispatcher stopped"), true, "info/stopping: dispatcher stopped"},
		}},
		{"stopping while starting", []step{
			{0, errors.New("listener not connected"), true, "info/stopping: listener not connected"},
			{readyStartGrace, errors.New("listener not connected"), true, ""},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			clock := newFakeClock()
			created := clock.now()
			var mu sync.Mutex
			var state error
			var logs syncbuf.Buffer
			h := readyz(ctx, func(context.Context) error { mu.Lock(); defer mu.Unlock(); return state }, zerolog.New(&logs), clock.now)
			for i, st := range tc.steps {
				clock.advance(st.advance)
				mu.Lock()
				state = st.err
				mu.Unlock()
				if st.stop {
					stop()
				}
				before := len(logs.String())
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
				if want := map[bool]int{true: http.StatusOK, false: http.StatusServiceUnavailable}[st.err == nil]; rec.Code != want {
					t.Fatalf("step %d: /readyz = %d, want %d", i, rec.Code, want)
				}
				got := ""
				if line := strings.TrimSpace(logs.String()[before:]); line != "" {
					var l map[string]any
					if err := json.Unmarshal([]byte(line), &l); err != nil {
						t.Fatalf("step %d: log line %q: %v", i, line, err)
					}
					got = fmt.Sprintf("%v/%v: %v", l["level"], l["phase"], l["error"])
				}
				if got != st.logged {
					t.Errorf("step %d (%s in, %v): logged %q, want %q", i, clock.now().Sub(created), st.err, got, st.logged)
				}
			}
		})
	}
}

// TestMetricsScrapesBounded: while maxScrapes answers are being built,
// another /metrics request gets a 503 at once rather than a build of its
// own; once one ends, scrapes are served again. With no bound, clients
// that asked and never read made the daemon hold a build each, past a
// gigabyte at 10,000 queues.
func TestMetricsScrapesBounded(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := &blockingCollector{entered: make(chan struct{}, maxScrapes), release: make(chan struct{})}
	reg.MustRegister(c)
	h := metricsHandler(reg, zerolog.Nop())
	done := make(chan int, maxScrapes)
	for range maxScrapes {
		go func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
			done <- rec.Code
		}()
	}
	for range maxScrapes {
		select {
		case <-c.entered:
		case <-time.After(10 * time.Second):
			t.Fatal("the first scrapes did not start within 10s")
		}
	}
	extra := make(chan int, 1)
	go func() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		extra <- rec.Code
	}()
	select {
	case code := <-extra:
		if code != http.StatusServiceUnavailable {
			t.Errorf("a scrape beyond %d in flight got %d, want 503", maxScrapes, code)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("a scrape beyond %d in flight was still being built after 10s, not refused", maxScrapes)
	}
	close(c.release)
	for range maxScrapes {
		if code := <-done; code != http.StatusOK {
			t.Errorf("a scrape in flight got %d, want 200", code)
		}
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "test_blocking") {
		t.Errorf("a scrape after the others ended got %d, want 200 with the metric", rec.Code)
	}
}

// TestMetricsCollectorFails: a collector that fails (here, by sending a
// series twice) leaves out its series, not the whole /metrics answer, and
// the failure is logged at error, once for two scrapes. promhttp answered
// 500 with no metric at all and logged nothing.
func TestMetricsCollectorFails(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	good := prometheus.NewGauge(prometheus.GaugeOpts{Name: "test_good", Help: "A gauge."})
	good.Set(7)
	reg.MustRegister(good, twiceCollector{})
	var logs syncbuf.Buffer
	h := metricsHandler(reg, zerolog.New(&logs))
	for i := range 2 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		if v, found := metric(rec.Body.String(), "test_good"); rec.Code != http.StatusOK || !found || v != 7 {
			t.Fatalf("scrape %d: %d, test_good = %v (present %t), want 200 and 7:\n%s", i+1, rec.Code, v, found, rec.Body.String())
		}
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	var got map[string]any
	if len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &got) != nil {
		t.Fatalf("logged %q for two failed scrapes, want one JSON line", logs.String())
	}
	if e, _ := got["error"].(string); got["level"] != "error" || !strings.Contains(e, "collected before with the same name and label values") {
		t.Errorf("logged %v, want level error and the collector's error", got)
	}
}

// twiceCollector sends the same series twice.
type twiceCollector struct{}

var twiceDesc = prometheus.NewDesc("test_twice", "A gauge sent twice.", nil, nil)

func (twiceCollector) Describe(ch chan<- *prometheus.Desc) { ch <- twiceDesc }

func (twiceCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(twiceDesc, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(twiceDesc, prometheus.GaugeValue, 1)
}

// TestBlockPrivateAddresses: `run --block-private-addresses` does not
// push to a consumer on a loopback address (the test's hook): the push
// fails before it connects, the log names the address, and the consumer
// sees nothing; the message stays, to be retried. Nothing checked the
// addresses that consumers' names resolve to.
func TestBlockPrivateAddresses(t *testing.T) {
	t.Parallel()
	dsn, h, _ := setup(t)
	d := startDaemon(t, dsn, "--block-private-addresses")
	if r := exe(t, dsn, `{"n":1}`, "enqueue", "--app", "shop", "--queue", "orders", "-"); r.code != 0 {
		t.Fatalf("enqueue: %s", r)
	}
	d.waitLine(true, regexp.MustCompile(`address 127\.0\.0\.1 is loopback, and pushes to addresses that are not public are blocked`), 30*time.Second)
	if n := len(h.deliveries()); n != 0 {
		t.Errorf("the consumer got %d deliveries", n)
	}
	if n := queryInt(t, db(t, dsn), "SELECT count(*) FROM queue_messages"); n != 1 {
		t.Errorf("%d messages queued, want the one, to be retried", n)
	}
}

// TestNoQueueDepths: `run --queue-depths=false` leaves the depth gauges,
// and the scan of the queue list behind them, out of /metrics, which
// still serves the rest. Every dispatcher scanned the queue list for each
// scrape, with no way to leave it to one of them.
func TestNoQueueDepths(t *testing.T) {
	t.Parallel()
	dsn, _, _ := setup(t)
	d := startDaemon(t, dsn, "--queue-depths=false")
	code, text := d.get(t, "/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, text)
	}
	for _, name := range []string{"bellhop_queue_depths_ok", "bellhop_queue_messages", "bellhop_queue_oldest_ready_seconds"} {
		if _, found := metric(text, name); found {
			t.Errorf("%s is on /metrics with --queue-depths=false", name)
		}
	}
	if v, found := metric(text, "bellhop_listener_connected"); !found || v != 1 {
		t.Errorf("bellhop_listener_connected = %v (present %t), want 1", v, found)
	}
	d2 := startDaemon(t, dsn)
	waitFor(t, 15*time.Second, "/metrics with depths by default", func() bool {
		_, text := d2.get(t, "/metrics")
		v, found := metric(text, "bellhop_queue_depths_ok")
		return found && v == 1
	})
}

// TestMetricsQueueMovedBySQL: a consumer moved by SQL onto a queue that
// another consumer serves (which the dispatcher supports) makes two rows
// of the queue list for that queue; /metrics still answers 200, with the
// queue's depths once. It answered 500, every metric gone.
func TestMetricsQueueMovedBySQL(t *testing.T) {
	t.Parallel()
	dsn, h, _ := setup(t)
	moved, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "refunds", "--url", h.srv.URL+"/refunds")
	d := startDaemon(t, dsn)
	pool := db(t, dsn)
	if _, err := pool.Exec(context.Background(), `UPDATE queue_trigger_details SET queue_name = 'orders' WHERE queue_name = 'refunds'`); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM queue_list WHERE queue_name = 'orders' AND consumer_id = $1`, moved); n != 1 {
		t.Fatalf("the moved consumer is in %d rows of queue orders, want 1", n)
	}
	var code int
	var text string
	// Queue depths are cached for a second: poll until the move shows.
	waitFor(t, 15*time.Second, "/metrics to show queue orders and not refunds", func() bool {
		code, text = d.get(t, "/metrics")
		if code != http.StatusOK {
			t.Fatalf("/metrics: %d %s", code, text)
		}
		_, orders := metric(text, "bellhop_queue_messages", `app="shop"`, `queue="orders"`, `state="ready"`)
		_, refunds := metric(text, "bellhop_queue_messages", `queue="refunds"`)
		return orders && !refunds
	})
	if n := strings.Count(text, `bellhop_queue_messages{app="shop",queue="orders",state="ready"}`); n != 1 {
		t.Errorf("queue orders' ready series %d times, want once:\n%s", n, filterMetrics(text))
	}
	if v, found := metric(text, "bellhop_listener_connected"); !found || v != 1 {
		t.Errorf("bellhop_listener_connected = %v (present %t), want 1", v, found)
	}
}

// blockingCollector's Collect signals entered, then waits for release.
type blockingCollector struct {
	entered chan struct{}
	release chan struct{}
}

var blockingDesc = prometheus.NewDesc("test_blocking", "A gauge whose collection blocks.", nil, nil)

func (c *blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- blockingDesc }

func (c *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	select {
	case c.entered <- struct{}{}:
	default:
	}
	<-c.release
	ch <- prometheus.MustNewConstMetric(blockingDesc, prometheus.GaugeValue, 1)
}

// silentServer is a server that accepts connections and never answers: a
// connection string for it, and a condition that holds once it accepted
// one.
func silentServer(t *testing.T) (dsn string, accepted func() bool) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan struct{}, 1)
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case got <- struct{}{}:
			default:
			}
		}
	}()
	return fmt.Sprintf("postgres://postgres@%s/bellhop?sslmode=disable", ln.Addr()), func() bool {
		select {
		case <-got:
			return true
		default:
			return false
		}
	}
}

// TestSetupDemoStoppedCleansUp: setup-demo stopped by SIGTERM (or
// SIGHUP) while it waits for the database removes the temporary secret
// file it made first (docker-compose stops it so during a slow start).
// It was killed with the file left in the secrets volume. It exits 1
// saying that it changed nothing, as migrate says it applied nothing; it
// said "connect to the database: context canceled".
func TestSetupDemoStoppedCleansUp(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			dsn, accepted := silentServer(t)
			dir := t.TempDir()
			p := start(t, []string{"DATABASE_URL=" + dsn}, "setup-demo", "--app", "shop", "--queue", "orders",
				"--url", "http://127.0.0.1:9/hook", "--secret-file", filepath.Join(dir, "orders"))
			waitFor(t, 30*time.Second, "setup-demo to connect", accepted)
			p.signal(sig)
			if code := p.wait(15 * time.Second); code != 1 {
				t.Errorf("exit %d after %s, want 1", code, sig)
			}
			if want := "bellhop: interrupted while connecting to the database: nothing was changed"; p.stderr() != want {
				t.Errorf("stderr %q after %s, want %q", p.stderr(), sig, want)
			}
			if left, _ := os.ReadDir(dir); len(left) != 0 {
				t.Errorf("left in the secret file's directory: %v", left)
			}
		})
	}
}

// TestConnectTimesOut: a command against a server that accepts the
// connection and never answers gives up after the default connect
// timeout, with exit 1 and a line that says so. It waited until the
// kernel gave up, about two minutes.
func TestConnectTimesOut(t *testing.T) {
	t.Parallel()
	dsn, _ := silentServer(t)
	start := time.Now()
	r := exe(t, dsn, "", "app", "ls")
	if took := time.Since(start); r.code != 1 || !strings.Contains(r.stderr, "timeout") || took > 30*time.Second {
		t.Errorf("after %s: %s; want exit 1 naming a timeout within 30s", took.Round(time.Second), r)
	}
}

// TestListenError: run --http-addr and example-consumer --addr exit 1
// where the system refuses a well-formed address (another process has
// it, this user may not bind its port, or the host has no such address),
// as for a conflict, and 2 for
// an address that is wrong in itself. example-consumer exited 2 for
// every error. EACCES is made up here: the tests may run as root, which
// may bind any port.
func TestListenError(t *testing.T) {
	t.Parallel()
	sysErr := func(errno syscall.Errno) error {
		return &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", errno)}
	}
	tests := []struct {
		name  string
		err   error
		usage bool
	}{
		{"in use", sysErr(syscall.EADDRINUSE), false},
		{"port not allowed", sysErr(syscall.EACCES), false},
		{"address not on this host", sysErr(syscall.EADDRNOTAVAIL), false},
		{"no port", &net.OpError{Op: "listen", Net: "tcp", Err: &net.AddrError{Err: "missing port in address", Addr: "x"}}, true},
		{"unknown host", &net.OpError{Op: "listen", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "x", IsNotFound: true}}, true},
	}
	for _, tc := range tests {
		err := listenError("--addr", "x:1", tc.err)
		// An operational error keeps the system's in its chain.
		if isUsage(err) != tc.usage || (!tc.usage && !errors.Is(err, tc.err)) || !strings.HasPrefix(err.Error(), `--addr "x:1": `) {
			t.Errorf("%s: %v (usage error: %t), want usage error: %t", tc.name, err, isUsage(err), tc.usage)
		}
	}
}

// TestStopWithItsLogPipeClosed: `bellhop run 2>&1 | tee run.log`, when
// the session closes or Ctrl-C comes, gets its stop signal just after tee
// died of its own. The stop's first log line then went to a pipe with no
// reader, and Go's default for a write to stderr so ended the process by
// SIGPIPE: no stop ran, and the deliveries in flight stayed leased until
// their visibility timeout (found by the lifecycle review). SIGPIPE is
// ignored now: the lines are lost, the stop runs and exits 0.
func TestStopWithItsLogPipeClosed(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary, "run", "--http-addr", "127.0.0.1:0")
	cmd.Env = baseEnv("DATABASE_URL=" + dsn)
	cmd.Stderr = w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close() // the daemon holds the only write end
	waited := make(chan error, 1)
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-waited
	})
	served := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if servingRE.MatchString(sc.Text()) {
				break
			}
		}
		r.Close() // the reader is gone, as tee is
		close(served)
	}()
	go func() { waited <- cmd.Wait() }()
	select {
	case <-served:
	case err := <-waited:
		waited <- err
		t.Fatalf("the daemon exited before serving: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the daemon did not say it was serving within 30s")
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		waited <- err
		if err != nil {
			t.Fatalf("the daemon, stopped with nobody reading its log: %v (want exit 0)", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the daemon did not exit within 30s of SIGTERM")
	}
}

// TestIgnoredHangupKeepsRunning: `nohup bellhop run` (started with SIGHUP
// ignored, as here through a shell's trap) goes on when its session's
// hangup comes, and a SIGTERM then stops it gracefully, the first stop
// signal it heard. signal.Notify used to undo the inherited "ignore": the
// hangup stopped the daemon, and the SIGTERM after it, a second signal,
// exited at once (130).
func TestIgnoredHangupKeepsRunning(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	p := startCmd(t, []string{"DATABASE_URL=" + dsn},
		exec.Command("sh", "-c", `trap "" HUP; exec "$0" "$@"`, binary, "run", "--http-addr", "127.0.0.1:0"))
	p.waitLine(true, servingRE, 30*time.Second)
	// Both pending at once are delivered lowest first: SIGHUP (1), then
	// SIGTERM (15).
	p.signal(syscall.SIGHUP)
	p.signal(syscall.SIGTERM)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGHUP then SIGTERM, want 0: the hangup was taken for a stop", code)
	}
	if m := p.waitLine(true, regexp.MustCompile(`"signal":"([a-z ]+)".*stopping gracefully`), time.Second); m[1] != "terminated" {
		t.Errorf("the stop was for %q, want SIGTERM's", m[1])
	}
}

// TestIgnoredInterruptSaid: a daemon started with SIGINT ignored (a
// background job of a non-interactive shell; here a shell's trap) says so
// at its start, naming SIGTERM to stop it: a Ctrl-C or `kill -INT` that
// did nothing left no trace. SIGHUP ignored (nohup) is meant, and not
// said. Nothing listens on port 1, so run exits after the line.
func TestIgnoredInterruptSaid(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		trap string
		want bool
	}{{"INT", true}, {"HUP", false}} {
		cmd := exec.Command("sh", "-c", `trap "" `+tc.trap+`; exec "$0" "$@"`, binary, "run", "--http-addr", "127.0.0.1:0")
		cmd.Env = baseEnv("DATABASE_URL=postgres://u@127.0.0.1:1/db")
		out, _ := cmd.CombinedOutput()
		said := regexp.MustCompile(`"signal":"SIGINT".*stays ignored: stop it with SIGTERM`).Match(out)
		if said != tc.want || strings.Contains(string(out), "hangup") {
			t.Errorf("SIGINT said ignored: %t, want %t (trap %s):\n%s", said, tc.want, tc.trap, out)
		}
	}
}

// TestRunSchemaCheckBounded: a schema check that gets no answer (here
// another session holds the version table, as a migration does) ends
// `run` after the connect timeout, exit 1, with a line that says what it
// waited for. It held the start-up, silent, for as long as the lock.
func TestRunSchemaCheckBounded(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	lockSchemaVersion(t, dsn)
	begun := time.Now()
	p := start(t, []string{"DATABASE_URL=" + dsn, "PGCONNECT_TIMEOUT=2"}, "run", "--http-addr", "127.0.0.1:0")
	if code := p.wait(30 * time.Second); code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	took := time.Since(begun)
	t.Logf("run gave up after %s", took.Round(time.Millisecond))
	if !strings.Contains(p.stderr(), "check the schema: no answer within 2s") {
		t.Errorf("stderr does not say the schema check got no answer: %s", p.stderr())
	}
}

// TestDescribeDB checks the settings line's database: every host the pool
// may try, in order and once each, and never the password.
func TestDescribeDB(t *testing.T) {
	for _, tc := range []struct{ dsn, want string }{
		{"postgres://u:secret@db1:5433/app?sslmode=disable", "u@db1:5433/app"},
		{"postgres://u:secret@db1:5433,db2,db3:6000/app?sslmode=disable", "u@db1:5433,db2:5432,db3:6000/app"},
		// sslmode=prefer gives each host a second try without TLS.
		{"postgres://u:secret@db1,db2/app?sslmode=prefer", "u@db1:5432,db2:5432/app"},
		{"host=/run/pg port=5499 user=u password=secret dbname=app", "u@/run/pg:5499/app"},
		{"host=db1,db2 port=5433,5434 user=u password=secret dbname=app sslmode=disable", "u@db1:5433,db2:5434/app"},
	} {
		cfg, err := pgxpool.ParseConfig(tc.dsn)
		if err != nil {
			t.Fatalf("%s: %v", tc.dsn, err)
		}
		if got := describeDB(cfg); got != tc.want {
			t.Errorf("describeDB(%q) = %q; want %q", tc.dsn, got, tc.want)
		}
	}
}

// TestProbesAnswerWhileStarting: while the daemon waits on the database
// (here its schema check, behind a lock a migration would hold), its port
// answers: /healthz 200, /readyz and /metrics 503; once the check passes,
// /readyz and /metrics answer 200. The port was bound and silent until the
// dispatcher was made, so that a liveness probe got no answer for as long
// as the start-up waited, up to the connect timeout per host (found by the
// metrics and probes review).
func TestProbesAnswerWhileStarting(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(context.Background(), "LOCK TABLE bellhop_schema_version IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.ConnectTimeout = time.Minute // the schema check's bound
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	var logs syncbuf.Buffer
	go func() {
		served <- serve(ctx, zerolog.New(&logs), cfg, ln, httppush.New(httppush.Options{}), func(int) {}, true,
			bellhop.DispatcherConfig{PollInterval: time.Hour})
	}()
	waitFor(t, 30*time.Second, "the schema check waiting for the lock", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks
			WHERE NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND relation = to_regclass('bellhop_schema_version')`) > 0
	})
	client := http.Client{Timeout: 5 * time.Second}
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := client.Get("http://" + ln.Addr().String() + path)
		if err != nil {
			t.Fatalf("GET %s while the daemon starts: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	for _, tc := range []struct {
		path string
		code int
		body string
	}{
		{"/healthz", http.StatusOK, "ok"},
		{"/readyz", http.StatusServiceUnavailable, "starting"},
		{"/metrics", http.StatusServiceUnavailable, "starting"},
	} {
		if code, body := get(tc.path); code != tc.code || body != tc.body {
			t.Errorf("GET %s while the daemon starts: %d %q, want %d %q", tc.path, code, body, tc.code, tc.body)
		}
	}
	// Nothing logged for the probes meanwhile: a start-up that fails says
	// one line, its error.
	if logs.String() != "" {
		t.Errorf("the daemon logged while it started:\n%s", logs.String())
	}
	if err := tx.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "/readyz 200 once started", func() bool {
		code, _ := get("/readyz")
		return code == http.StatusOK
	})
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "bellhop_listener_connected 1") {
		t.Errorf("GET /metrics once started: %d, want 200 with bellhop_listener_connected 1:\n%.2000s", code, body)
	}
	cancel()
	select {
	case err := <-served:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("serve after its context was cancelled: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("serve had not returned 30s after its context was cancelled")
	}
}
