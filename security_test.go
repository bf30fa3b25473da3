package bellhop_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/migrations"
	"github.com/bellhopq/bellhop/notify"
)

// runDispatcher runs a Dispatcher on connString until the test ends.
func runDispatcher(t *testing.T, connString string, r bellhop.Resolver, tweaks ...func(*bellhop.DispatcherConfig)) *bellhop.Dispatcher {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	return runDispatcherOn(t, cfg, r, tweaks...)
}

// runDispatcherOn is runDispatcher with a pool configuration.
func runDispatcherOn(t *testing.T, cfg *pgxpool.Config, r bellhop.Resolver, tweaks ...func(*bellhop.DispatcherConfig)) *bellhop.Dispatcher {
	t.Helper()
	dc := bellhop.DispatcherConfig{Resolver: r, Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel), PollInterval: time.Hour}
	for _, tw := range tweaks {
		tw(&dc)
	}
	d, err := bellhop.NewDispatcher(cfg, dc)
	if err != nil {
		t.Fatal(err)
	}
	stoppable(t, context.Background(), d)
	return d
}

// stoppable starts d and waits until it is ready; stop cancels its Run
// and returns Run's error (once: later calls return nil). The test's end
// stops it too, failing the test on an error not returned before.
func stoppable(t *testing.T, ctx context.Context, d *bellhop.Dispatcher) (stop func() error) {
	t.Helper()
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(rctx) }()
	var once sync.Once
	stop = func() (err error) {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("dispatcher: %v", err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for d.Ready(ctx) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("dispatcher not ready: %v", d.Ready(ctx))
		}
		time.Sleep(5 * time.Millisecond)
	}
	return stop
}

// TestAppIsolation: consumers of two apps with the same queue name each
// receive only their own app's messages.
func TestAppIsolation(t *testing.T) {
	e := fxNew(t)
	e.app("alpha")
	e.app("beta")
	for _, app := range []string{"alpha", "beta"} {
		if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: app, Queue: "orders"}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	got := map[string][]string{}
	record := func(app string) bellhop.Handler {
		return bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
			mu.Lock()
			defer mu.Unlock()
			got[app] = append(got[app], string(m.Payload))
			return nil
		})
	}
	mux := bellhop.NewMux()
	mux.Handle("alpha", "orders", record("alpha"))
	mux.Handle("beta", "orders", record("beta"))
	runDispatcher(t, e.pool.Config().ConnString(), mux)

	const n = 20
	for i := range n {
		for _, app := range []string{"alpha", "beta"} {
			if _, err := e.client.Enqueue(e.ctx, app, "orders", []byte(`"`+app+`"`), bellhop.EnqueueOptions{}); err != nil {
				t.Fatalf("enqueue %d to %s: %v", i, app, err)
			}
		}
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		mu.Lock()
		done := len(got["alpha"]) >= n && len(got["beta"]) >= n
		mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("deliveries: alpha %d, beta %d, want %d each", len(got["alpha"]), len(got["beta"]), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	for app, payloads := range got {
		for _, p := range payloads {
			if p != `"`+app+`"` {
				t.Errorf("consumer of %s received %s", app, p)
			}
		}
	}
}

// TestPrincipalIsolation: a Client acting as a principal of app A can act
// on A, and on nothing of app B.
func TestPrincipalIsolation(t *testing.T) {
	e := fxNew(t)
	a := e.app("alpha")
	e.app("beta")
	cb, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "beta", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	// One dead letter in beta to try to redrive and purge.
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
	        SELECT gen_random_uuid(), 'queue', id, 'orders', '{}', now(), 3, 3, 'x' FROM apps WHERE name = 'beta'`)
	before := e.tableState("dead_letters") + e.tableState("triggers") + e.tableState("queue_trigger_details") + e.tableState("queue_messages")

	asA := e.client.As(a.DefaultPrincipal)
	enabled := false
	tests := []struct {
		name string
		do   func() error
		want error
	}{
		{"register in B", func() error {
			_, err := asA.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "beta", Queue: "other"})
			return err
		}, bellhop.ErrForbidden},
		{"update B's consumer", func() error {
			return asA.UpdateConsumer(e.ctx, "beta", cb.ID, bellhop.ConsumerUpdate{Enabled: &enabled})
		}, bellhop.ErrForbidden},
		{"update B's consumer through A", func() error {
			return asA.UpdateConsumer(e.ctx, "alpha", cb.ID, bellhop.ConsumerUpdate{Enabled: &enabled})
		}, bellhop.ErrUnknownConsumer},
		{"pause B's consumer", func() error { return asA.SetConsumerEnabled(e.ctx, "beta", cb.ID, false) }, bellhop.ErrForbidden},
		{"remove B's consumer", func() error { return asA.RemoveConsumer(e.ctx, "beta", cb.ID) }, bellhop.ErrForbidden},
		{"remove B's consumer through A", func() error { return asA.RemoveConsumer(e.ctx, "alpha", cb.ID) }, bellhop.ErrUnknownConsumer},
		{"redrive B's dead letters", func() error {
			_, err := asA.Redrive(e.ctx, "beta", "orders", uuid.Nil)
			return err
		}, bellhop.ErrForbidden},
		{"purge B's dead letters", func() error {
			_, err := asA.PurgeDead(e.ctx, "beta", "orders", uuid.Nil)
			return err
		}, bellhop.ErrForbidden},
		{"enqueue to B", func() error {
			_, err := asA.Enqueue(e.ctx, "beta", "orders", []byte(`{}`), bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrForbidden},
		// An empty batch writes nothing, but used to report success
		// whatever the app and principal.
		{"enqueue an empty batch to B", func() error {
			_, err := asA.EnqueueMany(e.ctx, "beta", nil)
			return err
		}, bellhop.ErrForbidden},
		{"enqueue an empty batch as no principal", func() error {
			_, err := e.client.As(uuid.Nil).EnqueueMany(e.ctx, "alpha", nil)
			return err
		}, bellhop.ErrForbidden},
		{"enqueue an empty batch to no app", func() error {
			_, err := e.client.EnqueueMany(e.ctx, "no-such-app", []bellhop.NewMessage{})
			return err
		}, bellhop.ErrUnknownApp},
		// Looked up by its id, the client's own principal was used
		// whatever name the spec gave.
		{"register in A as another principal", func() error {
			_, err := asA.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "alpha", Queue: "other", Principal: "ghost"})
			return err
		}, bellhop.ErrForbidden},
		{"add a principal to B", func() error {
			_, err := asA.CreatePrincipal(e.ctx, "beta", "intruder")
			return err
		}, bellhop.ErrForbidden},
		{"create an app", func() error {
			_, err := asA.CreateApp(e.ctx, "gamma")
			return err
		}, bellhop.ErrForbidden},
		{"look up B's consumer", func() error {
			_, err := asA.ConsumerOf(e.ctx, "beta", "orders")
			return err
		}, bellhop.ErrForbidden},
		{"invoke B's consumer", func() error {
			_, err := asA.InvokeAsync(e.ctx, cb.ID, []byte(`{}`), bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrUnknownConsumer},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.do(); !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
	after := e.tableState("dead_letters") + e.tableState("triggers") + e.tableState("queue_trigger_details") + e.tableState("queue_messages")
	if after != before {
		t.Fatalf("B's data changed:\nbefore %s\nafter  %s", before, after)
	}

	if n := e.int64(`SELECT count(*) FROM principals WHERE name = 'intruder'`) + e.int64(`SELECT count(*) FROM apps WHERE name = 'gamma'`); n != 0 {
		t.Errorf("%d principals or apps created through A", n)
	}

	// The same principal may act on its own app, and is recorded.
	if _, err := asA.CreatePrincipal(e.ctx, "alpha", "worker"); err != nil {
		t.Errorf("add a principal to own app: %v", err)
	}
	ca, err := asA.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "alpha", Queue: "orders"})
	if err != nil {
		t.Fatalf("register in own app: %v", err)
	}
	if ca.PrincipalID != a.DefaultPrincipal {
		t.Errorf("consumer registered by %s, want %s", ca.PrincipalID, a.DefaultPrincipal)
	}
	if _, err := asA.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "alpha", Queue: "own-name", Principal: "default"}); err != nil {
		t.Errorf("register in own app, naming its own principal: %v", err)
	}
	if _, err := asA.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "alpha", Queue: "as-worker", Principal: "worker"}); !errors.Is(err, bellhop.ErrForbidden) {
		t.Errorf("register in own app as another of its principals: %v, want ErrForbidden", err)
	}
	if ids, err := asA.EnqueueMany(e.ctx, "alpha", nil); err != nil || len(ids) != 0 {
		t.Errorf("enqueue an empty batch to own app: %v, %v; want no ids and no error", ids, err)
	}
	id, err := asA.Enqueue(e.ctx, "alpha", "orders", []byte(`{}`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatalf("enqueue to own app: %v", err)
	}
	if by := e.uuid(`SELECT enqueued_by_principal FROM queue_messages WHERE id = $1`, id); by != a.DefaultPrincipal {
		t.Errorf("enqueued_by_principal = %s, want %s", by, a.DefaultPrincipal)
	}

	// Listings that name no app list A's only: B's queue, consumer and
	// dead letter are not shown. An operator's list every app's.
	e.exec(`INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
	        SELECT gen_random_uuid(), 'queue', id, 'orders', '{}', now(), 3, 3, 'x' FROM apps WHERE name = 'alpha'`)
	listings := []struct {
		name string
		list func(c *bellhop.Client) ([]string, error) // the apps of what it lists
	}{
		{"apps", func(c *bellhop.Client) ([]string, error) {
			as, err := c.Apps(e.ctx)
			var names []string
			for _, x := range as {
				names = append(names, x.Name)
			}
			return names, err
		}},
		{"queues", func(c *bellhop.Client) ([]string, error) {
			qs, err := c.Queues(e.ctx, "")
			var names []string
			for _, x := range qs {
				names = append(names, x.App)
			}
			return names, err
		}},
		{"consumers", func(c *bellhop.Client) ([]string, error) {
			cs, err := c.Consumers(e.ctx, "")
			var names []string
			for _, x := range cs {
				names = append(names, x.App)
			}
			return names, err
		}},
		{"dead letters", func(c *bellhop.Client) ([]string, error) {
			ds, err := c.DeadLetters(e.ctx, bellhop.DeadFilter{})
			var names []string
			for _, x := range ds {
				names = append(names, x.App)
			}
			return names, err
		}},
	}
	for _, l := range listings {
		t.Run("list "+l.name, func(t *testing.T) {
			got, err := l.list(asA)
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(got)
			if got = slices.Compact(got); !slices.Equal(got, []string{"alpha"}) {
				t.Errorf("a principal of alpha lists %s of apps %v, want alpha's only", l.name, got)
			}
			all, err := l.list(e.client)
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(all)
			if all = slices.Compact(all); !slices.Equal(all, []string{"alpha", "beta"}) {
				t.Errorf("an operator lists %s of apps %v, want both", l.name, all)
			}
		})
	}
	if _, err := e.client.As(uuid.New()).Queues(e.ctx, ""); !errors.Is(err, bellhop.ErrForbidden) {
		t.Errorf("a principal that does not exist lists queues: %v, want ErrForbidden", err)
	}
}

func (e *fxEnv) uuid(sql string, args ...any) uuid.UUID {
	e.t.Helper()
	var u uuid.UUID
	if err := e.pool.QueryRow(e.ctx, sql, args...).Scan(&u); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return u
}

// TestLeastPrivilegeRoles applies docs/roles.sql and shows that a producer
// can enqueue but cannot read, change or delete messages, nor read offers,
// and that a dispatcher logged in with only bellhop_dispatcher delivers,
// polls, and has messages leased to it at INSERT by the producer.
func TestLeastPrivilegeRoles(t *testing.T) {
	e := fxNew(t)
	a := e.app("shop")
	script, err := os.ReadFile("docs/roles.sql")
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`GRANT CREATE ON SCHEMA public TO PUBLIC`) // PostgreSQL 14's default
	e.exec(string(script))
	e.exec(string(script)) // idempotent
	if e.int64(`SELECT has_schema_privilege('public', 'public', 'CREATE')::int`) != 0 {
		t.Error("after docs/roles.sql, every role may still create objects in schema public")
	}

	conn, err := e.pool.Acquire(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	defer conn.Exec(context.Background(), "RESET ROLE")
	if _, err := conn.Exec(e.ctx, "SET ROLE bellhop_producer"); err != nil {
		t.Fatal(err)
	}
	allowed := []string{
		`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ('` + a.ID.String() + `', 'orders', '{"by":"insert"}')`,
		`SELECT enqueue('` + a.ID.String() + `', 'orders', '{"by":"enqueue"}')`,
	}
	for _, sql := range allowed {
		if _, err := conn.Exec(e.ctx, sql); err != nil {
			t.Errorf("producer: %s: %v", sql, err)
		}
	}
	denied := []string{
		`SELECT payload FROM queue_messages`,
		`DELETE FROM queue_messages`,
		`UPDATE queue_messages SET attempt = 0`,
		`SELECT * FROM dead_letters`,
		`SELECT * FROM bellhop_offers`,
		`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ('` + a.ID.String() + `', 'orders', '{}') RETURNING payload`,
		// The dispatcher's columns: a message cannot arrive leased or
		// with attempts used.
		`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at) VALUES ('` + a.ID.String() + `', 'orders', '{}', gen_random_uuid(), now())`,
		`INSERT INTO queue_messages (app_id, queue_name, payload, attempt) VALUES ('` + a.ID.String() + `', 'orders', '{}', 2)`,
		`DELETE FROM apps`,
	}
	for _, sql := range denied {
		_, err := conn.Exec(e.ctx, sql)
		if code := pgCodeOf(err); code != "42501" {
			t.Errorf("producer: %s: got %v, want permission denied (42501)", sql, err)
		}
	}
	if _, err := conn.Exec(e.ctx, "RESET ROLE"); err != nil {
		t.Fatal(err)
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages`); n != 2 {
		t.Fatalf("%d messages, want the producer's 2", n)
	}

	// A dispatcher that logs in with only bellhop_dispatcher's rights.
	dsn := e.login("bh_dispatcher_", "bellhop_dispatcher")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		t.Fatal(err)
	}
	var handled sync.WaitGroup
	handled.Add(3)
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		handled.Done()
		return nil
	}))
	// `bellhop run` reads the schema version before it starts.
	dpool, err := pgxpool.New(e.ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	var version int
	err = dpool.QueryRow(e.ctx, `SELECT version FROM `+migrations.VersionTable).Scan(&version)
	dpool.Close()
	if err != nil || version == 0 {
		t.Errorf("the dispatcher role reads schema version %d: %v", version, err)
	}
	d := runDispatcher(t, dsn, mux, func(c *bellhop.DispatcherConfig) {
		c.LeaseAtInsert, c.PollInterval = true, 200*time.Millisecond
	})
	// Once the two are delivered the queue is idle and the lane offers;
	// the polls extend the offer.
	deadline := time.Now().Add(10 * time.Second)
	for e.int64(`SELECT count(*) FROM bellhop_offers WHERE expires_at > now()`) != 1 || e.int64(`SELECT count(*) FROM queue_messages`) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the dispatcher role made no offer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := conn.Exec(e.ctx, "SET ROLE bellhop_producer"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(e.ctx, allowed[0]); err != nil {
		t.Fatalf("producer: %v", err)
	}
	if _, err := conn.Exec(e.ctx, "RESET ROLE"); err != nil {
		t.Fatal(err)
	}
	waitGroupTimeout(t, &handled, 15*time.Second)
	if st := d.LeaseStats(); st.Leased != 1 {
		t.Errorf("LeaseStats = %+v; want the producer's third message leased", st)
	}
	// The lane's new offer, which the polls extend.
	var first time.Time
	deadline = time.Now().Add(10 * time.Second)
	for {
		var until *time.Time
		if err := e.pool.QueryRow(e.ctx, `SELECT max(expires_at) FROM bellhop_offers`).Scan(&until); err != nil {
			t.Fatal(err)
		}
		if until != nil && first.IsZero() {
			first = *until
		} else if until != nil && until.After(first) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dispatcher role's polls did not extend its offer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	deadline = time.Now().Add(10 * time.Second)
	for e.int64(`SELECT count(*) FROM queue_messages`) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the dispatcher role could not ack")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReadmeInsertColumns: the README's plain INSERT lists, as required
// (in its example) or optional, every column that docs/roles.sql lets a
// producer set. It left out id, which a producer sets to know its
// message's id without RETURNING, and which the README's account of dead
// letters and redrive takes producers to choose.
func TestReadmeInsertColumns(t *testing.T) {
	t.Parallel()
	script, err := os.ReadFile("docs/roles.sql")
	if err != nil {
		t.Fatal(err)
	}
	grant := regexp.MustCompile(`GRANT INSERT \(([^)]*)\)\s+ON queue_messages TO bellhop_producer`).FindSubmatch(script)
	if grant == nil {
		t.Fatal("docs/roles.sql grants bellhop_producer no INSERT columns of queue_messages")
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(readme)), " ")
	example := regexp.MustCompile(`INSERT INTO queue_messages \(([^)]*)\) VALUES`).FindStringSubmatch(text)
	_, optional, found := strings.Cut(text, "Optional columns:")
	if example == nil || !found {
		t.Fatal("README.md has no plain INSERT example followed by \"Optional columns:\"")
	}
	optional, _, _ = strings.Cut(optional, "The claim columns")
	required := strings.Split(example[1], ", ")
	for _, col := range strings.Split(string(grant[1]), ",") {
		col = strings.TrimSpace(col)
		if !slices.Contains(required, col) && !strings.Contains(optional, "`"+col+"`") {
			t.Errorf("docs/roles.sql lets a producer INSERT %s, which the README's optional columns (%q) do not name", col, strings.TrimSpace(optional))
		}
	}
}

func pgCodeOf(err error) string {
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return pe.SQLState()
	}
	return ""
}

func pgxpoolExec(connString, sql string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, connString)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	tag, err := pool.Exec(ctx, sql)
	return tag.RowsAffected(), err
}

func waitGroupTimeout(t *testing.T, wg *sync.WaitGroup, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("not done within %s", d)
	}
}

// TestFloorTriggersNotAttachable: the timeout floors' trigger functions
// are SECURITY DEFINER, and PUBLIC could execute them: a role with no
// rights could attach one to a temporary table of its own and, firing it
// with rows it made up, plant a 12-hour floor on another app's queue,
// which held that queue's expired leases back from the reclaim. Migration
// 0061 revokes EXECUTE from PUBLIC. The triggers on Bellhop's tables still
// fire for a role that is not the owner: a lowered timeout leaves its
// floor.
func TestFloorTriggersNotAttachable(t *testing.T) {
	e := fxNew(t)
	nobody, err := pgx.Connect(e.ctx, e.login("bh_nobody_", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer nobody.Close(context.Background())
	for _, tc := range []struct{ fn, table, event string }{
		{"bellhop_vt_lowered", "(trigger_id uuid, queue_name text, visibility_timeout_secs int)", "AFTER UPDATE"},
		{"bellhop_start_vt_floors", "(trigger_id uuid, queue_name text, visibility_timeout_secs int)", "AFTER UPDATE"},
		{"bellhop_vt_removed", "(id uuid, app_id uuid)", "BEFORE DELETE"},
	} {
		err := pgx.BeginFunc(e.ctx, nobody, func(tx pgx.Tx) error {
			if _, err := tx.Exec(e.ctx, `CREATE TEMP TABLE x `+tc.table); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(e.ctx, `CREATE TRIGGER x `+tc.event+` ON x FOR EACH ROW EXECUTE FUNCTION public.`+tc.fn+`()`); err != nil {
				return err
			}
			return errAttached // roll back, for the next case's table
		})
		if errors.Is(err, errAttached) {
			err = nil
		}
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42501" {
			t.Errorf("a role with no rights attached %s to a table of its own: %v, want permission denied", tc.fn, err)
		}
	}

	// An operator role that may change consumers, but owns nothing.
	e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", VisibilityTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	op, err := pgx.Connect(e.ctx, e.login("bh_op_", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close(context.Background())
	e.exec(`GRANT SELECT, UPDATE ON queue_trigger_details TO ` + op.Config().User)
	if _, err := op.Exec(e.ctx, `UPDATE queue_trigger_details SET visibility_timeout_secs = 5 WHERE trigger_id = $1`, c.ID); err != nil {
		t.Fatal(err)
	}
	if n := e.int64(`SELECT count(*) FROM bellhop_vt_floors WHERE queue_name = 'orders' AND vt_secs = 60`); n != 1 {
		t.Errorf("lowering the timeout as another role left %d floors, want 1", n)
	}
}

// errAttached rolls back a transaction in which a trigger was attached.
var errAttached = errors.New("trigger attached")

// TestLeaseMessageOnlyOwnRows: bellhop_lease_message, SECURITY DEFINER and
// callable by every role, leases only a row its calling transaction
// inserted (migration 0051). A role with no right on queue_messages that
// calls it from a trigger of its own temporary table, naming another
// transaction's committed message, leases nothing and locks neither the
// message nor the offer. A producer's own INSERT is leased; one made under
// a savepoint is not (it is announced and claimed instead).
func TestLeaseMessageOnlyOwnRows(t *testing.T) {
	e := fxNew(t)
	a := e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	victim, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owner := uuid.New()
	offer := func() uuid.UUID {
		return e.uuid(`INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
			VALUES (gen_random_uuid(), $1, 'orders', $3, 'bellhop_l_test', now() + interval '1 minute', $2)
			RETURNING token`, a.ID, c.ID, owner)
	}
	token := offer()
	before := e.tableState("queue_messages")

	dsn := e.login("bh_nobody_", "")
	nobody, err := pgx.Connect(e.ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer nobody.Close(context.Background())
	tx, err := nobody.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	leased, err := leaseFromTrigger(e.ctx, tx, victim, a.ID, "orders")
	if err != nil {
		t.Fatal(err)
	}
	if leased {
		t.Error("a role with no rights leased another transaction's message")
	}
	// Its transaction still open: the message and the offer are free.
	for what, sql := range map[string]string{
		"the message": `SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE NOWAIT`,
		"the offer":   `SELECT 1 FROM bellhop_offers WHERE token = $1 FOR UPDATE NOWAIT`,
	} {
		id := victim
		if what == "the offer" {
			id = token
		}
		if err := pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(e.ctx, sql, id)
			return err
		}); err != nil {
			t.Errorf("%s is locked by the call: %v", what, err)
		}
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Errorf("the messages changed:\nbefore %s\nafter  %s", before, after)
	}

	// A producer's own rows, with the offers' leasing dispatcher connected
	// (the lease key and its owner key held shared).
	holdLeaseKeys(t, e, owner)
	insert := `INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '{}') RETURNING id`
	var own, saved uuid.UUID
	if err := pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
		return tx.QueryRow(e.ctx, insert, a.ID).Scan(&own)
	}); err != nil {
		t.Fatal(err)
	}
	second := offer()
	if err := pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
		return pgx.BeginFunc(e.ctx, tx, func(sp pgx.Tx) error { // a savepoint
			return sp.QueryRow(e.ctx, insert, a.ID).Scan(&saved)
		})
	}); err != nil {
		t.Fatal(err)
	}
	if got := e.uuid(`SELECT coalesce(claim_token, '00000000-0000-0000-0000-000000000000') FROM queue_messages WHERE id = $1`, own); got != token {
		t.Errorf("the producer's own message has claim token %s, want the offer's %s", got, token)
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, saved); n != 1 {
		t.Error("a message inserted under a savepoint was leased")
	}
	if n := e.int64(`SELECT count(*) FROM bellhop_offers WHERE token = $1`, second); n != 1 {
		t.Error("the savepoint's insert took the offer")
	}
}

// TestLeaseAtInsertOfferGuards: a message is leased at INSERT only under an
// offer of its own app and queue (a same-named queue of another app is
// another queue: its handler must not get the message), that has not
// expired, and whose consumer still serves the queue (nothing else would
// measure the lease). Otherwise the message stays unclaimed and the offer
// is left for a message it may take. The offers' leasing dispatcher is
// connected throughout (the lease key and its owner key held shared).
func TestLeaseAtInsertOfferGuards(t *testing.T) {
	e := fxNew(t)
	shop, rival := e.app("shop"), e.app("rival")
	owner := uuid.New()
	holdLeaseKeys(t, e, owner)

	for _, tc := range []struct {
		name, queue string
		offerApp    bellhop.App   // whose consumer of the queue makes the offer
		expiresIn   time.Duration // the offer's expires_at from now
		moved       bool          // the consumer moved to another queue after the offer
		leased      bool
	}{
		{name: "own offer", queue: "own", offerApp: shop, expiresIn: time.Minute, leased: true},
		{name: "other app's offer", queue: "shared", offerApp: rival, expiresIn: time.Minute},
		{name: "expired offer", queue: "expired", offerApp: shop, expiresIn: -time.Minute},
		{name: "consumer moved", queue: "moved", offerApp: shop, expiresIn: time.Minute, moved: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			queue := tc.queue
			c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: tc.offerApp.Name, Queue: queue})
			if err != nil {
				t.Fatal(err)
			}
			token := e.uuid(`INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
				VALUES (gen_random_uuid(), $1, $2, $3, 'bellhop_l_test', now() + $4 * interval '1 millisecond', $5)
				RETURNING token`, tc.offerApp.ID, queue, owner, tc.expiresIn.Milliseconds(), c.ID)
			if tc.moved {
				e.exec(`UPDATE queue_trigger_details SET queue_name = 'elsewhere' WHERE trigger_id = $1`, c.ID)
			}
			id, err := e.client.Enqueue(e.ctx, "shop", queue, []byte(`{}`), bellhop.EnqueueOptions{})
			if err != nil {
				t.Fatal(err)
			}
			leased := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token = $2`, id, token) == 1
			unclaimed := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id) == 1
			offered := e.int64(`SELECT count(*) FROM bellhop_offers WHERE token = $1`, token) == 1
			if leased != tc.leased || unclaimed == tc.leased || offered == tc.leased {
				t.Errorf("shop's message under %s's offer: leased %t, unclaimed %t, offer left %t; want leased %t",
					tc.offerApp.Name, leased, unclaimed, offered, tc.leased)
			}
		})
	}
}

// TestLeaseAtInsertFarEnqueuedAt: a message whose enqueued_at does not fit
// the lease notification's bigint of microseconds since 1970 (after
// 294247-01-10 UTC; PostgreSQL takes times up to the year 294276, and a
// producer may set enqueued_at) is not leased at INSERT: its producer
// commits, it is announced with q: to be claimed, and the offer is left.
// Before (0055's function), with the offers' leasing dispatcher connected
// (the lease key and its owner key held shared), the producer's COMMIT
// failed "bigint out of range" in bellhop_lease_message and rolled its
// whole transaction back. The last microsecond that PostgreSQL's
// extract(epoch) gives exactly is leased, and its lease notification
// parses back to that time.
func TestLeaseAtInsertFarEnqueuedAt(t *testing.T) {
	e := fxNew(t)
	a, c := e.appConsumer("shop", "orders")
	owner := uuid.New()
	holdLeaseKeys(t, e, owner)
	queue := e.listen()
	leases, err := pgx.ConnectConfig(e.ctx, e.pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer leases.Close(context.Background())
	if _, err := leases.Exec(e.ctx, `LISTEN bellhop_l_test`); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name, at string // enqueued_at
		leased   bool
	}{
		{"2024", "2024-05-01 12:00:00.123456+00", true},
		{"last exact microsecond", "294247-01-10 04:00:54.775806+00", true},
		{"a second later", "294247-01-10 04:00:55+00", false},
		{"year 294250", "294250-01-01 00:00:00+00", false},
		{"latest PostgreSQL takes", "294276-12-31 23:59:59.999999+00", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := e.uuid(`INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
				VALUES (gen_random_uuid(), $1, 'orders', $2, 'bellhop_l_test', now() + interval '1 minute', $3)
				RETURNING token`, a.ID, owner, c.ID)
			var id uuid.UUID
			if err := pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
				return tx.QueryRow(e.ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at)
					VALUES ($1, 'orders', '{"n":1}', $2::text::timestamptz) RETURNING id`, a.ID, tc.at).Scan(&id)
			}); err != nil {
				t.Fatalf("the producer's transaction: %v", err)
			}
			leased := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token = $2`, id, token) == 1
			unclaimed := e.int64(`SELECT count(*) FROM queue_messages WHERE id = $1 AND claim_token IS NULL`, id) == 1
			offered := e.int64(`SELECT count(*) FROM bellhop_offers WHERE token = $1`, token) == 1
			if leased != tc.leased || unclaimed == tc.leased || offered == tc.leased {
				t.Fatalf("enqueued_at %s: leased %t, unclaimed %t, offer left %t; want leased %t",
					tc.at, leased, unclaimed, offered, tc.leased)
			}
			if !tc.leased {
				if got, want := queue.next(), fxQueuePayload(a.ID, "orders"); got != want {
					t.Errorf("notification %q, want %q", got, want)
				}
				queue.noMore()
				e.exec(`DELETE FROM bellhop_offers WHERE token = $1`, token)
				return
			}
			queue.noMore()
			ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
			defer cancel()
			n, err := leases.WaitForNotification(ctx)
			if err != nil {
				t.Fatalf("wait for the lease notification: %v", err)
			}
			l, err := notify.ParseLease(n.Payload)
			if err != nil {
				t.Fatal(err)
			}
			var want time.Time
			if err := e.pool.QueryRow(e.ctx, `SELECT enqueued_at FROM queue_messages WHERE id = $1`, id).Scan(&want); err != nil {
				t.Fatal(err)
			}
			if l.Token != token || l.ID != id || !l.EnqueuedAt.Equal(want) {
				t.Errorf("lease of %s under %s enqueued at %s; want %s under %s enqueued at %s",
					l.ID, l.Token, l.EnqueuedAt.UTC(), id, token, want.UTC())
			}
		})
	}
}

// leaseFromTrigger calls bellhop_lease_message for message id of app's
// queue from a trigger, as it must be called, of a temporary table that tx
// makes, and returns its answer. A role without rights can do the same.
func leaseFromTrigger(ctx context.Context, tx pgx.Tx, id, app uuid.UUID, queue string) (leased bool, err error) {
	for _, sql := range []string{
		`CREATE TEMP TABLE t (leased boolean)`,
		`CREATE FUNCTION pg_temp.f() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN
		     NEW.leased := public.bellhop_lease_message('` + id.String() + `', '` + app.String() + `', '` + queue + `');
		     RETURN NEW;
		 END $$`,
		`CREATE TRIGGER f BEFORE INSERT ON t FOR EACH ROW EXECUTE FUNCTION pg_temp.f()`,
	} {
		if _, err := tx.Exec(ctx, sql); err != nil {
			return false, fmt.Errorf("%s: %w", sql, err)
		}
	}
	err = tx.QueryRow(ctx, `INSERT INTO t VALUES (NULL) RETURNING leased`).Scan(&leased)
	return leased, err
}

// holdLeaseKeys holds the lease key and owner's key shared, as a leasing
// dispatcher's listener does, until the test ends.
func holdLeaseKeys(t *testing.T, e *fxEnv, owner uuid.UUID) {
	t.Helper()
	key, err := e.pool.Acquire(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(key.Release)
	if _, err := key.Exec(e.ctx, `SELECT pg_advisory_lock_shared(1650814063, 0),
		pg_advisory_lock_shared(hashtextextended($1::text, 1650814064))`, owner); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = key.Exec(context.Background(), `SELECT pg_advisory_unlock_shared(1650814063, 0),
			pg_advisory_unlock_shared(hashtextextended($1::text, 1650814064))`, owner)
	})
}

// TestEnqueuedByIsSelfDeclared pins what the docs say of EnqueuedBy:
// enqueue() and the Go client refuse a principal that is not of the app,
// but nothing checks a plain INSERT's enqueued_by_principal (no foreign
// key, which would cost every INSERT). Another app's principal, or one
// that does not exist, is accepted and shows up as the Message's and the
// DeadLetter's EnqueuedBy. Should a constraint be added, this fails, and
// the docs that call the value self-declared must change with it.
func TestEnqueuedByIsSelfDeclared(t *testing.T) {
	e := fxNew(t)
	shop := e.app("shop")
	other := e.app("other")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxAttempts: 1}); err != nil {
		t.Fatal(err)
	}
	ghost := uuid.New()

	// The checked ways refuse both.
	for _, p := range []uuid.UUID{other.DefaultPrincipal, ghost} {
		var id uuid.UUID
		err := e.pool.QueryRow(e.ctx, `SELECT enqueue($1, 'orders', '{}', NULL, NULL, $2)`, shop.ID, p).Scan(&id)
		if pgCodeOf(err) != "BH005" {
			t.Errorf("enqueue() as principal %s: %v, want BH005", p, err)
		}
		_, err = e.client.Enqueue(e.ctx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{Principal: p})
		if !errors.Is(err, bellhop.ErrUnknownPrincipal) {
			t.Errorf("Client.Enqueue as principal %s: %v, want ErrUnknownPrincipal", p, err)
		}
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages`); n != 0 {
		t.Fatalf("%d messages after refused enqueues", n)
	}

	// A plain INSERT declares what it likes.
	want := map[uuid.UUID]uuid.UUID{} // message id: its declared principal
	for _, p := range []uuid.UUID{other.DefaultPrincipal, ghost} {
		id := uuid.New()
		e.exec(`INSERT INTO queue_messages (id, app_id, queue_name, payload, max_attempts, enqueued_by_principal)
		        VALUES ($1, $2, 'orders', '{}', 1, $3)`, id, shop.ID, p)
		want[id] = p
	}

	type seen struct{ id, by uuid.UUID }
	handled := make(chan seen, len(want))
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		var by uuid.UUID
		if m.EnqueuedBy != nil {
			by = *m.EnqueuedBy
		}
		handled <- seen{m.ID, by}
		return errors.New("dead-letter it")
	}))
	runDispatcher(t, e.pool.Config().ConnString(), mux)
	for range want {
		select {
		case s := <-handled:
			if s.by != want[s.id] {
				t.Errorf("message %s delivered with EnqueuedBy %s, want the declared %s", s.id, s.by, want[s.id])
			}
		case <-time.After(15 * time.Second):
			t.Fatal("the inserted messages were not delivered")
		}
	}
	var dead []bellhop.DeadLetter
	waitUntil(t, 15*time.Second, "both dead letters", func() bool {
		var err error
		dead, err = e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", OmitPayload: true})
		if err != nil {
			t.Fatal(err)
		}
		return len(dead) == len(want)
	})
	for _, d := range dead {
		if d.EnqueuedBy == nil || *d.EnqueuedBy != want[d.ID] {
			t.Errorf("dead letter %s: EnqueuedBy %v, want the declared %s", d.ID, d.EnqueuedBy, want[d.ID])
		}
	}
}

// TestForeignBusyKeyDelaysOnly pins the README's and docs/roles.sql's
// caveat: a role with no grant at all, only the right to connect, can
// hold a queue's busy key, an advisory lock that cannot be revoked; the
// queue's producers then skip their notifications, but the message is
// still delivered (by the fallback poll, and later ones as the
// dispatcher watches the key), not lost.
func TestForeignBusyKeyDelaysOnly(t *testing.T) {
	e := fxNew(t)
	shop := e.app("shop")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		t.Fatal(err)
	}
	stranger, err := pgx.Connect(e.ctx, e.login("bh_stranger_", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close(context.Background())
	if _, err := stranger.Exec(e.ctx, `SELECT pg_advisory_lock(hashtextextended($1::text || ':' || 'orders', 1650814062))`, shop.ID); err != nil {
		t.Fatalf("a role without grants holds the busy key: %v", err)
	}

	l := e.listen()
	first := e.uuid(`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '{}') RETURNING id`, shop.ID)
	l.noMore() // no notification for it

	handled := make(chan uuid.UUID, 2)
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		handled <- m.ID
		return nil
	}))
	runDispatcher(t, e.pool.Config().ConnString(), mux, func(c *bellhop.DispatcherConfig) { c.PollInterval = time.Second })
	second := uuid.Nil
	for _, want := range []uuid.UUID{first, second} {
		if want == uuid.Nil {
			// With the key still held: announced to nobody either.
			want = e.uuid(`INSERT INTO queue_messages (app_id, queue_name, payload) VALUES ($1, 'orders', '{}') RETURNING id`, shop.ID)
		}
		select {
		case got := <-handled:
			if got != want {
				t.Errorf("delivered %s, want %s", got, want)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("message %s not delivered while another role held the busy key", want)
		}
	}
}

// TestDefinerFunctionsIgnorePublic: Bellhop's SECURITY DEFINER functions
// look up no name in schema public but their own, written public.<name>
// (migration 0066). PostgreSQL picks, among the candidates on the path,
// the function whose argument types fit a call best, wherever it sits on
// the path: a role that may create in public planted one that fits
// better than pg_catalog's, and its code ran as the functions' owner.
// Each case plants such a function, which raises naming the role it runs
// as, and calls the Bellhop function that would reach it.
func TestDefinerFunctionsIgnorePublic(t *testing.T) {
	e := fxNew(t)
	if bad := e.int64(`SELECT count(*) FROM pg_proc
		WHERE prosecdef AND pronamespace = 'public'::regnamespace
		  AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (proconfig), false)`); bad != 0 {
		t.Errorf("%d SECURITY DEFINER functions in public do not set search_path = pg_catalog, pg_temp", bad)
	}
	if n := e.int64(`SELECT count(*) FROM pg_proc WHERE prosecdef AND pronamespace = 'public'::regnamespace`); n < 7 {
		t.Errorf("%d SECURITY DEFINER functions in public, want at least the 7 of 0066", n)
	}

	a := e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", VisibilityTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	e.uuid(`INSERT INTO bellhop_offers (token, app_id, queue_name, owner, channel, expires_at, consumer_id)
		VALUES (gen_random_uuid(), $1, 'orders', gen_random_uuid(), 'bellhop_l_test', now() + interval '1 hour', $2)
		RETURNING token`, a.ID, c.ID)
	// A floor for bellhop_start_seen_vt_floors to start.
	e.exec(`UPDATE queue_trigger_details SET visibility_timeout_secs = 5 WHERE trigger_id = $1`, c.ID)

	dsn := e.login("bh_planter_", "")
	planter, err := pgx.Connect(e.ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer planter.Close(context.Background())
	role := planter.Config().User
	e.exec(`GRANT CREATE ON SCHEMA public TO ` + role)
	e.exec(`GRANT EXECUTE ON FUNCTION enqueue(uuid, text, jsonb, timestamptz, int, uuid) TO ` + role)
	// Before login's cleanup drops the role: what it owns and was granted.
	t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), `DROP OWNED BY `+role) })

	for _, tc := range []struct {
		name, planted string
		call          func(tx pgx.Tx) error
	}{
		{
			// enqueue()'s second argument is a literal, which takes text
			// before jsonpath.
			name:    "enqueue",
			planted: `jsonb_path_exists(jsonb, text) RETURNS boolean`,
			call: func(tx pgx.Tx) error {
				_, err := tx.Exec(e.ctx, `SELECT enqueue($1, 'orders', '{"n":1}')`, a.ID)
				return err
			},
		},
		{
			// The offer's owner key: hashtextextended(text, bigint) called
			// with an integer literal.
			name:    "bellhop_lease_message",
			planted: `hashtextextended(text, integer) RETURNS bigint`,
			call: func(tx pgx.Tx) error {
				var id uuid.UUID
				if err := tx.QueryRow(e.ctx, `SELECT enqueue($1, 'orders', '{"n":2}')`, a.ID).Scan(&id); err != nil {
					return err
				}
				_, err := leaseFromTrigger(e.ctx, tx, id, a.ID, "orders")
				return err
			},
		},
		{
			// make_interval(secs => an integer).
			name:    "bellhop_start_seen_vt_floors",
			planted: `make_interval(secs integer) RETURNS interval`,
			call: func(tx pgx.Tx) error {
				var started int64
				if err := tx.QueryRow(e.ctx, `SELECT public.bellhop_start_seen_vt_floors()`).Scan(&started); err != nil {
					return err
				}
				if started != 1 {
					t.Errorf("bellhop_start_seen_vt_floors started %d floors, want the lowered timeout's 1", started)
				}
				return nil
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fn := tc.planted[:strings.Index(tc.planted, " RETURNS")]
			if _, err := planter.Exec(e.ctx, `CREATE FUNCTION public.`+tc.planted+` LANGUAGE plpgsql AS $$
				BEGIN RAISE EXCEPTION 'planted `+fn+` ran as %', current_user; END $$`); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if _, err := planter.Exec(context.Background(), `DROP FUNCTION public.`+fn); err != nil {
					t.Fatal(err)
				}
			}()
			tx, err := planter.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			if err := tc.call(tx); err != nil {
				t.Errorf("%s, called by a role that may create in public: %v", tc.name, err)
			}
		})
	}
}
