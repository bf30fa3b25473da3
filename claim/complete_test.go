package claim_test

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/bellhopq/bellhop/claim"
)

// TestDeadLetterErrorText: a handler's error text that PostgreSQL would
// refuse (a NUL byte, invalid UTF-8) or that is huge is cleaned before it
// is stored with the dead letter, so it cannot fail the batch it is
// written in: the ack written with it applies too. Both tables.
func TestDeadLetterErrorText(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	cases := []struct {
		name, text string
		want       string // prefix of the stored text
	}{
		{"NUL byte", "upstream said \x00 here", "upstream said \uFFFD here"},
		{"invalid UTF-8", "upstream said \xff\xfe here", "upstream said \uFFFD here"},
		{"huge", strings.Repeat("é", claim.MaxErrorBytes), "éééé"},
		{"plain", "boom", "boom"},
	}
	n := 0
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		for _, tc := range cases {
			t.Run(source.String()+"/"+tc.name, func(t *testing.T) {
				n++
				queue := "text-" + string(rune('a'+n))
				acked, table, target := newMessage(t, client, appID, source, queue)
				dead, _, _ := newMessage(t, client, appID, claim.Queue, queue+"-dead")
				ma := claimOne(t, pool, target, acked)
				md := claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: queue + "-dead"}, dead)
				applied, err := claim.Write(ctx, pool, []claim.Outcome{
					{Message: &ma, Verdict: claim.Ack},
					{Message: &md, Verdict: claim.DeadLetter, Error: tc.text, Queue: queue + "-dead"},
				})
				if err != nil {
					t.Fatalf("write: %v", err)
				}
				if !applied.Has(&ma) || !applied.Has(&md) {
					t.Fatalf("applied %v, want both", applied)
				}
				if s := snapshot(t, pool, table, acked); s != "" {
					t.Errorf("the ack batched with the dead letter left its message: %s", s)
				}
				var stored string
				if err := pool.QueryRow(ctx, `SELECT last_error FROM dead_letters WHERE id = $1`, dead).Scan(&stored); err != nil {
					t.Fatalf("dead letter: %v", err)
				}
				if !utf8.ValidString(stored) || strings.ContainsRune(stored, 0) || len(stored) > claim.MaxErrorBytes {
					t.Errorf("stored %d bytes, valid UTF-8 %v, NUL %v", len(stored), utf8.ValidString(stored), strings.ContainsRune(stored, 0))
				}
				if !strings.HasPrefix(stored, tc.want) {
					t.Errorf("stored %.40q…, want it to start with %q", stored, tc.want)
				}
				if tc.name == "plain" && stored != tc.text {
					t.Errorf("stored %q, want it unchanged", stored)
				}
			})
		}
	}
}
