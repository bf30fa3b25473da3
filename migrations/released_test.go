package migrations_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/bellhopq/bellhop/migrations"
)

// releasedPath lists the SHA-256 of every released migration, in
// sha256sum's format, so `sha256sum -c released.sha256` checks it too.
const releasedPath = "released.sha256"

// TestReleasedMigrationsUnchanged: tern records only how many files a
// database has applied, so a released migration that is edited, renamed,
// removed, or has a new file numbered before it would go unnoticed by
// every database already past it, and those databases would differ from
// new ones. The hashes pin each released file. A new migration gets its
// line with `sha256sum NNNN_name.sql >> released.sha256`, and must be
// numbered after every released one.
func TestReleasedMigrationsUnchanged(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(releasedPath)
	if err != nil {
		t.Fatalf("read %s: %v", releasedPath, err)
	}
	pinned, order, err := parseSums(raw)
	if err != nil {
		t.Fatalf("%s: %v", releasedPath, err)
	}
	files, err := migrations.Files()
	if err != nil {
		t.Fatal(err)
	}
	checkReleased(t, pinned, order, files)
}

// TestReleasedMigrationsCheckFails feeds checkReleased each kind of change
// it exists to catch, so that a check that passes everything fails here.
func TestReleasedMigrationsCheckFails(t *testing.T) {
	t.Parallel()
	sum := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return hex.EncodeToString(h[:])
	}
	released := []migrations.File{
		{Number: 1, Name: "0001_a.sql", SQL: "a"},
		{Number: 5, Name: "0005_b.sql", SQL: "b"},
	}
	pinned := map[string]string{"0001_a.sql": sum("a"), "0005_b.sql": sum("b")}
	order := []string{"0001_a.sql", "0005_b.sql"}

	tests := []struct {
		name  string
		files []migrations.File
		want  string
	}{
		{"edited", []migrations.File{released[0], {Number: 5, Name: "0005_b.sql", SQL: "b2"}}, "0005_b.sql was edited"},
		{"removed", released[:1], "0005_b.sql is gone"},
		{"renamed", []migrations.File{released[0], {Number: 5, Name: "0005_c.sql", SQL: "b"}}, "0005_b.sql is gone"},
		{"inserted before a released one", append(released[:2:2], migrations.File{Number: 3, Name: "0003_x.sql", SQL: "x"}), "0003_x.sql is numbered before released 0005_b.sql"},
		{"new and unpinned", append(released[:2:2], migrations.File{Number: 6, Name: "0006_x.sql", SQL: "x"}), "0006_x.sql has no line"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &recorder{}
			checkReleased(rec, pinned, order, tt.files)
			if !strings.Contains(rec.text(), tt.want) {
				t.Errorf("check reported %q, want it to contain %q", rec.text(), tt.want)
			}
		})
	}

	rec := &recorder{}
	checkReleased(rec, pinned, order, released)
	if rec.text() != "" {
		t.Errorf("check of unchanged files reported %q", rec.text())
	}
}

// reporter is the part of testing.T that checkReleased uses, so that the
// check itself can be tested.
type reporter interface {
	Helper()
	Errorf(format string, args ...any)
}

type recorder struct{ lines []string }

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.lines = append(r.lines, strings.TrimSpace(fmt.Sprintf(format, args...)))
}
func (r *recorder) text() string { return strings.Join(r.lines, "\n") }

func checkReleased(t reporter, pinned map[string]string, order []string, files []migrations.File) {
	t.Helper()
	present := map[string]migrations.File{}
	for _, f := range files {
		present[f.Name] = f
	}
	lastReleased, lastName := 0, ""
	for _, name := range order {
		f, ok := present[name]
		if !ok {
			t.Errorf("released migration %s is gone (removed or renamed); databases past it would not notice", name)
			continue
		}
		if f.Number > lastReleased {
			lastReleased, lastName = f.Number, f.Name
		}
		h := sha256.Sum256([]byte(f.SQL))
		if got := hex.EncodeToString(h[:]); got != pinned[name] {
			t.Errorf("released migration %s was edited (SHA-256 %s, pinned %s): databases that applied it keep the old version; put the change in a new migration", name, got, pinned[name])
		}
	}
	for _, f := range files {
		if _, ok := pinned[f.Name]; ok {
			continue
		}
		if f.Number < lastReleased {
			t.Errorf("migration %s is numbered before released %s: databases past it would never apply it", f.Name, lastName)
			continue
		}
		t.Errorf("migration %s has no line in %s: once it is final, add one with `sha256sum %s >> %s`", f.Name, releasedPath, f.Name, releasedPath)
	}
}

// parseSums reads sha256sum output: "<hex>  <name>" per line.
func parseSums(raw []byte) (map[string]string, []string, error) {
	pinned := map[string]string{}
	var order []string
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" {
			continue
		}
		sum, name, ok := strings.Cut(line, "  ")
		if !ok || len(sum) != 64 || name == "" {
			return nil, nil, fmt.Errorf("line %d: want \"<sha256>  <file>\", got %q", n, line)
		}
		if _, dup := pinned[name]; dup {
			return nil, nil, fmt.Errorf("line %d: %s is listed twice", n, name)
		}
		pinned[name] = sum
		order = append(order, name)
	}
	return pinned, order, sc.Err()
}
