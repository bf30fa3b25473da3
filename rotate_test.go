package bellhop_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/migrations"
	queries "github.com/bellhopq/bellhop/sql"
)

// resolvedConsumers is a Resolver that serves no consumer and keeps the
// last Consumer a dispatcher resolved for each id: what a push handler
// would be made from.
type resolvedConsumers struct {
	mu   sync.Mutex
	last map[uuid.UUID]bellhop.Consumer
}

func (r *resolvedConsumers) Resolve(c bellhop.Consumer) bellhop.Handler {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last == nil {
		r.last = make(map[uuid.UUID]bellhop.Consumer)
	}
	r.last[c.ID] = c
	return nil
}

// waitFor returns the Consumer resolved for id once ok holds for it,
// failing the test after a minute.
func (r *resolvedConsumers) waitFor(t *testing.T, id uuid.UUID, what string, ok func(bellhop.Consumer) bool) bellhop.Consumer {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		r.mu.Lock()
		c, seen := r.last[id]
		r.mu.Unlock()
		if seen && ok(c) {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dispatcher did not resolve consumer %s with %s within a minute; last: %v", id, what, c)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRotateConsumerSecret: a rotation gives a push consumer a new secret,
// made by the server and never sent to it, keeps its id and settings, and
// keeps the old secret signing for the time asked: a running dispatcher's
// Resolver is given both, a listing only the old one's end. 0 drops the
// old one at once, and one past its end is given to nobody.
func TestRotateConsumerSecret(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	cfg, err := pgxpool.ParseConfig(e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	rec := &sentRecorder{}
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(e.ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := bellhop.NewClient(pool)
	e.app("shop")
	const url = "http://127.0.0.1:9/hook"
	orders, err := c.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", URL: url, MaxAttempts: 7})
	if err != nil {
		t.Fatal(err)
	}
	resolved := &resolvedConsumers{}
	runDispatcher(t, e.pool.Config().ConnString(), resolved)
	resolved.waitFor(t, orders.ID, "its secret", func(got bellhop.Consumer) bool { return got.Secret == orders.Secret })

	before := time.Now()
	rot, err := c.RotateConsumerSecret(e.ctx, "shop", orders.ID, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	if !pushSecretForm.MatchString(rot.Secret) || rot.Secret == orders.Secret {
		t.Errorf("new secret %q: want 64 lowercase hex characters, not the old secret %q", rot.Secret, orders.Secret)
	}
	if rot.ID != orders.ID || rot.URL != url || rot.MaxAttempts != 7 || rot.Queue != "orders" || rot.App != "shop" {
		t.Errorf("rotation returned %v; want the same consumer, %v", rot, orders)
	}
	// The server's clock and this one are the same host's.
	if until := rot.PreviousSecretUntil; until.Before(before.Add(time.Hour-time.Second)) || until.After(after.Add(time.Hour+time.Second)) {
		t.Errorf("PreviousSecretUntil %s, want an hour after the rotation (%s .. %s)", until, before, after)
	}
	if rot.PreviousSecret != "" {
		t.Error("the rotation returned the previous secret, which its caller had")
	}
	if !rec.sentSQL(queries.ConsumerRotateSecret) {
		t.Fatal("the rotation's statement was not seen: the recorder watches the wrong pool")
	}
	for _, s := range []string{rot.Secret, orders.Secret} {
		if leaks := rec.leaks(s); len(leaks) > 0 {
			t.Errorf("a secret was sent to the server: %s", strings.Join(leaks, "; "))
		}
	}

	// A running dispatcher reloads and is given both secrets.
	got := resolved.waitFor(t, orders.ID, "the new secret", func(got bellhop.Consumer) bool { return got.Secret == rot.Secret })
	if got.PreviousSecret != orders.Secret || !got.PreviousSecretUntil.Equal(rot.PreviousSecretUntil) {
		t.Errorf("the dispatcher was given previous secret %q until %s, want %q until %s",
			got.PreviousSecret, got.PreviousSecretUntil, orders.Secret, rot.PreviousSecretUntil)
	}
	// Listings give when the old secret stops signing, not a secret.
	list, err := c.Consumers(e.ctx, "shop")
	if err != nil || len(list) != 1 {
		t.Fatalf("Consumers: %v, %v", list, err)
	}
	if l := list[0]; l.Secret != "" || l.PreviousSecret != "" || !l.PreviousSecretUntil.Equal(rot.PreviousSecretUntil) {
		t.Errorf("listed %v (previous until %s), want no secret and the previous one's end %s", l, l.PreviousSecretUntil, rot.PreviousSecretUntil)
	}

	// Rotated again at once with 0: the old secrets no longer sign.
	rot2, err := c.RotateConsumerSecret(e.ctx, "shop", orders.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rot2.Secret == rot.Secret || rot2.Secret == orders.Secret || !rot2.PreviousSecretUntil.IsZero() {
		t.Errorf("rotation with 0: secret %q, previous until %s; want a third secret and none previous", rot2.Secret, rot2.PreviousSecretUntil)
	}
	got = resolved.waitFor(t, orders.ID, "the third secret", func(got bellhop.Consumer) bool { return got.Secret == rot2.Secret })
	if got.PreviousSecret != "" || !got.PreviousSecretUntil.IsZero() {
		t.Errorf("after a rotation with 0 the dispatcher was given previous secret %q until %s, want none", got.PreviousSecret, got.PreviousSecretUntil)
	}

	// A previous secret past its end is given to nobody.
	rot3, err := c.RotateConsumerSecret(e.ctx, "shop", orders.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	resolved.waitFor(t, orders.ID, "the fourth secret", func(got bellhop.Consumer) bool {
		return got.Secret == rot3.Secret && got.PreviousSecret == rot2.Secret
	})
	e.exec(`UPDATE queue_trigger_details SET push_secret_previous_until = now() - interval '1 second' WHERE trigger_id = $1`, orders.ID)
	// A consumer's change (here: a pause) makes the dispatcher reload.
	if err := c.SetConsumerEnabled(e.ctx, "shop", orders.ID, false); err != nil {
		t.Fatal(err)
	}
	got = resolved.waitFor(t, orders.ID, "the pause", func(got bellhop.Consumer) bool { return !got.Enabled })
	if got.Secret != rot3.Secret || got.PreviousSecret != "" || !got.PreviousSecretUntil.IsZero() {
		t.Errorf("past its end, the dispatcher was given previous secret %q until %s (secret kept: %t), want none",
			got.PreviousSecret, got.PreviousSecretUntil, got.Secret == rot3.Secret)
	}
	if l, err := c.ConsumerOf(e.ctx, "shop", "orders"); err != nil || !l.PreviousSecretUntil.IsZero() {
		t.Errorf("ConsumerOf past the previous secret's end: previous until %s, %v; want zero", l.PreviousSecretUntil, err)
	}
}

// TestRotateConsumerSecretRefused: a rotation that cannot be done says
// why and changes nothing: a Go handler's consumer (no secret), an id
// that is not the app's consumer, an unknown app, another app for a
// principal, times to keep the old secret out of range, keeping the
// current secret while an earlier one still signs (which would stop that
// one unasked), and a consumer whose secret was removed by hand (whose
// rotation broke the table's check, printing the new secret in the
// server's log). 0 is taken for the last two.
func TestRotateConsumerSecretRefused(t *testing.T) {
	t.Parallel()
	e := fxNew(t)
	shop := e.app("shop")
	e.app("other")
	orders, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", URL: "http://127.0.0.1:9/hook"})
	if err != nil {
		t.Fatal(err)
	}
	emails, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "emails"})
	if err != nil {
		t.Fatal(err)
	}
	otherApp, err := e.client.CreatePrincipal(e.ctx, "other", "ops")
	if err != nil {
		t.Fatal(err)
	}
	// orders' old secret signs for an hour: keeping its current one now
	// would stop that one unasked.
	first, err := e.client.RotateConsumerSecret(e.ctx, "shop", orders.ID, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	// A push consumer whose secret was removed by hand has none to keep.
	broken, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "broken", URL: "http://127.0.0.1:9/hook"})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`UPDATE queue_trigger_details SET push_secret = NULL WHERE trigger_id = $1`, broken.ID)
	tests := []struct {
		name   string
		client *bellhop.Client
		app    string
		id     uuid.UUID
		keep   time.Duration
		want   error
		says   string
	}{
		{"a Go handler's consumer", e.client, "shop", emails.ID, time.Hour, bellhop.ErrInvalidOptions, "served by a Go handler"},
		{"an unknown consumer", e.client, "shop", uuid.New(), time.Hour, bellhop.ErrUnknownConsumer, ""},
		{"another app's consumer", e.client, "other", orders.ID, time.Hour, bellhop.ErrUnknownConsumer, ""},
		{"an unknown app", e.client, "nope", orders.ID, time.Hour, bellhop.ErrUnknownApp, ""},
		{"another app's principal", e.client.As(otherApp), "shop", orders.ID, time.Hour, bellhop.ErrForbidden, ""},
		{"a negative time", e.client, "shop", orders.ID, -time.Second, bellhop.ErrInvalidOptions, "keep previous secret -1s is outside 0s..168h0m0s"},
		{"over a week", e.client, "shop", orders.ID, bellhop.MaxKeepPreviousSecret + time.Millisecond, bellhop.ErrInvalidOptions, "outside"},
		{"finer than a millisecond", e.client, "shop", orders.ID, time.Hour + time.Microsecond, bellhop.ErrInvalidOptions, "whole number of milliseconds"},
		{"while the previous secret signs", e.client, "shop", orders.ID, time.Minute, bellhop.ErrInvalidOptions,
			"keep previous secret 1m0s: the secret an earlier rotation replaced signs until " + first.PreviousSecretUntil.UTC().Format(time.RFC3339)},
		{"a consumer without its secret", e.client, "shop", broken.ID, time.Hour, bellhop.ErrInvalidOptions, "has no signing secret to keep"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := e.tableState("queue_trigger_details")
			_, err := tc.client.RotateConsumerSecret(e.ctx, tc.app, tc.id, tc.keep)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) || !strings.Contains(err.Error(), tc.id.String()) {
				t.Errorf("RotateConsumerSecret: %v; want %v, saying %q and naming the consumer", err, tc.want, tc.says)
			}
			if after := e.tableState("queue_trigger_details"); after != before {
				t.Errorf("a refused rotation changed the consumers: %s, then %s", before, after)
			}
		})
	}
	// The app's own principal may rotate; with 0, while the previous
	// secret signs, which stops both older secrets.
	rot, err := e.client.As(shop.DefaultPrincipal).RotateConsumerSecret(e.ctx, "shop", orders.ID, 0)
	if err != nil || rot.Secret == first.Secret || !rot.PreviousSecretUntil.IsZero() {
		t.Errorf("the app's own principal, with 0: %v (previous until %s)", err, rot.PreviousSecretUntil)
	}
	if l, err := e.client.ConsumerOf(e.ctx, "shop", "orders"); err != nil || !l.PreviousSecretUntil.IsZero() {
		t.Errorf("after a rotation with 0: previous until %s, %v; want none", l.PreviousSecretUntil, err)
	}
	// 0 gives the consumer without a secret one.
	if rot, err := e.client.RotateConsumerSecret(e.ctx, "shop", broken.ID, 0); err != nil || !pushSecretForm.MatchString(rot.Secret) {
		t.Errorf("a consumer without its secret, with 0: %v", err)
	}
}

// TestConsumersBeforeRotationSchema: this release's consumer statements
// read the columns and call the function that 0068_secret_rotation.sql
// adds. On a database still at the migration before it (a new binary or
// library before `bellhop migrate`) each fails with ErrSchemaBehind,
// telling to migrate, and writes nothing, while the updates that read
// none of them run on; after the migration the consumer registered
// before it is listed, with its secret unchanged. The README's upgrade
// note lists the same calls.
func TestConsumersBeforeRotationSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	files, err := migrations.Files()
	if err != nil {
		t.Fatal(err)
	}
	v := slices.IndexFunc(files, func(f migrations.File) bool { return f.Name == "0068_secret_rotation.sql" })
	if v < 0 {
		t.Fatal("no migration 0068_secret_rotation.sql")
	}
	cfg := emptyDatabase(t)
	migrateTo(t, cfg, v) // the versions before 0068's
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := bellhop.NewClient(pool)
	shop, err := c.CreateApp(ctx, "shop")
	if err != nil {
		t.Fatalf("CreateApp before 0068: %v", err)
	}
	// A push consumer as the release before registered it, its secret
	// made by the client.
	const secret = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2"
	var orders uuid.UUID
	if err := pool.QueryRow(ctx, `
		WITH t AS (
			INSERT INTO triggers (app_id, kind, principal_id) VALUES ($1, 'queue', $2) RETURNING id
		)
		INSERT INTO queue_trigger_details (trigger_id, queue_name, push_url, push_secret)
		SELECT id, 'orders', 'http://127.0.0.1:9/hook', $3 FROM t
		RETURNING trigger_id`, shop.ID, shop.DefaultPrincipal, secret).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	state := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM triggers) || ' triggers, '
			|| (SELECT md5(string_agg(d::text, ',' ORDER BY d::text)) FROM queue_trigger_details d)`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := state()
	for _, tc := range []struct {
		name string
		do   func() error
	}{
		{"RegisterConsumer with a URL", func() error {
			_, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "emails", URL: "http://127.0.0.1:9/hook"})
			return err
		}},
		{"RegisterConsumer for a Go handler", func() error {
			_, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "emails"})
			return err
		}},
		{"UpdateConsumer with a URL", func() error {
			u := "http://127.0.0.1:9/other"
			return c.UpdateConsumer(ctx, "shop", orders, bellhop.ConsumerUpdate{URL: &u})
		}},
		{"UpdateConsumer with a timeout", func() error {
			d := time.Second
			return c.UpdateConsumer(ctx, "shop", orders, bellhop.ConsumerUpdate{Timeout: &d})
		}},
		{"RotateConsumerSecret", func() error { _, err := c.RotateConsumerSecret(ctx, "shop", orders, time.Hour); return err }},
		{"Consumers", func() error { _, err := c.Consumers(ctx, "shop"); return err }},
		{"ConsumerOf", func() error { _, err := c.ConsumerOf(ctx, "shop", "orders"); return err }},
	} {
		err := tc.do()
		if !errors.Is(err, migrations.ErrSchemaBehind) || strings.Count(err.Error(), "bellhop migrate") != 1 {
			t.Errorf("%s before 0068: %v; want ErrSchemaBehind, telling to run bellhop migrate once", tc.name, err)
		}
		if after := state(); after != before {
			t.Errorf("%s before 0068 changed the consumers: %s, then %s", tc.name, before, after)
		}
	}
	// What reads no new column runs on.
	two := 2
	if err := c.UpdateConsumer(ctx, "shop", orders, bellhop.ConsumerUpdate{MaxAttempts: &two}); err != nil {
		t.Errorf("UpdateConsumer of max attempts before 0068: %v", err)
	}
	if err := c.SetConsumerEnabled(ctx, "shop", orders, false); err != nil {
		t.Errorf("SetConsumerEnabled before 0068: %v", err)
	}
	migrateTo(t, cfg, len(files))
	got, err := c.ConsumerOf(ctx, "shop", "orders")
	if err != nil || got.ID != orders || got.URL != "http://127.0.0.1:9/hook" || got.MaxAttempts != 2 || got.Enabled || !got.PreviousSecretUntil.IsZero() {
		t.Fatalf("after the migration: %+v, %v; want consumer %s as registered, with no previous secret", got, err, orders)
	}
	var kept string
	if err := pool.QueryRow(ctx, `SELECT push_secret FROM queue_trigger_details WHERE trigger_id = $1`, orders).Scan(&kept); err != nil || kept != secret {
		t.Errorf("the migration changed the consumer's secret (%v)", err)
	}
	rot, err := c.RotateConsumerSecret(ctx, "shop", orders, time.Hour)
	if err != nil || rot.Secret == secret || !pushSecretForm.MatchString(rot.Secret) {
		t.Errorf("a rotation after the migration: %v", err)
	}
}
