package bellhop_test

import (
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// readmeFree declares what the README's Go snippets use without
// declaring: the reader's own context, transaction, payloads, logger and
// work.
const readmeFree = `
var (
	ctx     context.Context
	tx      pgx.Tx
	client  *bellhop.Client
	payload []byte
	p1, p2  []byte
	logger  zerolog.Logger
	process func(context.Context, []byte) error
)
`

// readmeImports are the packages a snippet may use.
var readmeImports = []string{
	"context", "errors", "os", "time",
	"github.com/jackc/pgx/v5", "github.com/jackc/pgx/v5/pgxpool", "github.com/rs/zerolog",
	"github.com/bellhopq/bellhop",
}

// TestReadmeGoSnippets: every Go snippet in README.md type-checks against
// the package, as the body of a function that returns an error, with
// readmeFree in scope. Unused variables and imports are allowed (a
// snippet shows a call, not what the reader does with its result);
// anything else, such as a renamed option, a wrong argument or a result
// left out, fails, as does an err that the next statement does not check
// (droppedErrors). A review found a snippet that dropped the error of
// RegisterConsumer and pgxpool.New; this keeps them compiling, and
// checking their errors, as they are changed.
func TestReadmeGoSnippets(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	snippets := regexp.MustCompile("(?s)\n```go\n(.*?)\n```").FindAllSubmatch(readme, -1)
	if len(snippets) < 2 {
		t.Fatalf("README.md has %d Go snippets, want the producer's and the handler's", len(snippets))
	}
	exports := exportData(t, readmeImports)
	var src strings.Builder
	src.WriteString("package readme\n\nimport (\n")
	for _, p := range readmeImports {
		fmt.Fprintf(&src, "\t%q\n", p)
	}
	src.WriteString(")\n" + readmeFree)
	// Where each snippet starts in src, and in README.md, to name it.
	type start struct{ src, readme int }
	var starts []start
	for i, s := range snippets {
		fmt.Fprintf(&src, "\nfunc snippet%d() error {\n", i)
		readmeLine := bytes.Count(readme[:bytes.Index(readme, s[0])], []byte("\n")) + 3
		starts = append(starts, start{strings.Count(src.String(), "\n") + 1, readmeLine})
		src.Write(s[1])
		src.WriteString("\n\treturn nil\n}\n")
	}
	readmeLine := func(srcLine int) int {
		n := 0
		for _, s := range starts {
			if srcLine >= s.src {
				n = s.readme + srcLine - s.src
			}
		}
		return n
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "readme.go", src.String(), 0)
	if err != nil {
		t.Fatalf("the snippets do not parse: %v\n%s", err, src.String())
	}
	conf := types.Config{
		Importer: importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
			file, ok := exports[path]
			if !ok {
				return nil, fmt.Errorf("no export data for %s", path)
			}
			return os.Open(file)
		}),
		Error: func(err error) {
			var te types.Error
			if !errors.As(err, &te) {
				t.Errorf("type-checking the README's snippets: %v", err)
				return
			}
			// Only these: go/types calls other errors soft too, such as
			// "no new variables on left side of :=", which do not compile.
			if te.Soft && (strings.Contains(te.Msg, "declared and not used") || strings.Contains(te.Msg, "imported and not used")) {
				return
			}
			t.Errorf("README.md:%d: %s", readmeLine(fset.Position(te.Pos).Line), te.Msg)
		},
	}
	_, _ = conf.Check("readme", fset, []*ast.File{f}, nil)
	for _, pos := range droppedErrors(f) {
		t.Errorf("README.md:%d: err is assigned and not checked by the next statement", readmeLine(fset.Position(pos).Line))
	}
}

// droppedErrors returns where a statement assigns err and the statement
// after it, in the same block, is not an if whose condition reads err:
// what go/types cannot see, as the next assignment to err is a use. A
// review found the producer's snippet overwriting err three times.
func droppedErrors(f *ast.File) []token.Pos {
	var dropped []token.Pos
	ast.Inspect(f, func(n ast.Node) bool {
		block, ok := n.(*ast.BlockStmt)
		if !ok {
			return true
		}
		for i, stmt := range block.List {
			as, ok := stmt.(*ast.AssignStmt)
			if !ok || !slices.ContainsFunc(as.Lhs, isErr) {
				continue
			}
			if i+1 < len(block.List) {
				if next, ok := block.List[i+1].(*ast.IfStmt); ok && readsErr(next.Cond) {
					continue
				}
			}
			dropped = append(dropped, as.Pos())
		}
		return true
	})
	return dropped
}

func isErr(e ast.Expr) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == "err"
}

// readsErr reports whether e mentions err.
func readsErr(e ast.Expr) bool {
	found := false
	ast.Inspect(e, func(n ast.Node) bool {
		if x, ok := n.(ast.Expr); ok && isErr(x) {
			found = true
		}
		return !found
	})
	return found
}

// exportData returns the compiler's export data file of each package
// that pkgs import, directly or not, built by go list.
func exportData(t *testing.T, pkgs []string) map[string]string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go tool on PATH: %v", err)
	}
	cmd := exec.Command(goTool, append([]string{"list", "-export", "-deps", "-f", "{{.ImportPath}}\t{{.Export}}"}, pkgs...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -export: %v\n%s", err, stderr.String())
	}
	exports := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		path, file, ok := strings.Cut(line, "\t")
		if ok && file != "" {
			exports[path] = file
		}
	}
	return exports
}
