package validate

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzQueueName checks QueueName against its definition: 1 to 128 bytes
// of [A-Za-z0-9._:-].
func FuzzQueueName(f *testing.F) {
	for _, s := range []string{"orders", "a", "a.b:c-d_e", "", " ", "naïve", "a\x00b", "'; DROP TABLE x; --", strings.Repeat("q", 128), strings.Repeat("q", 129)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want := len(s) >= 1 && len(s) <= MaxQueueNameBytes
		for i := 0; i < len(s) && want; i++ {
			c := s[i]
			want = c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("._:-", c) >= 0
		}
		if got := QueueName(s) == nil; got != want {
			t.Fatalf("QueueName(%q) accepted=%v, want %v", s, got, want)
		}
	})
}

// FuzzPayload checks that Payload never accepts what encoding/json calls
// invalid, never panics, and that its depth, NUL and surrogate checks
// agree with a decode of the value (which reads a lone surrogate escape as
// U+FFFD).
func FuzzPayload(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, `null`, `1`, `"x"`, `{"a":[1,2,{"b":null}]}`, `{`, ``, ` `, `hello`,
		`"\u0000"`, `"\\u0000"`, `"\\\u0000"`, strings.Repeat("[", 200) + strings.Repeat("]", 200), `{"a":"]]]]"}`,
		`"\ud83d\ude00"`, `"\ud800"`, `"\udc00"`, `"\\ud800"`, `"\ud800\ud800\udc00"`, `"\ufffd"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		err := Payload(b)
		if err == nil && !json.Valid(b) {
			t.Fatalf("Payload accepted invalid JSON %q", b)
		}
		if err != nil || len(b) > MaxPayloadBytes {
			return
		}
		var v any
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber() // big numbers are valid JSON; PostgreSQL's numeric holds them
		if uerr := dec.Decode(&v); uerr != nil {
			t.Fatalf("accepted %q that does not decode: %v", b, uerr)
		}
		if d := decodedDepth(v); d > MaxPayloadDepth {
			t.Fatalf("accepted %q nested %d deep", b, d)
		}
		if hasNUL(v) {
			t.Fatalf("accepted %q holding a NUL character", b)
		}
		if hasRune(v, utf8.RuneError) && !bytes.Contains(b, []byte("\uFFFD")) && !bytes.Contains(bytes.ToLower(b), []byte(`\ufffd`)) {
			t.Fatalf("accepted %q holding a lone surrogate", b)
		}
	})
}

func decodedDepth(v any) int {
	switch x := v.(type) {
	case []any:
		d := 0
		for _, e := range x {
			d = max(d, decodedDepth(e))
		}
		return d + 1
	case map[string]any:
		d := 0
		for _, e := range x {
			d = max(d, decodedDepth(e))
		}
		return d + 1
	}
	return 0
}

func hasNUL(v any) bool { return hasRune(v, 0) }

// hasRune reports whether a decoded value holds r in a string or a key.
func hasRune(v any, r rune) bool {
	switch x := v.(type) {
	case string:
		return strings.ContainsRune(x, r)
	case []any:
		for _, e := range x {
			if hasRune(e, r) {
				return true
			}
		}
	case map[string]any:
		for k, e := range x {
			if strings.ContainsRune(k, r) || hasRune(e, r) {
				return true
			}
		}
	}
	return false
}
