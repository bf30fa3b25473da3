package bellhop_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	queries "github.com/bellhopq/bellhop/sql"
)

// sentRecorder is a pgx tracer that keeps the text and arguments of every
// statement a pool sends, batched or not: what a server with
// log_statement = all (or log_min_duration_statement = 0) writes to its
// log, bind parameters included, or, in the simple protocol mode, has in
// the statement text itself.
type sentRecorder struct {
	mu   sync.Mutex
	sent []sentStatement
}

type sentStatement struct {
	sql  string
	args []any
}

func (r *sentRecorder) add(sql string, args []any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, sentStatement{sql: sql, args: args})
}

func (r *sentRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.add(d.SQL, d.Args)
	return ctx
}

func (r *sentRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *sentRecorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *sentRecorder) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.add(d.SQL, d.Args)
}

func (r *sentRecorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// statements returns what was sent so far.
func (r *sentRecorder) statements() []sentStatement {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]sentStatement(nil), r.sent...)
}

// leaks returns the statements sent that carry secret, in their text or
// in an argument, in any of the forms checked by carries.
func (r *sentRecorder) leaks(secret string) []string {
	var out []string
	for _, s := range r.statements() {
		var where []string
		if carries(s.sql, secret) {
			where = append(where, "its text")
		}
		for i, a := range s.args {
			if m := reflect.ValueOf(a); m.Kind() == reflect.Map {
				for it := m.MapRange(); it.Next(); {
					if carries(it.Value().Interface(), secret) {
						where = append(where, fmt.Sprintf("argument %v", it.Key()))
					}
				}
			} else if carries(a, secret) {
				where = append(where, fmt.Sprintf("argument %d", i+1))
			}
		}
		if len(where) > 0 {
			out = append(out, fmt.Sprintf("%.60q, in %s", s.sql, strings.Join(where, ", ")))
		}
	}
	return out
}

// sent reports whether sql was sent.
func (r *sentRecorder) sentSQL(sql string) bool {
	for _, s := range r.statements() {
		if s.sql == sql {
			return true
		}
	}
	return false
}

// carries reports whether v, an argument as given to pgx (a named-argument
// map, a pointer, a slice...), holds secret (a hex string): as text, in
// any case, or as bytes, the secret's own or the ones it encodes.
func carries(v any, secret string) bool {
	raw, _ := hex.DecodeString(secret)
	var walk func(reflect.Value) bool
	walk = func(v reflect.Value) bool {
		if !v.IsValid() {
			return false
		}
		switch v.Kind() {
		case reflect.Pointer, reflect.Interface:
			return !v.IsNil() && walk(v.Elem())
		case reflect.String:
			return strings.Contains(strings.ToLower(v.String()), secret)
		case reflect.Map:
			for it := v.MapRange(); it.Next(); {
				if walk(it.Key()) || walk(it.Value()) {
					return true
				}
			}
			return false
		case reflect.Slice, reflect.Array:
			if v.Type().Elem().Kind() == reflect.Uint8 {
				b := make([]byte, v.Len())
				reflect.Copy(reflect.ValueOf(b), v)
				return bytes.Contains(b, []byte(secret)) || (len(raw) > 0 && bytes.Contains(b, raw)) ||
					strings.Contains(strings.ToLower(string(b)), secret)
			}
			for i := range v.Len() {
				if walk(v.Index(i)) {
					return true
				}
			}
			return false
		default:
			return strings.Contains(strings.ToLower(fmt.Sprint(v.Interface())), secret)
		}
	}
	return walk(reflect.ValueOf(v))
}

// TestCarriesFindsSecrets: carries sees a secret in the forms an argument
// could take it in, so that TestPushSecretNeverSent would see one sent.
func TestCarriesFindsSecrets(t *testing.T) {
	t.Parallel()
	const secret = "67f8a0b1c2d3e4f5061728394a5b6c7d8e9fa0b1c2d3e4f5061728394a5b6c7d"
	raw, _ := hex.DecodeString(secret)
	s := secret
	for _, v := range []any{
		[]any{queries.Args{"push_secret": &s}},
		[]any{queries.Args{"secret": secret}},
		[]any{pgx.NamedArgs{"x": []byte(secret)}},
		[]any{raw},
		[]any{strings.ToUpper(secret)},
		"INSERT INTO t VALUES ('" + secret + "')",
	} {
		if !carries(v, secret) {
			t.Errorf("carries(%v) = false", v)
		}
	}
	if carries([]any{queries.Args{"push_url": "http://h.example/hook"}}, secret) {
		t.Error("carries found the secret in arguments without it")
	}
}

var pushSecretForm = regexp.MustCompile(`^[0-9a-f]{64}$`)

// TestPushSecretNeverSent: registering an HTTP push consumer never sends
// its signing secret to the server, neither as a bind parameter nor in a
// statement's text, in the default mode and in the simple protocol one
// (where pgx writes arguments into the text): a server run with
// log_statement = all or log_min_duration_statement = 0 (as for pgBadger)
// writes bind parameters to its log. The server makes the secret and
// returns it. It is 64 lowercase hex characters, as before, different for
// each consumer and the one stored; a Go handler's consumer has none.
// Against the code that made the secret in Go and sent it, it fails with
// the registration's INSERT named as carrying it.
func TestPushSecretNeverSent(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
			if err != nil {
				t.Fatal(err)
			}
			rec := &sentRecorder{}
			cfg.ConnConfig.Tracer = rec
			cfg.ConnConfig.DefaultQueryExecMode = mode
			cfg.MaxConns = 2
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			c := bellhop.NewClient(pool)
			if _, err := c.CreateApp(ctx, "shop"); err != nil {
				t.Fatal(err)
			}
			const url = "http://127.0.0.1:9/hook"
			orders, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", URL: url, Timeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			invoices, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "invoices", URL: url})
			if err != nil {
				t.Fatal(err)
			}
			emails, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "emails"})
			if err != nil {
				t.Fatal(err)
			}
			if !rec.sentSQL(queries.ConsumerInsert) {
				t.Fatal("the tracer saw no consumer_insert.sql: it checks nothing")
			}
			for _, con := range []bellhop.Consumer{orders, invoices} {
				if !pushSecretForm.MatchString(con.Secret) {
					t.Errorf("consumer of %s: secret %q, want 64 lowercase hex characters", con.Queue, con.Secret)
					continue
				}
				if leaks := rec.leaks(con.Secret); len(leaks) > 0 {
					t.Errorf("the secret of the consumer of %s was sent to the server, where log_statement = all logs it:\n%s",
						con.Queue, strings.Join(leaks, "\n"))
				}
			}
			if orders.Secret == invoices.Secret {
				t.Errorf("two consumers got the same secret %q", orders.Secret)
			}
			if emails.Secret != "" {
				t.Errorf("a Go handler's consumer got a secret %q", emails.Secret)
			}
			// The secrets returned are the ones stored, which the
			// dispatcher signs with; the Go handler's is NULL.
			for _, con := range []bellhop.Consumer{orders, invoices, emails} {
				var stored *string
				if err := pool.QueryRow(ctx, `SELECT push_secret FROM queue_consumers WHERE id = $1`, con.ID).Scan(&stored); err != nil {
					t.Fatal(err)
				}
				switch {
				case con.Secret == "" && stored != nil:
					t.Errorf("the consumer of %s has secret %q stored, want NULL", con.Queue, *stored)
				case con.Secret != "" && (stored == nil || *stored != con.Secret):
					t.Errorf("the consumer of %s: returned secret %q is not the one stored", con.Queue, con.Secret)
				}
			}
			// The rest of the registration is as it was.
			got, err := c.ConsumerOf(ctx, "shop", "orders")
			if err != nil || got.ID != orders.ID || got.URL != url || got.Timeout != 5*time.Second || got.Secret != "" ||
				!got.CreatedAt.Equal(orders.CreatedAt) {
				t.Errorf("ConsumerOf = %v, %v; want %v without its secret", got, err, orders)
			}
		})
	}
}
