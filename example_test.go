package bellhop_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// databaseURL stands in, in these examples, for your program's
// os.Getenv("DATABASE_URL"): a database migrated with `bellhop migrate`
// (or migrations.Migrate). Each call gives a new one on the test server.
func databaseURL() string {
	dsn, err := pgtest.Database()
	if err != nil {
		log.Fatal(err)
	}
	return dsn
}

// A producer enqueues a message, and a dispatcher in the same program
// pushes it to a Go handler.
func Example() {
	ctx := context.Background()
	url := databaseURL() // your os.Getenv("DATABASE_URL"), migrated by `bellhop migrate`

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	// Once: an app, and the queue's consumer (a later run finds both).
	if _, err := client.CreateApp(ctx, "shop"); err != nil && !errors.Is(err, bellhop.ErrAppExists) {
		log.Fatal(err)
	}
	_, err = client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil && !errors.Is(err, bellhop.ErrConsumerExists) {
		log.Fatal(err)
	}

	handled := make(chan struct{})
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		fmt.Printf("%s/%s, attempt %d of %d: %s\n", m.App, m.Queue, m.Attempt, m.MaxAttempts, m.Payload)
		close(handled)
		return nil // ack: the message is deleted
	}))
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		log.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{
		Resolver: mux,
		Logger:   zerolog.New(os.Stderr).Level(zerolog.WarnLevel),
	})
	if err != nil {
		log.Fatal(err)
	}

	if _, err := client.Enqueue(ctx, "shop", "orders", []byte(`{"order_id":42}`), bellhop.EnqueueOptions{}); err != nil {
		log.Fatal(err)
	}
	// A program runs the dispatcher until it is told to stop; this one
	// stops it after the first message. Run's clean stop writes the ack
	// before it returns.
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	select {
	case <-handled:
	case err := <-done:
		log.Fatal(err) // it could not start
	case <-time.After(time.Minute):
		log.Fatal("no delivery within a minute")
	}
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}

	queues, err := client.Queues(ctx, "shop")
	if err != nil {
		log.Fatal(err)
	}
	for _, q := range queues {
		fmt.Printf("%s: %d ready, %d in flight\n", q.Queue, q.Ready, q.InFlight)
	}
	// Output:
	// shop/orders, attempt 1 of 5: {"order_id": 42}
	// orders: 0 ready, 0 in flight
}

// A handler that knows retrying cannot help returns Permanent: the message
// goes to the dead letters at once. Once the cause is fixed, Redrive
// delivers it again.
func ExamplePermanent() {
	ctx := context.Background()
	url := databaseURL() // your os.Getenv("DATABASE_URL"), migrated by `bellhop migrate`

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	if _, err := client.CreateApp(ctx, "shop"); err != nil {
		log.Fatal(err)
	}
	if _, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		log.Fatal(err)
	}

	handled := make(chan struct{})
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		defer close(handled)
		return bellhop.Permanent(errors.New("no such customer"))
	}))
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		log.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{
		Resolver: mux,
		Logger:   zerolog.New(os.Stderr).Level(zerolog.WarnLevel),
	})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := client.Enqueue(ctx, "shop", "orders", []byte(`{"order_id":42}`), bellhop.EnqueueOptions{}); err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	select {
	case <-handled:
	case err := <-done:
		log.Fatal(err)
	case <-time.After(time.Minute):
		log.Fatal("no delivery within a minute")
	}
	stop() // Run returns once the outcome is written
	if err := <-done; err != nil {
		log.Fatal(err)
	}

	dead, err := client.DeadLetters(ctx, bellhop.DeadFilter{App: "shop", Queue: "orders"})
	if err != nil {
		log.Fatal(err)
	}
	for _, dl := range dead {
		fmt.Printf("dead after attempt %d of %d: %s\n", dl.Attempt, dl.MaxAttempts, dl.LastError)
	}
	n, err := client.Redrive(ctx, "shop", "orders", dead[0].ID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("redriven:", n)
	// Output:
	// dead after attempt 1 of 5: permanent: no such customer
	// redriven: 1
}

// A message enqueued in the producer's own transaction exists only if
// that transaction commits, with the rows it describes: the transactional
// outbox.
func ExampleClient_EnqueueTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	if _, err := client.CreateApp(ctx, "shop"); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE orders (id int PRIMARY KEY)"); err != nil {
		log.Fatal(err)
	}

	placeOrder := func(id int, commit bool) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) // a no-op once committed
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", id); err != nil {
			return err
		}
		payload := fmt.Appendf(nil, `{"order_id":%d}`, id)
		if _, err := client.EnqueueTx(ctx, tx, "shop", "orders", payload, bellhop.EnqueueOptions{}); err != nil {
			return err
		}
		if !commit {
			return nil // rolled back: neither the order nor its message
		}
		return tx.Commit(ctx)
	}
	if err := placeOrder(41, false); err != nil {
		log.Fatal(err)
	}
	if err := placeOrder(42, true); err != nil {
		log.Fatal(err)
	}

	queues, err := client.Queues(ctx, "shop")
	if err != nil {
		log.Fatal(err)
	}
	for _, q := range queues {
		fmt.Printf("%s: %d ready\n", q.Queue, q.Ready)
	}
	// Output:
	// orders: 1 ready
}

// A scheduled message that is no longer wanted is deleted before it is
// due, by the id Enqueue returned: a reminder for an order cancelled
// meanwhile.
func ExampleClient_DeleteMessage() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	client := bellhop.NewClient(pool)
	if _, err := client.CreateApp(ctx, "shop"); err != nil {
		log.Fatal(err)
	}
	id, err := client.Enqueue(ctx, "shop", "reminders", []byte(`{"order_id":42}`), bellhop.EnqueueOptions{Delay: 24 * time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	m, err := client.QueuedMessage(ctx, "shop", id)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s, due in about %s, in flight: %v\n", m.Payload, time.Until(*m.DeliverAfter).Round(time.Hour), m.ClaimedAt != nil)

	// The order is cancelled: so is its reminder. A message being
	// delivered would be refused (ErrMessageInFlight) and left to its
	// delivery.
	if err := client.DeleteMessage(ctx, "shop", id); err != nil {
		log.Fatal(err)
	}
	_, err = client.QueuedMessage(ctx, "shop", id)
	fmt.Println("after the delete:", errors.Is(err, bellhop.ErrUnknownMessage))
	// Output:
	// {"order_id": 42}, due in about 24h0m0s, in flight: false
	// after the delete: true
}

// An HTTP consumer checks each push's signature before it acts on the
// message. The secret is the consumer's, from RegisterConsumer or
// `bellhop consumer add --url ...`.
func ExampleVerifyPush() {
	const secret = "the consumer's secret"
	consumer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 2<<20))
		if err != nil {
			http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
			return
		}
		if err := bellhop.VerifyPush(secret, r.Header, body, time.Now(), bellhop.DefaultPushWindow); err != nil {
			// A 4xx dead-letters the message; a 503 has it retried, as
			// it should be when this host's clock may have drifted.
			code := http.StatusUnauthorized
			if errors.Is(err, bellhop.ErrStaleSignature) {
				code = http.StatusServiceUnavailable
			}
			http.Error(w, err.Error(), code)
			return
		}
		fmt.Printf("%s attempt %s: %s\n", r.Header.Get(bellhop.HeaderQueue), r.Header.Get(bellhop.HeaderAttempt), body)
		w.WriteHeader(http.StatusNoContent) // 2xx: ack
	})

	// What `bellhop run` sends, and a forgery.
	push := func(signer string) int {
		body := `{"order_id":42}`
		ts := time.Now().Unix()
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
		req.Header.Set(bellhop.HeaderQueue, "orders")
		req.Header.Set(bellhop.HeaderAttempt, "1")
		req.Header.Set(bellhop.HeaderTimestamp, strconv.FormatInt(ts, 10))
		req.Header.Set(bellhop.HeaderSignature, bellhop.SignPush(signer, ts, []byte(body)))
		rec := httptest.NewRecorder()
		consumer.ServeHTTP(rec, req)
		return rec.Code
	}
	fmt.Println(push(secret))
	fmt.Println(push("a guess"))
	// Output:
	// orders attempt 1: {"order_id":42}
	// 204
	// 401
}
