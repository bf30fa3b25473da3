package sql

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Args are a statement's named arguments (@name), as pgx.NamedArgs, for
// the statements of this package. pgx.NamedArgs lexes the whole statement
// on every call to find its placeholders, comments included, and the
// comments are most of these files: 12 – 31 µs and 19 – 42 allocations
// per statement, a sixth of the CPU of a process holding a dispatcher and
// its producers while ten thousand queues each get a message
// (docs/benchmarks-history.md, "statement arguments prepared once"). Args
// look the rewritten statement up instead, lexed once by pgx itself when
// the package is loaded, so placeholders are found exactly as
// pgx.NamedArgs finds them. Any other statement is rewritten by pgx.NamedArgs.
//
// As with pgx.NamedArgs, a placeholder with no argument is sent as NULL.
type Args map[string]any

// RewriteQuery implements pgx.QueryRewriter.
func (a Args) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	r, ok := rewritten[sql]
	if !ok {
		return pgx.NamedArgs(a).RewriteQuery(ctx, conn, sql, args)
	}
	out := make([]any, len(r.names))
	for i, name := range r.names {
		out[i] = a[name]
	}
	return r.sql, out, nil
}

// positional is a statement with its placeholders numbered, and the names
// of its $1, $2, ... in order.
type positional struct {
	sql   string
	names []string
}

//go:embed *.sql
var files embed.FS

// rewritten maps each statement of this package to its positional form.
// Built once from the embedded files, and never written after.
var rewritten = rewriteAll(files)

// candidate matches what could be a placeholder, in comments and strings
// too: pgx decides which ones are.
var candidate = regexp.MustCompile(`@([A-Za-z_][A-Za-z0-9_]*)`)

func rewriteAll(fsys fs.FS) map[string]positional {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		panic(err)
	}
	out := make(map[string]positional, len(names))
	for _, name := range names {
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			panic(err)
		}
		p, err := toPositional(string(b))
		if err != nil {
			panic(fmt.Sprintf("sql: %s: %v", name, err))
		}
		out[string(b)] = p
	}
	return out
}

// toPositional rewrites sql with pgx.NamedArgs whose every candidate name
// stands for itself, so that the rewritten arguments are the placeholders'
// names in order.
func toPositional(sql string) (positional, error) {
	self := pgx.NamedArgs{}
	for _, m := range candidate.FindAllStringSubmatch(sql, -1) {
		self[m[1]] = m[1]
	}
	text, args, err := self.RewriteQuery(context.Background(), nil, sql, nil)
	if err != nil {
		return positional{}, err
	}
	p := positional{sql: text, names: make([]string, len(args))}
	for i, v := range args {
		name, ok := v.(string)
		if !ok {
			return positional{}, fmt.Errorf("placeholder $%d has no name", i+1)
		}
		p.names[i] = name
	}
	return p, nil
}
