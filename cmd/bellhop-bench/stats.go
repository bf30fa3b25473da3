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
// metrics were first seen, each value with the run it came from.
type Results struct {
	order  []Metric
	values map[Metric][]runValue
	// Notes are free-form lines per scenario (transport, settings used,
	// load averages, errors), printed under the table.
	notes map[string][]string
	// Errors holds failed scenario runs.
	Errors []string
	// run is the scenario run under way, which Add tags values with.
	run int
	// failed holds, per scenario, the runs that failed (listed under
	// Errors): a run that stopped part way may have recorded some of its
	// figures, and neither the medians nor the targets take them.
	failed map[string][]int
	// evidenceRun, if not 0, is the run that samples wait events, keeps
	// statement windows and writes CPU profiles: that instrumentation
	// slows what it watches, so its values are shown apart
	// (EvidenceFigures) and neither the medians nor the targets take them.
	evidenceRun int
}

// runValue is one value of a metric and the scenario run it came from.
type runValue struct {
	Run int
	V   float64
}

func newResults() *Results {
	return &Results{values: map[Metric][]runValue{}, notes: map[string][]string{}, failed: map[string][]int{}}
}

// StartRun tags the values Add records from now on with run.
func (r *Results) StartRun(run int) { r.run = run }

// SetEvidenceRun names the instrumented run whose values are kept out of
// the medians and the targets.
func (r *Results) SetEvidenceRun(run int) { r.evidenceRun = run }

// FailRun marks run of scenario as failed: the values it recorded are
// left out of the table and the targets from now on.
func (r *Results) FailRun(scenario string, run int) {
	if !slices.Contains(r.failed[scenario], run) {
		r.failed[scenario] = append(r.failed[scenario], run)
	}
}

// Add records one value of m, from the run under way.
func (r *Results) Add(m Metric, v float64) {
	if _, ok := r.values[m]; !ok {
		r.order = append(r.order, m)
	}
	r.values[m] = append(r.values[m], runValue{Run: r.run, V: v})
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
	// Runs are the runs Values came from, in the same order.
	Runs []int `json:"runs"`
}

// Summaries returns every metric's median, min and max in report order,
// over the runs that did not fail.
func (r *Results) Summaries() []Summary {
	out := make([]Summary, 0, len(r.order))
	for _, m := range r.order {
		rv := r.kept(m)
		if len(rv) == 0 {
			continue
		}
		s := Summary{Metric: m}
		for _, x := range rv {
			s.Values = append(s.Values, x.V)
			s.Runs = append(s.Runs, x.Run)
		}
		s.Median, s.Min, s.Max = median(s.Values), slices.Min(s.Values), slices.Max(s.Values)
		out = append(out, s)
	}
	return out
}

// kept returns m's values from the scored runs that did not fail.
func (r *Results) kept(m Metric) []runValue {
	var out []runValue
	for _, x := range r.values[m] {
		if !r.isEvidence(x.Run) && !slices.Contains(r.failed[m.Scenario], x.Run) {
			out = append(out, x)
		}
	}
	return out
}

func (r *Results) isEvidence(run int) bool { return r.evidenceRun != 0 && run == r.evidenceRun }

// EvidenceFigure is one value of the evidence run.
type EvidenceFigure struct {
	Metric
	Run   int     `json:"run"`
	Value float64 `json:"value"`
}

// EvidenceFigures returns the values of the evidence run, unless it
// failed, in report order.
func (r *Results) EvidenceFigures() []EvidenceFigure {
	var out []EvidenceFigure
	for _, m := range r.order {
		if slices.Contains(r.failed[m.Scenario], r.evidenceRun) {
			continue
		}
		for _, x := range r.values[m] {
			if r.isEvidence(x.Run) {
				out = append(out, EvidenceFigure{Metric: m, Run: x.Run, Value: x.V})
			}
		}
	}
	return out
}

// Get returns the median of the metric identified by scenario, case and
// name over the runs that did not fail, and whether it has any such
// value.
func (r *Results) Get(scenario, cas, name string) (float64, bool) {
	v := r.Values(scenario, cas, name)
	return median(v), v != nil
}

// Values returns the values of the metric identified by scenario, case
// and name, in the order they were added (run order), from the runs that
// did not fail.
func (r *Results) Values(scenario, cas, name string) []float64 {
	var out []float64
	for _, x := range r.RunValues(scenario, cas, name) {
		out = append(out, x.V)
	}
	return out
}

// RunValues is Values with the run each value came from.
func (r *Results) RunValues(scenario, cas, name string) []runValue {
	for _, m := range r.order {
		if m.Scenario == scenario && m.Case == cas && m.Name == name {
			return r.kept(m)
		}
	}
	return nil
}

// FailedRuns returns the scored runs of scenario that failed, in the
// order they did: a failed evidence run has no figures in the targets to
// leave out.
func (r *Results) FailedRuns(scenario string) []int {
	return slices.DeleteFunc(slices.Clone(r.failed[scenario]), r.isEvidence)
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

// writeEvidenceFigures prints the evidence run's figures, as text or
// Markdown.
func writeEvidenceFigures(w io.Writer, figs []EvidenceFigure, md bool) {
	if md {
		fmt.Fprintln(w, "| Scenario | Case | Metric | Value | Unit |")
		fmt.Fprintln(w, "|---|---|---|--:|---|")
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if !md {
		fmt.Fprintln(tw, "  SCENARIO\tCASE\tMETRIC\tVALUE\tUNIT")
	}
	last := ""
	for _, f := range figs {
		sc := f.Scenario
		if sc == last {
			sc = ""
		}
		last = f.Scenario
		if md {
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", sc, mdEscape(f.Case), mdEscape(f.Name), num(f.Value), f.Unit)
		} else {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", sc, f.Case, f.Name, num(f.Value), f.Unit)
		}
	}
	tw.Flush()
}

func mdEscape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// rate is n per second over d.
func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return math.NaN()
	}
	return float64(n) / d.Seconds()
}
