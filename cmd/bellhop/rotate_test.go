package main

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
)

var (
	rotatedRE   = regexp.MustCompile(`(?m)^consumer ([0-9a-f-]{36}) of (\S+)/(\S+) has a new signing secret$`)
	keptUntilRE = regexp.MustCompile(`(?m)^the previous secret signs too until (\S+)$`)
)

// TestRotateSecretEndToEnd: `consumer rotate-secret` prints a new secret
// once; the running daemon then signs each request with the new secret
// and the old, so that a receiver holding either accepts it, until
// --keep-previous ends; with --keep-previous 0 only the new one signs.
// The consumer keeps its id and settings throughout.
func TestRotateSecretEndToEnd(t *testing.T) {
	t.Parallel()
	dsn := emptyDatabase(t)
	ok(t, dsn, "migrate")
	ok(t, dsn, "app", "create", "shop")
	h := newHook(t)
	id, oldSecret := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", h.srv.URL+"/hook", "--max-attempts", "4")
	h.setSecret(oldSecret)
	startDaemon(t, dsn)

	before := time.Now()
	out := ok(t, dsn, "consumer", "rotate-secret", "--app", "shop", "--keep-previous", "2h", id)
	m, s, kept := rotatedRE.FindStringSubmatch(out), secretRE.FindStringSubmatch(out), keptUntilRE.FindStringSubmatch(out)
	if m == nil || s == nil || kept == nil || m[1] != id || m[2] != "shop" || m[3] != "orders" {
		t.Fatalf("rotate-secret printed:\n%s\nwant the consumer, its new secret and the old one's end", out)
	}
	newSecret := s[1]
	if newSecret == oldSecret {
		t.Fatal("rotate-secret printed the old secret")
	}
	if until, err := time.Parse(time.RFC3339, kept[1]); err != nil || until.Before(before.Add(2*time.Hour-time.Minute)) || until.After(time.Now().Add(2*time.Hour+time.Minute)) {
		t.Errorf("the old secret signs until %s (%v), want two hours from now", kept[1], err)
	}

	// The daemon reloads on the rotation's notification; until then it
	// signs with the old secret alone. Each message is checked against
	// both secrets once a request carries two signatures.
	var both delivery
	waitFor(t, time.Minute, "a request signed with both secrets", func() bool {
		n := len(h.deliveries())
		enqueue(t, dsn, "shop", "orders", `{"n":1}`)
		ds := h.waitCount(t, n+1, 30*time.Second)
		both = ds[len(ds)-1]
		return strings.Count(both.header.Get(bellhop.HeaderSignature), "v1=") == 2
	})
	if both.verify != nil {
		t.Errorf("the old secret does not verify a request of the overlap: %v", both.verify)
	}
	if err := bellhop.VerifyPush(newSecret, both.header, both.body, time.Now(), time.Minute); err != nil {
		t.Errorf("the new secret does not verify a request of the overlap: %v", err)
	}
	if got := both.header.Get(bellhop.HeaderConsumerID); got != id {
		t.Errorf("request from consumer %s, want %s: the rotation replaced the consumer", got, id)
	}

	// Dropped at once: the next requests carry the newest secret's alone.
	out = ok(t, dsn, "consumer", "rotate-secret", "--app", "shop", "--keep-previous", "0", id)
	s = secretRE.FindStringSubmatch(out)
	if s == nil || !strings.Contains(out, "the previous secret no longer signs") {
		t.Fatalf("rotate-secret --keep-previous 0 printed:\n%s", out)
	}
	newest := s[1]
	h.setSecret(newest)
	waitFor(t, time.Minute, "a request signed with the newest secret alone", func() bool {
		n := len(h.deliveries())
		enqueue(t, dsn, "shop", "orders", `{"n":2}`)
		ds := h.waitCount(t, n+1, 30*time.Second)
		last := ds[len(ds)-1]
		return last.verify == nil && strings.Count(last.header.Get(bellhop.HeaderSignature), "v1=") == 1
	})
	pool := db(t, dsn)
	if n := queryInt(t, pool, `SELECT count(*) FROM queue_consumers WHERE id = $1 AND max_attempts = 4`, id); n != 1 {
		t.Errorf("after two rotations, %d consumers with the id and settings it had", n)
	}
}

// TestRotateSecretRefused: rotate-secret's mistakes get a clear error,
// exit 2 (bad input, as for the other consumer commands) and change
// nothing: a bad --keep-previous (before connecting), a Go handler's
// consumer, an unknown one or app, and a rotation that would stop the
// secret an earlier one keeps signing (from the database).
func TestRotateSecretRefused(t *testing.T) {
	t.Parallel()
	dsn := emptyDatabase(t)
	ok(t, dsn, "migrate")
	ok(t, dsn, "app", "create", "shop")
	id, _ := addConsumer(t, dsn, "--app", "shop", "--queue", "orders", "--url", "http://127.0.0.1:9/hook")
	// Its old secret signs for a day (the default).
	out := ok(t, dsn, "consumer", "rotate-secret", "--app", "shop", id)
	kept := keptUntilRE.FindStringSubmatch(out)
	if kept == nil {
		t.Fatalf("rotate-secret printed:\n%s\nwant when the old secret stops signing", out)
	}
	pool := db(t, dsn)
	// A Go handler's consumer: the CLI registers push consumers only.
	emails, err := bellhop.NewClient(pool).RegisterConsumer(t.Context(), bellhop.ConsumerSpec{App: "shop", Queue: "emails"})
	if err != nil {
		t.Fatal(err)
	}
	snapshot := func() string {
		var s string
		if err := pool.QueryRow(t.Context(), `SELECT string_agg(trigger_id || ':' || coalesce(push_secret, '-') || ':' || coalesce(push_secret_previous, '-'), ',' ORDER BY trigger_id)
			FROM queue_trigger_details`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()
	tests := []struct {
		name string
		args []string
		code int
		says string
	}{
		{"a negative time", []string{"--keep-previous", "-1s", id}, 2, "--keep-previous -1s: must be 0 to 168h0m0s"},
		{"over a week", []string{"--keep-previous", "169h", id}, 2, "--keep-previous 169h0m0s: must be 0 to 168h0m0s"},
		{"a Go handler's consumer", []string{emails.ID.String()}, 2, "served by a Go handler, which has no signing secret"},
		{"an unknown consumer", []string{"00000000-0000-4000-8000-000000000002"}, 2, "unknown consumer"},
		{"no id", []string{}, 2, "takes exactly one argument, CONSUMER_ID"},
		{"finer than a millisecond", []string{"--keep-previous", "1h0.5ms", id}, 2, "--keep-previous 1h0m0.0005s: must be 0 to 168h0m0s, in whole milliseconds"},
		{"while the previous secret signs", []string{id}, 2, "--keep-previous 24h0m0s: the secret an earlier rotation replaced signs until " + kept[1]},
		{"an unknown app", []string{"--app", "nope", id}, 2, `unknown app "nope"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := exe(t, dsn, "", append([]string{"consumer", "rotate-secret", "--app", "shop"}, tc.args...)...)
			if r.code != tc.code || !strings.Contains(r.stderr, tc.says) || r.stdout != "" {
				t.Errorf("%s\nwant exit %d saying %q, nothing on stdout", r, tc.code, tc.says)
			}
		})
	}
	if after := snapshot(); after != before {
		t.Error("a refused rotation changed a secret")
	}
}
