package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	queries "github.com/bellhopq/bellhop/sql"
)

// argsRecorder is a pgx query tracer that keeps the text and arguments
// of every statement a pool sends: what a server with log_statement = all
// (or log_min_duration_statement = 0) writes to its log, bind parameters
// included.
type argsRecorder struct {
	mu   sync.Mutex
	sqls []string // each statement's text
	args []string // and its arguments, printed
}

func (r *argsRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sqls = append(r.sqls, d.SQL)
	r.args = append(r.args, printArgs(d.Args))
	return ctx
}

func (r *argsRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// printArgs prints pgx arguments (named-argument maps, pointers, byte
// slices...) with every string as its text and every byte slice as its
// text and in hex, for a search.
func printArgs(args []any) string {
	var b strings.Builder
	var walk func(reflect.Value)
	walk = func(v reflect.Value) {
		if !v.IsValid() {
			return
		}
		if s, ok := v.Interface().(fmt.Stringer); ok && v.Kind() == reflect.Array { // a uuid.UUID
			fmt.Fprintf(&b, " %s", s)
			return
		}
		switch v.Kind() {
		case reflect.Pointer, reflect.Interface:
			if !v.IsNil() {
				walk(v.Elem())
			}
		case reflect.Map:
			for it := v.MapRange(); it.Next(); {
				walk(it.Key())
				walk(it.Value())
			}
		case reflect.Slice, reflect.Array:
			if v.Type().Elem().Kind() == reflect.Uint8 {
				raw := make([]byte, v.Len())
				reflect.Copy(reflect.ValueOf(raw), v)
				fmt.Fprintf(&b, " %s %x", raw, raw)
				return
			}
			for i := range v.Len() {
				walk(v.Index(i))
			}
		default:
			fmt.Fprintf(&b, " %v", v.Interface())
		}
	}
	walk(reflect.ValueOf(args))
	return b.String()
}

// leaks returns the statements sent whose text or arguments hold secret.
func (r *argsRecorder) leaks(secret string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for i, sql := range r.sqls {
		if strings.Contains(strings.ToLower(sql+r.args[i]), secret) {
			out = append(out, fmt.Sprintf("%.60q with%s", sql, r.args[i]))
		}
	}
	return out
}

func (r *argsRecorder) sentSQL(sql string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.sqls {
		if s == sql {
			return true
		}
	}
	return false
}

// TestSetupDemoSecretNeverSent: setup-demo's registration of the demo
// consumer and its check of the secret file against the consumer's
// secret never send the secret to the server, where a server with
// log_statement = all would log it: the check sends its SHA-256. The
// check keeps its answers: the file holding the secret (with a trailing
// newline too) matches, another secret does not, nor does any once the
// consumer is gone. Against the code that sent the file's secret to
// compare, it fails with consumer_secret_matches.sql named as carrying it.
func TestSetupDemoSecretNeverSent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	rec := &argsRecorder{}
	cfg.ConnConfig.Tracer = rec
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := bellhop.NewClient(pool)
	if _, err := c.CreateApp(ctx, "demo"); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "orders")
	file, err := newSecretFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer file.discard()
	con, err := replaceConsumer(ctx, c, uuid.Nil, bellhop.ConsumerSpec{App: "demo", Queue: "orders", URL: "http://127.0.0.1:9/hook"}, file)
	if err != nil {
		t.Fatal(err)
	}
	if len(con.Secret) != 64 || strings.Trim(con.Secret, "0123456789abcdef") != "" {
		t.Fatalf("secret %q, want 64 lowercase hex characters", con.Secret)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != con.Secret {
		t.Fatalf("the secret file does not hold the consumer's secret: %v", err)
	}

	check := func(what string, want bool) {
		t.Helper()
		got, err := secretMatches(ctx, pool, con.ID, path)
		if err != nil || got != want {
			t.Errorf("%s: secretMatches = %t, %v; want %t", what, got, err, want)
		}
	}
	check("the file as written", true)
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(con.Secret + "\n")
	check("the secret with a newline", true)
	write(strings.ToUpper(con.Secret))
	check("the secret in upper case", false)
	write(strings.Repeat("0", 64))
	check("another secret", false)
	write(con.Secret)
	if err := c.RemoveConsumer(ctx, "demo", con.ID); err != nil {
		t.Fatal(err)
	}
	check("the consumer removed", false)

	if !rec.sentSQL(queries.ConsumerInsert) || !rec.sentSQL(queries.ConsumerSecretMatches) {
		t.Fatal("the tracer saw no consumer_insert.sql or consumer_secret_matches.sql: it checks nothing")
	}
	if leaks := rec.leaks(con.Secret); len(leaks) > 0 {
		t.Errorf("the consumer's secret was sent to the server, where log_statement = all logs it:\n%s", strings.Join(leaks, "\n"))
	}
}
