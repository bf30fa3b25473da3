package integration

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// TestSecretsNeverLogged: a full `bellhop run` at --log-level debug, on a
// DATABASE_URL whose password PostgreSQL really checks, pushes signed
// messages to consumers that ack, fail, reject and hang, through a
// listener cut, a pool cut and a server restart. Neither the password nor
// any consumer's signing secret appears in anything the daemon or the
// CLI printed (bar the one line of `consumer add` that shows the secret
// by design), nor in /metrics.
func TestSecretsNeverLogged(t *testing.T) {
	bin := buildBellhop(t, false)
	cluster := ownCluster(t, nil)
	ctx := context.Background()

	// A login role whose password is checked: TCP connections need
	// SCRAM; only the test's own unix-socket connection is trusted. The
	// password has characters a URL must escape.
	var rb [12]byte
	if _, err := rand.Read(rb[:]); err != nil {
		t.Fatal(err)
	}
	password := "Pw-" + hex.EncodeToString(rb[:]) + "/@:?#%&"
	su, err := pgx.Connect(ctx, cluster.ConnString("bellhop"))
	if err != nil {
		t.Fatal(err)
	}
	defer su.Close(ctx)
	if _, err := su.Exec(ctx, fmt.Sprintf(`CREATE ROLE bellhop_owner LOGIN SUPERUSER PASSWORD '%s'`,
		strings.ReplaceAll(password, "'", "''"))); err != nil {
		t.Fatal(err)
	}
	hba := "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
	if err := os.WriteFile(filepath.Join(cluster.Dir(), "data", "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		t.Fatal(err)
	}
	var reloaded bool
	if err := su.QueryRow(ctx, `SELECT pg_reload_conf()`).Scan(&reloaded); err != nil || !reloaded {
		t.Fatalf("pg_reload_conf: %v %v", reloaded, err)
	}
	dsnFor := func(pw, db string) string {
		u := url.URL{Scheme: "postgres", User: url.UserPassword("bellhop_owner", pw),
			Host: fmt.Sprintf("127.0.0.1:%d", cluster.Port()), Path: "/" + db, RawQuery: "sslmode=disable"}
		return u.String()
	}
	dsn := dsnFor(password, "bellhop")
	// The server checks the password (the reload applies to new
	// connections at once; poll in case it is not there yet).
	waitFor(t, 10*time.Second, "password authentication in force", func() bool {
		c, err := pgx.Connect(ctx, dsnFor("wrong-password", "bellhop"))
		if err == nil {
			c.Close(ctx)
			return false
		}
		return strings.Contains(err.Error(), "password authentication failed")
	})
	if c, err := pgx.Connect(ctx, dsn); err != nil {
		t.Fatalf("the right password is refused: %v", err)
	} else {
		c.Close(ctx)
	}

	// The consumer endpoint: verifies every request with the secrets.
	var secretsMu sync.Mutex
	secrets := map[string]string{} // queue -> secret
	var verified, badSig, doubleSigned atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		queue := strings.TrimPrefix(r.URL.Path, "/")
		secretsMu.Lock()
		secret := secrets[queue]
		secretsMu.Unlock()
		if err := bellhop.VerifyPush(secret, r.Header, body, time.Now(), 0); err != nil {
			badSig.Add(1)
			http.Error(w, "bad signature", http.StatusUnauthorized)
			return
		}
		verified.Add(1)
		if strings.Count(r.Header.Get(bellhop.HeaderSignature), "v1=") == 2 {
			doubleSigned.Add(1)
		}
		switch queue {
		case "ok":
			w.WriteHeader(http.StatusOK)
		case "fail":
			http.Error(w, "temporarily broken", http.StatusInternalServerError)
		case "reject":
			http.Error(w, "never valid", http.StatusUnprocessableEntity)
		case "hang": // past the push timeout (vt 1s less its margin)
			select {
			case <-r.Context().Done():
			case <-time.After(3 * time.Second):
			}
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()

	// Everything the CLI and the daemon print is scanned at the end.
	var outputs []string
	cli := func(args ...string) cliResult {
		t.Helper()
		r := mustCLI(t, bin, dsn, args...)
		outputs = append(outputs, r.stdout, r.stderr)
		return r
	}
	cli("migrate")
	cli("app", "create", "app")
	secretRe := regexp.MustCompile(`signing secret \(shown only now\): (\S+)`)
	consumerIDRe := regexp.MustCompile(`consumer (\S+) registered for`)
	consumerIDs := map[string]string{} // queue -> consumer id
	for _, q := range []string{"ok", "fail", "reject", "hang"} {
		r := runCLI(bin, dsn, "consumer", "add", "--app", "app", "--queue", q, "--url", srv.URL+"/"+q,
			"--visibility-timeout", "1s", "--max-attempts", "2", "--backoff-min", "50ms", "--backoff-max", "100ms")
		if r.err != nil {
			t.Fatalf("consumer add: %v\n%s%s", r.err, r.stdout, r.stderr)
		}
		m := secretRe.FindStringSubmatch(r.stdout)
		id := consumerIDRe.FindStringSubmatch(r.stdout)
		if m == nil || id == nil {
			t.Fatalf("consumer add printed no secret or id:\n%s", r.stdout)
		}
		consumerIDs[q] = id[1]
		secretsMu.Lock()
		secrets[q] = m[1]
		secretsMu.Unlock()
		// Its stdout shows the secret by design (once, to the operator);
		// everything else it printed must not.
		outputs = append(outputs, secretRe.ReplaceAllString(r.stdout, "signing secret (shown only now): <redacted by the test>"), r.stderr)
	}
	// A daemon that cannot start (no such database) reports why without
	// the password.
	if r := runCLI(bin, dsnFor(password, "no_such_db"), "run", "--http-addr", "127.0.0.1:0"); r.err == nil {
		t.Errorf("bellhop run on a missing database exited 0")
	} else {
		outputs = append(outputs, r.stdout, r.stderr)
	}

	d := newDaemon(t, "secrets-daemon", bin, dsn, "--log-level", "debug", "--poll-interval", "1s")
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	defer d.stop(15 * time.Second)
	waitFor(t, 30*time.Second, "the daemon ready", d.ready)

	pc, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	enqueueAll := func(round int) {
		t.Helper()
		for _, q := range []string{"ok", "fail", "reject", "hang"} {
			for i := range 3 {
				if _, err := client.Enqueue(ctx, "app", q, fmt.Appendf(nil, `{"round":%d,"i":%d}`, round, i), bellhop.EnqueueOptions{}); err != nil {
					t.Fatal(err)
				}
			}
		}
		cli("enqueue", "--app", "app", "--queue", "ok", fmt.Sprintf(`{"round":%d,"via":"cli"}`, round))
	}
	count := func(sql string) int {
		t.Helper()
		var n int
		if err := su.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	settled := func(what string) {
		t.Helper()
		waitFor(t, 30*time.Second, what, func() bool { return count(`SELECT count(*) FROM queue_messages`) == 0 })
	}
	enqueueAll(1)
	settled("round 1 settled")

	// A rotation: the daemon, at debug level, now holds two secrets of
	// "ok", and signs with both; the endpoint keeps checking the old one.
	rotated := runCLI(bin, dsn, "consumer", "rotate-secret", "--app", "app", "--keep-previous", "1h", consumerIDs["ok"])
	if rotated.err != nil {
		t.Fatalf("consumer rotate-secret: %v\n%s%s", rotated.err, rotated.stdout, rotated.stderr)
	}
	m := secretRe.FindStringSubmatch(rotated.stdout)
	if m == nil {
		t.Fatalf("consumer rotate-secret printed no secret:\n%s", rotated.stdout)
	}
	rotatedSecret := m[1]
	outputs = append(outputs, secretRe.ReplaceAllString(rotated.stdout, "signing secret (shown only now): <redacted by the test>"), rotated.stderr)

	// Faults that make the daemon log connection errors: cut its
	// listener and pool, then restart the server.
	before, _ := d.scrape()
	reconnects, _ := metric(before, "bellhop_listener_reconnects_total")
	if _, err := su.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name IN ('bellhop-listener', 'bellhop-dispatcher')`); err != nil {
		t.Fatal(err)
	}
	su.Close(ctx)
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	err = cluster.Restart(rctx, "fast")
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if su, err = pgx.Connect(ctx, cluster.ConnString("bellhop")); err != nil {
		t.Fatal(err)
	}
	defer su.Close(ctx)
	waitFor(t, 30*time.Second, "the daemon's listener back", func() bool {
		text, err := d.scrape()
		v, ok := metric(text, "bellhop_listener_reconnects_total")
		return err == nil && ok && v > reconnects && d.ready()
	})
	enqueueAll(2)
	settled("round 2 settled")

	if n := count(`SELECT count(*) FROM dead_letters`); n != 2*3*3 {
		t.Errorf("%d dead letters, want %d (fail, reject and hang queues, two rounds)", n, 2*3*3)
	}
	metricsText, err := d.scrape()
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := metric(metricsText, "bellhop_listener_reconnects_total"); v < 1 {
		t.Errorf("the listener never reconnected: the faults were not seen")
	}
	outputs = append(outputs, metricsText)
	for _, path := range []string{"/readyz", "/healthz"} {
		resp, err := d.get(path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		outputs = append(outputs, string(b))
	}
	if err := d.signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if exited, err := d.wait(15 * time.Second); !exited || err != nil {
		t.Errorf("daemon stop: exited %t, %v", exited, err)
	}
	logBytes, err := os.ReadFile(d.logPath)
	if err != nil {
		t.Fatal(err)
	}
	daemonLog := string(logBytes)
	outputs = append(outputs, daemonLog)

	// The run did what the scan needs: signed pushes, logged at debug.
	if v := verified.Load(); v < 2*13 {
		t.Errorf("%d verified pushes, want at least %d", v, 2*13)
	}
	if n := badSig.Load(); n > 0 {
		t.Errorf("%d pushes failed signature verification", n)
	}
	// Round 2's pushes to "ok" came after the rotation and the listener's
	// reconnect, which reloads the consumers: signed with both secrets.
	if n := doubleSigned.Load(); n < 4 {
		t.Errorf("%d pushes signed with two secrets, want round 2's 4 to ok at least", n)
	}
	if n := strings.Count(daemonLog, `"push delivery"`); n < 2*13 {
		t.Errorf("%d debug lines about push deliveries, want at least %d: was the daemon at debug level?", n, 2*13)
	}
	for _, want := range []string{"listener connection lost", "dead-lettered", "will retry"} {
		if !strings.Contains(daemonLog, want) {
			t.Errorf("the daemon log has no %q line: the scan did not cover that path", want)
		}
	}

	needles := map[string]string{
		"the database password":               password,
		"the database password, URL-escaped":  url.QueryEscape(password),
		"the database password, path-escaped": url.PathEscape(password),
	}
	secretsMu.Lock()
	secrets["ok, rotated"] = rotatedSecret
	for q, s := range secrets {
		needles["the signing secret of "+q] = s
		needles["the first half of the signing secret of "+q] = s[:len(s)/2]
	}
	secretsMu.Unlock()
	all := strings.Join(outputs, "\n")
	for what, needle := range needles {
		if i := strings.Index(all, needle); i >= 0 {
			t.Errorf("%s appears in the output: ...%s...", what, all[max(0, i-120):min(len(all), i+len(needle)+40)])
		}
	}
	t.Logf("scanned %d bytes of CLI output, daemon log (%d lines) and /metrics for %d secrets", len(all),
		strings.Count(daemonLog, "\n"), len(needles))
}
