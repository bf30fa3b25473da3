package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// TestChaosLedgerAnalysis checks the soak's judge on a made-up ledger:
// every kind of violation it must catch is caught, and every legitimate
// redelivery is explained by the right cause.
func TestChaosLedgerAnalysis(t *testing.T) {
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return base.Add(time.Duration(s * float64(time.Second))) }
	rig := &chaosRig{t: t, faults: []*faultRec{
		{Kind: faultImmediate, Start: at(100), End: at(100.2), Ready: at(102)},
		{Kind: faultKill, Start: at(200), End: at(200.1), Ready: at(200.2)},
	}}
	prod := &chaosProducer{ambiguous: map[int]bool{90: true}}
	ids := map[string]uuid.UUID{}
	var ledger []ledgerEntry
	// msg registers a committed message (unless seq < 0: nobody's) and
	// its deliveries: attempt, start, duration in seconds, status (0: hang).
	type d struct {
		attempt      int
		start, dur   float64
		status       int
		notAbandoned bool
	}
	msg := func(name string, seq int, committed bool, ds ...d) {
		id := uuid.New()
		ids[name] = id
		if committed {
			prod.committed = append(prod.committed, committedMsg{ID: id, Seq: seq, At: at(1)})
		}
		for _, x := range ds {
			e := ledgerEntry{ID: id, Seq: seq, Attempt: x.attempt, MaxAttempts: chaosMaxAttempts,
				Start: at(x.start), End: at(x.start + x.dur), Status: x.status}
			if x.status == 0 {
				e.Hang, e.Abandoned, e.Status = true, !x.notAbandoned, 500
			}
			ledger = append(ledger, e)
		}
	}
	msg("clean", 1, true, d{1, 10, 0.001, 200, false})
	msg("retry500", 2, true, d{1, 10, 0.001, 500, false}, d{2, 10.2, 0.001, 200, false})
	// Abandoned at 12.4 and nacked, its retry is due when the lease ends
	// (13, nack.sql), not at 12.5: started at 13.6, it is not late.
	msg("retryHang", 3, true, d{1, 10, 2.4, 0, false}, d{2, 13.6, 0.001, 200, false})
	msg("lostAckInKill", 4, true, d{1, 199.5, 0.001, 200, false}, d{2, 203, 0.001, 200, false})
	msg("lostAckNoFault", 5, true, d{1, 50, 0.001, 200, false}, d{2, 53, 0.001, 200, false})
	msg("overlapImmediate", 6, true, d{1, 99.9, 1.6, 200, false}, d{1, 101, 0.001, 200, false})
	msg("overlapNoFault", 7, true, d{1, 30, 2.4, 0, false}, d{2, 31, 0.001, 200, false})
	msg("lost", 8, true, d{1, 40, 0.001, 500, false})
	msg("deadOK", 9, true, d{1, 60, 0.001, 500, false}, d{2, 60.2, 0.001, 500, false}, d{3, 60.6, 0.001, 500, false})
	msg("deadEarly", 10, true, d{1, 70, 0.001, 500, false})
	msg("stray", 11, false, d{1, 80, 0.001, 200, false})
	msg("ambiguous", 90, false, d{1, 80, 0.001, 200, false})
	msg("unseenAttempts", 12, true, d{2, 20, 0.001, 200, false})
	msg("unseenInKill", 13, true, d{2, 202, 0.001, 200, false})
	msg("sameAttemptInImmediate", 14, true, d{1, 101.5, 0.001, 200, false}, d{1, 103, 0.001, 200, false})
	msg("lateAfterFault", 15, true, d{1, 199.9, 0.001, 200, false}, d{2, 230, 0.001, 200, false})
	// A lost claim (the same attempt again) only an immediate restart explains.
	msg("sameAttemptInKill", 16, true, d{1, 199.8, 0.001, 200, false}, d{1, 202, 0.001, 200, false})
	// Dead letters whose last attempt, or every attempt, the consumer never
	// saw: claimed and never pushed, which only a fault explains.
	msg("deadTrailingNoFault", 17, true, d{1, 62, 0.001, 500, false}, d{2, 62.2, 0.001, 500, false})
	msg("deadUnseenNoFault", 18, true)
	msg("deadTrailingInKill", 19, true, d{1, 199.6, 0.001, 500, false}, d{2, 199.8, 0.001, 500, false})
	msg("deadUnseenInImmediate", 20, true)
	dead := map[uuid.UUID]deadRow{
		ids["deadOK"]:                {attempt: 3, max: 3, seq: 9, diedAt: at(60.601)},
		ids["deadEarly"]:             {attempt: 1, max: 3, seq: 10, diedAt: at(70.001)},
		ids["deadTrailingNoFault"]:   {attempt: 3, max: 3, seq: 17, diedAt: at(62.6)},
		ids["deadUnseenNoFault"]:     {attempt: 3, max: 3, seq: 18, diedAt: at(65)},
		ids["deadTrailingInKill"]:    {attempt: 3, max: 3, seq: 19, diedAt: at(204)},
		ids["deadUnseenInImmediate"]: {attempt: 3, max: 3, seq: 20, diedAt: at(105)},
	}

	rep := rig.analyse(ledger, prod, dead)
	defer func() {
		if t.Failed() {
			t.Log("\n" + rep.String())
		}
	}()

	has := func(list []string, name string) bool {
		for _, s := range list {
			if strings.Contains(s, ids[name].String()) {
				return true
			}
		}
		return false
	}
	for _, c := range []struct {
		what string
		list []string
		name string
	}{
		{"lost", rep.lost, "lost"},
		{"bad dead letter", rep.badDead, "deadEarly"},
		{"stray delivery", rep.unknowns, "stray"},
		{"unexplained: 2xx redelivered without a fault", rep.unexplained, "lostAckNoFault"},
		{"unexplained: concurrent deliveries without a fault", rep.unexplained, "overlapNoFault"},
		{"unexplained: attempts never seen, no fault", rep.unexplained, "unseenAttempts"},
		{"unexplained: redelivery long after the fault's window", rep.unexplained, "lateAfterFault"},
		{"unexplained: a lost claim in a kill -9 window", rep.unexplained, "sameAttemptInKill"},
		{"unexplained: dead after attempts never seen past the last delivery, no fault", rep.unexplained, "deadTrailingNoFault"},
		{"unexplained: dead without a delivery, no fault", rep.unexplained, "deadUnseenNoFault"},
	} {
		if !has(c.list, c.name) {
			t.Errorf("%s: %q not reported", c.what, c.name)
		}
	}
	if len(rep.lost) != 1 || len(rep.badDead) != 1 || len(rep.unknowns) != 1 || len(rep.unexplained) != 7 {
		t.Errorf("lost %d, bad dead %d, strays %d, unexplained %d; want 1, 1, 1, 7:\n%s",
			len(rep.lost), len(rep.badDead), len(rep.unknowns), len(rep.unexplained), strings.Join(rep.unexplained, "\n"))
	}
	want := map[string]int{
		"after HTTP 500 (retry by design)":                                                     5,
		"after a hang past the lease (retry by design)":                                        1,
		"fault window: " + faultKill + ": after a 2xx (ack not recorded)":                      1,
		"fault window: " + faultKill + ": attempts the consumer never saw":                     1,
		"fault window: " + faultImmediate + ": overlapping delivery (lost claim)":              1,
		"fault window: " + faultImmediate + ": redelivered with the same attempt (lost claim)": 1,
	}
	for cause, n := range want {
		if rep.causes[cause] != n {
			t.Errorf("cause %q: %d, want %d", cause, rep.causes[cause], n)
		}
	}
	// Every message here was committed at 1s and first delivered 9s or
	// more later: late, where no fault window covers the wait.
	if !has(rep.late, "clean") || has(rep.late, "unseenInKill") {
		t.Errorf("late deliveries misjudged: %v", rep.late)
	}
	for _, s := range rep.late {
		if strings.Contains(s, ids["retryHang"].String()) && !strings.Contains(s, "(enqueued)") {
			t.Errorf("the retry after a hang judged late: %s", s)
		}
	}
	if rep.overlapsImmediate != 1 {
		t.Errorf("overlaps in immediate-restart windows: %d, want 1", rep.overlapsImmediate)
	}
	if rep.extras != 1 {
		t.Errorf("ambiguous commits found: %d, want 1", rep.extras)
	}
	if rep.dead != 6 || rep.acked != 13 {
		t.Errorf("dead %d, acked %d; want 6, 13", rep.dead, rep.acked)
	}
	// The dead letters whose unseen attempts a fault explains: counted by
	// the fault, not reported.
	if rep.deadUnseen != 2 || rep.deadUnseenCauses[faultKill] != 1 || rep.deadUnseenCauses[faultImmediate] != 1 {
		t.Errorf("dead letters after unseen attempts in fault windows: %d %v; want 2, one in a kill -9's and one in an immediate restart's",
			rep.deadUnseen, rep.deadUnseenCauses)
	}
}

// TestChaosLinesAbout: a failed soak's report quotes, for each finding,
// every dispatcher's log lines that name its message, and says so when
// none does.
func TestChaosLinesAbout(t *testing.T) {
	dir := t.TempDir()
	named, silent := uuid.New(), uuid.New()
	logs := map[string]string{
		"dispatcher-1": `{"message_id":"` + named.String() + `","message":"handler failed; will retry"}` + "\n" +
			`{"message_id":"` + uuid.NewString() + `","message":"someone else"}` + "\n",
		"dispatcher-2": `{"message_id":"` + named.String() + `","message":"lease was lost"}` + "\n",
	}
	rig := &chaosRig{t: t}
	for _, name := range []string{"dispatcher-1", "dispatcher-2"} {
		d := &daemon{name: name, logPath: filepath.Join(dir, name+".log")}
		if err := os.WriteFile(d.logPath, []byte(logs[name]), 0o600); err != nil {
			t.Fatal(err)
		}
		rig.ds = append(rig.ds, d)
	}
	got := rig.linesAbout([]string{
		"concurrent deliveries under a live lease: " + named.String() + ": attempt 2/3 overlaps attempt 1/3",
		silent.String() + ": attempt number went back",
		"no id in this one",
	})
	for _, want := range []string{
		"dispatcher-1 " + strings.TrimSuffix(strings.SplitN(logs["dispatcher-1"], "\n", 2)[0], "\n"),
		"dispatcher-2 " + strings.TrimSuffix(logs["dispatcher-2"], "\n"),
		silent.String() + ":\n    (nothing)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in:\n%s", want, got)
		}
	}
	if strings.Contains(got, "someone else") {
		t.Errorf("quoted a line about another message:\n%s", got)
	}
}
