package claim_test

// Benchmarks of the claim and settle statements alone, without a
// dispatcher around them. Each benchmark run gets a fresh database (see
// pgtest) pre-filled with exactly the messages it will claim or settle,
// plus a backlog of benchBacklog more, so the last claim still sees a
// realistic table. They run against the test cluster, which has fsync and
// synchronous_commit off (as the dispatcher's own sessions have
// synchronous_commit off); set DATABASE_URL to run them elsewhere.
//
//	go test ./claim -run '^$' -bench . -benchtime 2000x
//
// ns/op is per statement round trip (one Claim or one Write); msgs/s is
// messages per second through that statement alone, from one goroutine.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/reclaim"
)

// benchBacklog is how many ready messages stay in the queue behind the
// ones a benchmark works on.
const benchBacklog = 10_000

// benchQueue is the queue benchmarks fill.
const benchQueue = "bench"

// benchSetup returns a pool on a fresh database holding n+benchBacklog
// ready messages in one queue, vacuumed and analysed, and the claim
// target of that queue.
func benchSetup(b *testing.B, n int) (*pgxpool.Pool, claim.Target) {
	b.Helper()
	return benchSetupSized(b, n, 0, benchBacklog)
}

// benchSetupSized is benchSetup with payloads padded to about pad bytes,
// and backlog messages behind the n.
func benchSetupSized(b *testing.B, n, pad, backlog int) (*pgxpool.Pool, claim.Target) {
	b.Helper()
	ctx := context.Background()
	pool, c, appID := setup(b)
	// A consumer, as in production: enqueue looks up its max attempts.
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: benchQueue}); err != nil {
		b.Fatal(err)
	}
	total := n + backlog
	const chunk = 500
	msgs := make([]bellhop.NewMessage, 0, chunk)
	for i := 0; i < total; {
		msgs = msgs[:0]
		for ; i < total && len(msgs) < chunk; i++ {
			payload := `{"n":` + strconv.Itoa(i) + `}`
			if pad > 0 {
				payload = `{"n":` + strconv.Itoa(i) + `,"pad":"` + strings.Repeat("x", pad) + `"}`
			}
			msgs = append(msgs, bellhop.NewMessage{Queue: benchQueue, Payload: []byte(payload)})
		}
		if _, err := c.EnqueueMany(ctx, "app", msgs); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE queue_messages"); err != nil {
		b.Fatal(err)
	}
	return pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: benchQueue}
}

// claimAll claims n messages of t, in claims of at most 1000.
func claimAll(b *testing.B, pool *pgxpool.Pool, t claim.Target, n int) []claim.Message {
	b.Helper()
	out := make([]claim.Message, 0, n)
	for len(out) < n {
		msgs, _, err := claim.Claim(context.Background(), pool, t, min(1000, n-len(out)))
		if err != nil {
			b.Fatal(err)
		}
		if len(msgs) == 0 {
			b.Fatalf("claimed %d of %d", len(out), n)
		}
		out = append(out, msgs...)
	}
	return out
}

func reportRate(b *testing.B, perOp int) {
	if s := b.Elapsed().Seconds(); s > 0 {
		b.ReportMetric(float64(b.N*perOp)/s, "msgs/s")
	}
}

// BenchmarkClaim: one Claim (the claim UPDATE and the next-due SELECT in
// one round trip) of up to batch messages.
func BenchmarkClaim(b *testing.B) {
	for _, batch := range []int{1, 10, 100, 1000} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			pool, target := benchSetup(b, b.N*batch)
			b.ReportAllocs()
			benchClaims(b, pool, target, batch)
		})
	}
}

// benchClaims times b.N claims of batch messages each.
func benchClaims(b *testing.B, pool *pgxpool.Pool, target claim.Target, batch int) {
	ctx := context.Background()
	b.ResetTimer()
	for range b.N {
		msgs, _, err := claim.Claim(ctx, pool, target, batch)
		if err != nil {
			b.Fatal(err)
		}
		if len(msgs) != batch {
			b.Fatalf("claimed %d, want %d", len(msgs), batch)
		}
	}
	b.StopTimer()
	reportRate(b, batch)
}

// BenchmarkClaimPayload: one Claim of 10 messages, by payload size. Up to
// 0061 a CHECK printed every payload again at each claim to measure it;
// 0062 measures a payload only when it is written.
func BenchmarkClaimPayload(b *testing.B) {
	for _, pad := range []int{0, 64 << 10} {
		b.Run(fmt.Sprintf("pad=%d", pad), func(b *testing.B) {
			const batch = 10
			// A small backlog: 10,000 messages of 64 KB take minutes to
			// write.
			pool, target := benchSetupSized(b, b.N*batch, pad, 1000)
			benchClaims(b, pool, target, batch)
		})
	}
}

// BenchmarkClaimPassMarked: the pass a dispatcher makes while it drains a
// backlog: the busy mark upsert, the claim and the pass's info query in
// one round trip.
func BenchmarkClaimPassMarked(b *testing.B) {
	for _, batch := range []int{10, 1000} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			pool, target := benchSetup(b, b.N*batch)
			ctx := context.Background()
			busy := claim.Busy{Owner: uuid.New(), Mark: true, Lease: 2 * time.Second}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				p, err := claim.ClaimPass(ctx, pool, target, batch, busy)
				if err != nil {
					b.Fatal(err)
				}
				if len(p.Messages) != batch {
					b.Fatalf("claimed %d, want %d", len(p.Messages), batch)
				}
			}
			b.StopTimer()
			reportRate(b, batch)
		})
	}
}

// benchmarkWrite settles batches of claimed messages with verdict v: one
// claim.Write (one round trip) per batch.
func benchmarkWrite(b *testing.B, v claim.Verdict, delay time.Duration) {
	for _, batch := range []int{1, 10, 100, 500} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			pool, target := benchSetup(b, b.N*batch)
			msgs := claimAll(b, pool, target, b.N*batch)
			outcomes := make([]claim.Outcome, len(msgs))
			for i := range msgs {
				outcomes[i] = claim.Outcome{Message: &msgs[i], Verdict: v, Delay: delay}
			}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				applied, err := claim.Write(ctx, pool, outcomes[i*batch:(i+1)*batch])
				if err != nil {
					b.Fatal(err)
				}
				if len(applied) != batch {
					b.Fatalf("applied %d of %d", len(applied), batch)
				}
			}
			b.StopTimer()
			reportRate(b, batch)
		})
	}
}

// BenchmarkAck: acks (DELETE fenced by the claim token) in batches.
func BenchmarkAck(b *testing.B) { benchmarkWrite(b, claim.Ack, 0) }

// BenchmarkNack: nacks (UPDATE back to unclaimed with a delay, fenced by
// the claim token) in batches.
func BenchmarkNack(b *testing.B) { benchmarkWrite(b, claim.Nack, time.Minute) }

// BenchmarkClaimQueues: a message from each of ten queues, claimed as ten
// passes (separate) or as one combined pass (combined, ClaimPasses), as a
// dispatcher's lanes claim when ten idle queues are woken at once. ns/op
// is per ten messages.
func BenchmarkClaimQueues(b *testing.B) {
	const queues = 10
	for _, combined := range []bool{false, true} {
		name := "separate"
		if combined {
			name = "combined"
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			pool, c, appID := setup(b)
			var reqs []claim.Request
			var msgs []bellhop.NewMessage
			for q := range queues {
				name := fmt.Sprintf("q%d", q)
				reqs = append(reqs, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: name}, Max: 1})
				for i := range b.N + 10 {
					msgs = append(msgs, bellhop.NewMessage{Queue: name, Payload: []byte(`{"n":` + strconv.Itoa(i) + `}`)})
				}
			}
			for len(msgs) > 0 {
				n := min(len(msgs), 5000)
				if _, err := c.EnqueueMany(ctx, "app", msgs[:n]); err != nil {
					b.Fatal(err)
				}
				msgs = msgs[n:]
			}
			if _, err := pool.Exec(ctx, "VACUUM ANALYZE queue_messages"); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if combined {
					ps, err := claim.ClaimPasses(ctx, pool, reqs)
					if err != nil {
						b.Fatal(err)
					}
					for _, p := range ps {
						if len(p.Messages) != 1 {
							b.Fatalf("claimed %d, want 1", len(p.Messages))
						}
					}
					continue
				}
				for _, r := range reqs {
					p, err := claim.ClaimPass(ctx, pool, r.Target, 1, claim.Busy{})
					if err != nil {
						b.Fatal(err)
					}
					if len(p.Messages) != 1 {
						b.Fatalf("claimed %d, want 1", len(p.Messages))
					}
				}
			}
			b.StopTimer()
			reportRate(b, queues)
		})
	}
}

// BenchmarkReclaim: reclaiming 20,000 expired leases among 100,000 in
// flight (Reclaimer.Pass, its passes until none is left), in passes of
// batch leases. Each pass reads the leases older than the shortest
// timeout until its batch is full (before migration 0060 each scanned
// every lease in flight, so smaller batches cost more passes of the same
// scan).
//
//	go test ./claim -run '^$' -bench Reclaim -benchtime 3x
func BenchmarkReclaim(b *testing.B) {
	const inFlight, expired = 100_000, 20_000
	for _, batch := range []int{1_000, reclaim.DefaultBatch, inFlight} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			ctx := context.Background()
			pool, _, appID := setup(b)
			r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second, Batch: batch})
			for b.Loop() {
				b.StopTimer()
				for _, q := range []string{
					"TRUNCATE queue_messages",
					fmt.Sprintf(`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
						SELECT '%s', '%s', '{}', gen_random_uuid(),
						       CASE WHEN i %% %d = 0 THEN now() - interval '1 hour' ELSE now() - random() * interval '5 seconds' END, 1
						FROM generate_series(1, %d) i ORDER BY random()`, appID, benchQueue, inFlight/expired, inFlight),
					"VACUUM ANALYZE queue_messages",
				} {
					if _, err := pool.Exec(ctx, q); err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
				if _, err := r.Pass(ctx); err != nil {
					b.Fatal(err)
				}
			}
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claimed_at < now() - interval '1 minute'`).Scan(&left); err != nil {
				b.Fatal(err)
			}
			if left != 0 {
				b.Fatalf("%d expired leases left", left)
			}
			reportRate(b, expired)
		})
	}
}

// BenchmarkReclaimNoneExpired: one Reclaimer.Pass (the reclaim statement
// and the next lease expiry, in one round trip) while 100,000 leases are
// in flight and none has expired, beside 100,000 ready messages. Each
// fallback poll reads the same next lease expiry. The default timeout is
// 30s. With timeouts=1 the consumer's is the default too, so the next
// lease expiry reads the oldest lease alone. With timeouts=2 the
// consumer's is a minute, so it reads every lease claimed within 30s
// after the oldest, here all of them. With timeouts=2,old the consumer's
// is 12 hours and the leases were taken an hour ago, so the reclaim reads
// them all too. Leases carry claim times up to 5s apart, in no order in
// the table, as leases taken by many lanes do.
//
//	go test ./claim -run '^$' -bench ReclaimNoneExpired -benchtime 20x
func BenchmarkReclaimNoneExpired(b *testing.B) {
	const inFlight, ready = 100_000, 100_000
	for _, tc := range []struct {
		name    string
		vt      time.Duration
		claimed string
	}{
		{"timeouts=1", 30 * time.Second, "now() - random() * interval '5 seconds'"},
		{"timeouts=2", time.Minute, "now() - random() * interval '5 seconds'"},
		{"timeouts=2,old", 12 * time.Hour, "now() - interval '1 hour' - random() * interval '5 seconds'"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ctx := context.Background()
			pool, c, appID := setup(b)
			if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: benchQueue, VisibilityTimeout: tc.vt}); err != nil {
				b.Fatal(err)
			}
			for _, q := range []string{
				fmt.Sprintf(`INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
					SELECT '%s', '%s', '{}', CASE WHEN i <= %d THEN gen_random_uuid() END,
					       CASE WHEN i <= %d THEN %s END, CASE WHEN i <= %d THEN 1 ELSE 0 END
					FROM generate_series(1, %d) i ORDER BY random()`, appID, benchQueue, inFlight, inFlight, tc.claimed, inFlight, inFlight+ready),
				"VACUUM ANALYZE queue_messages",
			} {
				if _, err := pool.Exec(ctx, q); err != nil {
					b.Fatal(err)
				}
			}
			r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
			for b.Loop() {
				next, err := r.Pass(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if next.IsZero() {
					b.Fatal("no next lease expiry")
				}
			}
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`).Scan(&left); err != nil {
				b.Fatal(err)
			}
			if left != inFlight {
				b.Fatalf("%d leases left in flight, want %d", left, inFlight)
			}
		})
	}
}
