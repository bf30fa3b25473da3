package sql

import (
	"context"
	"io/fs"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestArgsAsNamedArgs: for every statement of the package, Args rewrite it
// to the same text and arguments as pgx.NamedArgs, with every argument
// given, with some missing (sent as NULL), and with extra ones.
func TestArgsAsNamedArgs(t *testing.T) {
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != len(rewritten) {
		t.Fatalf("%d files, %d rewritten statements", len(names), len(rewritten))
	}
	ctx := context.Background()
	for _, name := range names {
		b, err := fs.ReadFile(files, name)
		if err != nil {
			t.Fatal(err)
		}
		sql := string(b)
		all := Args{"not_a_placeholder": -1}
		some := Args{}
		for i, m := range candidate.FindAllStringSubmatch(sql, -1) {
			all[m[1]] = i
			if i%2 == 0 {
				some[m[1]] = i
			}
		}
		for _, tc := range []struct {
			what string
			args Args
		}{{"all", all}, {"some", some}, {"none", Args{}}} {
			gotSQL, gotArgs, err := tc.args.RewriteQuery(ctx, nil, sql, nil)
			if err != nil {
				t.Fatalf("%s, %s: %v", name, tc.what, err)
			}
			wantSQL, wantArgs, err := pgx.NamedArgs(tc.args).RewriteQuery(ctx, nil, sql, nil)
			if err != nil {
				t.Fatalf("%s, %s: pgx: %v", name, tc.what, err)
			}
			if gotSQL != wantSQL {
				t.Errorf("%s, %s arguments: rewritten to\n%s\nwant\n%s", name, tc.what, gotSQL, wantSQL)
			}
			if !reflect.DeepEqual(gotArgs, wantArgs) {
				t.Errorf("%s, %s arguments: %v, want %v", name, tc.what, gotArgs, wantArgs)
			}
		}
	}
}

// TestArgsOtherStatements: a statement that is not one of the package's
// is rewritten by pgx.NamedArgs.
func TestArgsOtherStatements(t *testing.T) {
	sql := "SELECT @b::int, @a::text, @b::int -- @c\n"
	got, args, err := Args{"a": "x", "b": 2, "c": 3}.RewriteQuery(context.Background(), nil, sql, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := "SELECT $1::int, $2::text, $1::int -- @c\n"; got != want {
		t.Errorf("rewritten to %q, want %q", got, want)
	}
	if want := []any{2, "x"}; !reflect.DeepEqual(args, want) {
		t.Errorf("arguments %v, want %v", args, want)
	}
}

// BenchmarkRewrite: the claim pass's two statements with arguments, and a
// producer's, rewritten by Args and by pgx.NamedArgs.
func BenchmarkRewrite(b *testing.B) {
	args := map[string]any{"app_id": 1, "queue_name": "q", "max_messages": 10, "owner": 2,
		"held": false, "lease_ms": 2000, "consumer_id": 3, "app_name": "app", "id": 4,
		"payload": "{}", "delay_us": 0}
	for _, q := range []struct{ name, sql string }{
		{"claim_queue", ClaimQueue}, {"next_due_queue", NextDueQueue}, {"enqueue_one", EnqueueOne},
	} {
		for _, r := range []struct {
			name string
			qr   pgx.QueryRewriter
		}{{"Args", Args(args)}, {"NamedArgs", pgx.NamedArgs(args)}} {
			b.Run(q.name+"/"+r.name, func(b *testing.B) {
				b.ReportAllocs()
				for range b.N {
					if _, _, err := r.qr.RewriteQuery(context.Background(), nil, q.sql, nil); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
