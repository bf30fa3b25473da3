package printable

import (
	"encoding/json"
	"reflect"
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestLine(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"plain text", "plain text"},
		{"  a\r\nb\tc   d ", "a b c d"},
		{"esc\x1b]52;c;ZWNobyBwd25lZAo=\x07 nul\x00 del\x7f", "esc?]52;c;ZWNobyBwd25lZAo=? nul? del?"},
		{"bidi \u202egpj.exe \u2066x\u2069 zero\u200bwidth", "bidi ?gpj.exe ?x? zero?width"},
		{"c1 \u009b31m", "c1 ?31m"},
		{"bad \xff utf-8", "bad ? utf-8"},
		{"replacement \ufffd kept", "replacement \ufffd kept"}, // how lastError writes bad bytes
		{"café ✓ 日本", "café ✓ 日本"},
	} {
		if got := Line(tc.in); got != tc.want {
			t.Errorf("Line(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if got := Line(tc.in); !Is(got) {
			t.Errorf("Line(%q) = %q, which Is calls not printable", tc.in, got)
		}
	}
}

func TestIs(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"https://example.com/a b": true, "café": true, "": true,
		"a\tb": false, "a\nb": false, "\x1b[0m": false, "\u202e": false, "\u009b": false, "\u200b": false, "\xff": false,
	} {
		if got := Is(s); got != want {
			t.Errorf("Is(%q) = %t, want %t", s, got, want)
		}
	}
}

// TestJSON: the escaped text decodes to the same value, and holds no
// character beyond ASCII that is not printable.
func TestJSON(t *testing.T) {
	t.Parallel()
	v := map[string]any{
		"payload":    map[string]any{"n": "a\u202eb\u009b31mc", "ok": "café ✓ 😀", "\u2066key": 1.5, "tag": "x\U000E0001y"},
		"last_error": "bad note \x1b]52;c;x\x07\r\u2028",
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	out := JSON(b)
	var got any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("JSON(%s) = %s, not JSON: %v", b, out, err)
	}
	var want any
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("JSON(%s) = %s, which decodes to %v, want %v", b, out, got, want)
	}
	for s := string(out); s != ""; {
		r, n := utf8.DecodeRuneInString(s)
		if r >= utf8.RuneSelf && !unicode.IsPrint(r) || r < ' ' && r != '\n' {
			t.Errorf("JSON output holds %U: %s", r, out)
		}
		s = s[n:]
	}
}
