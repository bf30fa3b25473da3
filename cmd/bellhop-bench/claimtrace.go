package main

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// claimTracer times the dispatcher's queue claim passes, each one batch,
// from pgx sending it to the end of its results, while armed. It sees
// the dispatcher from outside, through the pool's pgx tracer.
type claimTracer struct {
	armed atomic.Bool
	mu    sync.Mutex
	took  []int64
}

type claimTraceKey struct{}

// batchTrace is one batch in flight on a connection.
type batchTrace struct {
	start time.Time
	claim bool
}

func (t *claimTracer) arm(on bool) { t.armed.Store(on) }

func (t *claimTracer) stats() latencyStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return summarize(t.took)
}

// isQueueClaim reports whether sql is the queue claim statement, as pgx
// hands it to the tracer (named arguments rewritten to $n).
func isQueueClaim(sql string) bool {
	return strings.Contains(sql, "SET claim_token = gen_random_uuid()") && strings.Contains(sql, "FROM queue_messages AS c")
}

func (t *claimTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	if !t.armed.Load() {
		return ctx
	}
	return context.WithValue(ctx, claimTraceKey{}, &batchTrace{start: time.Now()})
}

func (t *claimTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if b, ok := ctx.Value(claimTraceKey{}).(*batchTrace); ok && isQueueClaim(d.SQL) {
		b.claim = true
	}
}

func (t *claimTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	b, ok := ctx.Value(claimTraceKey{}).(*batchTrace)
	if !ok || !b.claim || d.Err != nil {
		return
	}
	took := int64(time.Since(b.start))
	t.mu.Lock()
	t.took = append(t.took, took)
	t.mu.Unlock()
}

// The pool calls these for statements that are not batches.
func (t *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (t *claimTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
