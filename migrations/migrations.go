// Package migrations holds Bellhop's schema as numbered SQL files and
// applies them with github.com/jackc/tern/v2/migrate.
//
// The files keep the numbers they were written with (0001 is the base that
// the seed assumed, 0034 is the seed itself, word for word). tern wants a
// gap-free sequence, so the files are appended to the migrator in number
// order and tern's version counts how many of them have been applied.
//
// Indexes are built with a plain CREATE INDEX, inside the file's
// transaction, which holds off writes to the table while it builds (the
// outbox and the message tables are meant to stay short). CREATE INDEX
// CONCURRENTLY would deadlock with a second process migrating at the same
// time: it waits for every transaction with an older snapshot to end,
// and the other process's statement waiting for tern's advisory lock is
// one of them (golang-migrate/migrate#960 and coder/coder#8353 report the
// deadlock).
package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed *.sql
var files embed.FS

// VersionTable is the table in which tern records how many migrations have
// been applied.
const VersionTable = "public.bellhop_schema_version"

// File is one migration file.
type File struct {
	Number int
	Name   string
	SQL    string
}

// Files returns the embedded migration files in number order. It fails if
// two files share a number or a file name does not start with a number.
func Files() ([]File, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	out := make([]File, 0, len(entries))
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		prefix, _, ok := strings.Cut(name, "_")
		n, err := strconv.Atoi(prefix)
		if !ok || err != nil || n <= 0 {
			return nil, fmt.Errorf("migration %q: name must start with a positive number and an underscore", name)
		}
		if other, dup := seen[n]; dup {
			return nil, fmt.Errorf("migrations %q and %q share number %d", other, name, n)
		}
		seen[n] = name
		body, err := files.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		out = append(out, File{Number: n, Name: name, SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Number < out[j].Number })
	return out, nil
}

// Migrate applies every migration that conn's database lacks. It is
// idempotent, and safe to run from several processes at once: tern holds a
// session advisory lock while it migrates, and each file runs in its own
// transaction together with the version bump.
//
// conn must be a session (not a PgBouncer transaction-mode connection),
// because the advisory lock is session-scoped.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrate: prepare version table: %w", err)
	}
	fs, err := Files()
	if err != nil {
		return err
	}
	for _, f := range fs {
		m.AppendMigration(f.Name, f.SQL, "")
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

// Latest is the schema version that Migrate brings a database to.
func Latest() (int, error) {
	fs, err := Files()
	return len(fs), err
}
