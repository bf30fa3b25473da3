package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// percentile returns the nearest-rank p-quantile (0 < p <= 1) of sorted,
// the same definition as bench/river uses, so the two sides compare. It
// returns 0 for an empty slice.
func percentile(sorted []int64, p float64) int64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

// latencyStats summarises latencies (nanoseconds, in any order) as
// microseconds.
type latencyStats struct {
	N                       int
	P50, P90, P99, Max, Avg float64 // µs
}

func summarize(ns []int64) latencyStats {
	s := slices.Clone(ns)
	slices.Sort(s)
	var sum float64
	for _, v := range s {
		sum += float64(v)
	}
	us := func(v int64) float64 { return float64(v) / 1e3 }
	st := latencyStats{N: len(s)}
	if len(s) == 0 {
		return st
	}
	st.P50, st.P90, st.P99 = us(percentile(s, .50)), us(percentile(s, .90)), us(percentile(s, .99))
	st.Max = us(s[len(s)-1])
	st.Avg = sum / float64(len(s)) / 1e3
	return st
}

// Metric names one figure of the report. A scenario run produces one value
// per metric; the table shows the median over the runs with the min and
// max beside it.
type Metric struct {
	Scenario string `json:"scenario"`
	Case     string `json:"case"`
	Name     string `json:"name"`
	Unit     string `json:"unit"`
	// LowerIsBetter is for readers of the JSON; the table does not use it.
	LowerIsBetter bool `json:"lower_is_better"`
}

// Results collects the values of every metric across runs, in the order
// metrics were first seen.
type Results struct {
	order  []Metric
	values map[Metric][]float64
	// Notes are free-form lines per scenario (transport, settings used,
	// load averages, errors), printed under the table.
	notes map[string][]string
	// Errors holds failed scenario runs.
	Errors []string
}

func newResults() *Results {
	return &Results{values: map[Metric][]float64{}, notes: map[string][]string{}}
}

// Add records one value of m.
func (r *Results) Add(m Metric, v float64) {
	if _, ok := r.values[m]; !ok {
		r.order = append(r.order, m)
	}
	r.values[m] = append(r.values[m], v)
}

// Note records a line about scenario, once.
func (r *Results) Note(scenario, format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	if !slices.Contains(r.notes[scenario], line) {
		r.notes[scenario] = append(r.notes[scenario], line)
	}
}

// Summary is the aggregate of one metric.
type Summary struct {
	Metric
	Median float64   `json:"median"`
	Min    float64   `json:"min"`
	Max    float64   `json:"max"`
	Values []float64 `json:"values"`
}

// Summaries returns every metric's median, min and max in report order.
func (r *Results) Summaries() []Summary {
	out := make([]Summary, 0, len(r.order))
	for _, m := range r.order {
		v := r.values[m]
		out = append(out, Summary{Metric: m, Median: median(v), Min: slices.Min(v), Max: slices.Max(v), Values: slices.Clone(v)})
	}
	return out
}

// Get returns the median of the metric identified by scenario, case and
// name, and whether it exists.
func (r *Results) Get(scenario, cas, name string) (float64, bool) {
	v := r.Values(scenario, cas, name)
	return median(v), v != nil
}

// Values returns the values of the metric identified by scenario, case
// and name, in the order they were added (run order).
func (r *Results) Values(scenario, cas, name string) []float64 {
	for _, m := range r.order {
		if m.Scenario == scenario && m.Case == cas && m.Name == name {
			return slices.Clone(r.values[m])
		}
	}
	return nil
}

// median of an even number of values is the mean of the middle two.
func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// num formats a figure with a precision that suits its size.
func num(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "n/a"
	case a >= 1000:
		return groupThousands(fmt.Sprintf("%.0f", v))
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	case a == 0:
		return "0"
	}
	return fmt.Sprintf("%.3f", v)
}

// groupThousands puts thin separators in an integer string: 12345 → 12,345.
func groupThousands(s string) string {
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// writeTable prints the summaries as an aligned text table.
func writeTable(w io.Writer, sums []Summary) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tCASE\tMETRIC\tMEDIAN\tMIN – MAX\tUNIT\tRUNS")
	last := ""
	for _, s := range sums {
		sc := s.Scenario
		if sc == last {
			sc = ""
		}
		last = s.Scenario
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s – %s\t%s\t%d\n", sc, s.Case, s.Name, num(s.Median), num(s.Min), num(s.Max), s.Unit, len(s.Values))
	}
	tw.Flush()
}

// writeMarkdownTable prints the summaries as a Markdown table.
func writeMarkdownTable(w io.Writer, sums []Summary) {
	fmt.Fprintln(w, "| Scenario | Case | Metric | Median | Min – max | Unit | Runs |")
	fmt.Fprintln(w, "|---|---|---|--:|--:|---|--:|")
	last := ""
	for _, s := range sums {
		sc := s.Scenario
		if sc == last {
			sc = ""
		}
		last = s.Scenario
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s – %s | %s | %d |\n", sc, mdEscape(s.Case), mdEscape(s.Name), num(s.Median), num(s.Min), num(s.Max), s.Unit, len(s.Values))
	}
}

func mdEscape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// rate is n per second over d.
func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return math.NaN()
	}
	return float64(n) / d.Seconds()
}
