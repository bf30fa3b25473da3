package metrics

import (
	"context"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/notify"
)

// collecting is a prometheus.Registerer that keeps what is registered.
type collecting struct{ cs []prometheus.Collector }

func (c *collecting) Register(x prometheus.Collector) error   { c.cs = append(c.cs, x); return nil }
func (c *collecting) MustRegister(xs ...prometheus.Collector) { c.cs = append(c.cs, xs...) }
func (c *collecting) Unregister(prometheus.Collector) bool    { return false }

// TestReadmeListsEveryMetric: the README's table of metrics has a row for
// each bellhop_ metric the daemon registers, and no row for one it does
// not, and a row's labels column names the metric's labels, in order. The
// README once left four of them out.
func TestReadmeListsEveryMetric(t *testing.T) {
	reg := &collecting{}
	New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	RegisterLeases(reg, func() bellhop.LeaseStats { return bellhop.LeaseStats{} })

	fqName := regexp.MustCompile(`fqName: "(bellhop_[a-z_]+)"`)
	descLabels := regexp.MustCompile(`constLabels: \{([^}]*)\}, variableLabels: \{([^}]*)\}\}$`)
	var registered []string
	labels := map[string]string{} // "app, queue", as the README writes them
	for _, c := range reg.cs {
		ch := make(chan *prometheus.Desc, 64)
		c.Describe(ch)
		close(ch)
		for d := range ch {
			if m := fqName.FindStringSubmatch(d.String()); m != nil {
				registered = append(registered, m[1])
				l := descLabels.FindStringSubmatch(d.String())
				if l == nil || l[1] != "" {
					t.Fatalf("%s: no variable labels, or constant ones, in %s", m[1], d)
				}
				labels[m[1]] = strings.ReplaceAll(l[2], ",", ", ")
			}
		}
	}
	// Guards the parsing of Desc.String: 20 when this was written.
	if len(registered) < 20 {
		t.Fatalf("found %d bellhop_ metrics (%v); the Desc format may have changed", len(registered), registered)
	}

	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var documented []string
	for _, m := range regexp.MustCompile("(?m)^\\| `(bellhop_[a-z_]+)` \\|([^|]*)\\|").FindAllSubmatch(readme, -1) {
		name := string(m[1])
		documented = append(documented, name)
		if want, ok := labels[name]; ok && strings.TrimSpace(string(m[2])) != want {
			t.Errorf("README.md gives %s the labels %q; it has %q", name, strings.TrimSpace(string(m[2])), want)
		}
	}
	for _, name := range registered {
		if !slices.Contains(documented, name) {
			t.Errorf("README.md has no row for %s", name)
		}
	}
	for _, name := range documented {
		if !slices.Contains(registered, name) {
			t.Errorf("README.md has a row for %s, which the daemon does not register", name)
		}
	}
}

// TestLeaseLostDocumented: bellhop_settled_total's HELP and its README row
// say that lease_lost also counts a retried write that found the lease
// gone, when the first try may have recorded the outcome
// (bellhop.ErrOutcomeUnknown). Both said only that the lease was gone
// first, which reads as "not recorded".
func TestLeaseLostDocumented(t *testing.T) {
	const says = "a retried write found it gone, when the first try may have recorded the outcome"
	reg := &collecting{}
	r := New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	ch := make(chan *prometheus.Desc, 1)
	r.settled.Describe(ch)
	if d := (<-ch).String(); !strings.Contains(d, says) {
		t.Errorf("bellhop_settled_total's HELP does not say %q: %s", says, d)
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `bellhop_settled_total` \\|.*$").Find(readme)
	if !strings.Contains(string(row), says) {
		t.Errorf("README.md's row for bellhop_settled_total does not say %q: %s", says, row)
	}
}
