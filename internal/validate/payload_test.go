package validate

import (
	"errors"
	"strings"
	"testing"
)

// TestPayloadSurrogates: a surrogate escape is accepted only as half of a
// pair, high then low, as PostgreSQL's jsonb takes it; encoding/json reads
// a lone one as U+FFFD and accepted it, and the database then refused
// the message, or a whole batch, without saying which.
func TestPayloadSurrogates(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		payload string
		lone    string // the escape named, "" if accepted
	}{
		{`"\ud83d\ude00"`, ""},
		{`{"\ud83d\ude00":["\uD83D\uDE00"]}`, ""},
		{`"\\ud800"`, ""},                  // a backslash, then "ud800"
		{`"\\\ud83d\ude00"`, ""},           // a backslash, then a pair
		{`"\ufffd\u00e9"`, ""},             // not surrogates
		{`"\ud800"`, `\ud800`},             // high at the end
		{`"\udc00"`, `\udc00`},             // low alone
		{`"a\ud800b"`, `\ud800`},           // high, then a character
		{`"\ud800\ud800\udc00"`, `\ud800`}, // the first high has no low
		{`"\ud800\u0041"`, `\ud800`},       // high, then an escape that is not low
		{`["ok", {"k": "\uDBFF"}]`, `\uDBFF`},
		{`"\ud83d\ude00\ude00"`, `\ude00`}, // a pair, then a low alone
	} {
		err := Payload([]byte(tc.payload))
		switch {
		case tc.lone == "" && err != nil:
			t.Errorf("Payload(%s): %v, want accepted", tc.payload, err)
		case tc.lone != "" && (!errors.Is(err, ErrPayload) || !strings.Contains(err.Error(), tc.lone)):
			t.Errorf("Payload(%s): %v, want ErrPayload naming %s", tc.payload, err, tc.lone)
		}
	}
}
