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

// TestNumberText: the length of a number as numeric writes it, measured
// with PostgreSQL 15 (length(x::jsonb::text), sign left out), and whether
// numeric holds it at all. The root package's TestNumberTextMatchesServer
// compares these with the server of the test run.
func TestNumberText(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		num  string
		want int // -1: beyond numeric's range
	}{
		{"0", 1}, {"-0", 1}, {"-0.0", 3}, {"7", 1}, {"-12", 2}, {"1.50", 4}, {"1E+2", 3}, {"1e-3", 5},
		{"100e-2", 4}, {"1.50e1", 4}, {"0.00e2", 1}, {"0.01e3", 2}, {"0.000", 5}, {"12.5e-1", 4},
		{"1e131071", 131072}, {"9.9e131071", 131072}, {"0.1e131072", 131072}, {"1e+0131071", 131072},
		{"1e131072", -1}, {"10e131071", -1}, {"0.1e131073", -1},
		{"1e-16383", 16385}, {"123.456e-16380", 16385}, {"-0e-16383", 16385},
		{"1e-16384", -1}, {"0e-16384", -1}, {"0.0e-16383", -1}, {"0.001e-16381", -1},
		{"0e1000000", 1}, {"0e131073", 1}, {"0e1073741822", 1},
		// PostgreSQL 16 takes this exponent, 14 and 15 refuse it: refused
		// on every version, so that the server never refuses it (which
		// would abort an EnqueueTx caller's transaction).
		{"0e1073741823", -1}, {"0e-1073741823", -1},
		{"0e1073741824", -1}, {"0e99999999999", -1}, {"1e99999999999999999999999", -1}, {"1e-99999999999999999999999", -1},
	} {
		n, ok := NumberText([]byte(tc.num))
		if want := tc.want >= 0; ok != want || ok && n != tc.want {
			t.Errorf("NumberText(%s) = %d, %t; want %d", tc.num, n, ok, tc.want)
		}
	}
}

// TestPayloadNumbers: numbers beyond numeric's range, and numbers that
// jsonb would write out to more than the size limit, are refused before
// they reach the server, which built their text in full first: 90 KB of
// [1e131071, ...] grew to a gigabyte and ran it out of memory.
func TestPayloadNumbers(t *testing.T) {
	t.Parallel()
	many := func(num string, n int) string { return "[" + strings.TrimSuffix(strings.Repeat(num+",", n), ",") + "]" }
	for _, tc := range []struct {
		name, payload string
		want          error // nil: accepted
		text          string
	}{
		{"ordinary", `{"n":1.5,"m":[-2e3,0,1E-2]}`, nil, ""},
		{"largest integer", `1e131071`, nil, ""},
		{"numbers just within the limit", many("1e131071", 8), nil, ""},
		{"numbers past the limit", many("1e131071", 9), ErrTooLarge, "its numbers alone are 1179648 bytes as jsonb text"},
		{"many small exponents", many("1e-16383", 10000), ErrTooLarge, "its numbers alone are"},
		{"beyond numeric", `{"a":[1,1e131072]}`, ErrPayload, `number "1e131072" is beyond the range of PostgreSQL's numeric`},
		{"beyond numeric, after the point", `[1e-16384]`, ErrPayload, `number "1e-16384"`},
		{"number at the end", `1e-16384`, ErrPayload, `number "1e-16384"`},
		{"digits in strings are not numbers", `["1e131072", "1e131071"]`, nil, ""},
		// jsonb keeps only the last value of a duplicate key.
		{"duplicate keys", "{" + strings.TrimSuffix(strings.Repeat(`"a":1e131071,`, 9), ",") + "}", nil, ""},
		{"distinct keys", `{"a":1e131071,"b":1e131071,"c":1e131071,"d":1e131071,"e":1e131071,"f":1e131071,"g":1e131071,"h":1e131071,"i":1e131071}`,
			ErrTooLarge, "its numbers alone are 1179648 bytes"},
		{"duplicate keys, nested", `[{"a":[1e131071,1e131071],"a":1},` + strings.TrimSuffix(strings.Repeat(`1e131071,`, 7), ",") + "]", nil, ""},
	} {
		err := Payload([]byte(tc.payload))
		switch {
		case tc.want == nil && err != nil:
			t.Errorf("%s: %v, want accepted", tc.name, err)
		case tc.want != nil && (!errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text)):
			t.Errorf("%s: %v, want %v containing %q", tc.name, err, tc.want, tc.text)
		}
	}
}
