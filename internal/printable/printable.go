// Package printable makes text that others control safe to show on a
// terminal or in a log line: a producer's payload quoted in a handler's
// error, a consumer's response, a URL someone registered.
package printable

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Line returns s as one line of printable text. Each run of white space,
// newlines and tabs included, becomes one space, and leading and trailing
// white space goes. Every other character that is not printable becomes
// '?': control characters (ESC, which starts a terminal's escape
// sequences, among them), C1 controls, bidi overrides and other format
// characters, which reorder or hide text, and invalid UTF-8.
func Line(s string) string {
	var sb strings.Builder
	for _, f := range strings.Fields(s) {
		if sb.Len() > 0 {
			sb.WriteByte(' ')
		}
		for i, r := range f {
			if !unicode.IsPrint(r) || invalid(f, i, r) {
				r = '?'
			}
			sb.WriteRune(r)
		}
	}
	return sb.String()
}

// invalid reports whether r, at s[i], stands for a byte that is not UTF-8
// (ranging over a string gives utf8.RuneError for it, as for a U+FFFD that
// is there).
func invalid(s string, i int, r rune) bool {
	if r != utf8.RuneError {
		return false
	}
	_, size := utf8.DecodeRuneInString(s[i:])
	return size == 1
}

// Is reports whether s is all printable characters, ASCII space included:
// what Line leaves unchanged, but for white space other than single
// spaces.
func Is(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// JSON returns JSON text b, as encoding/json writes it, with every
// character beyond ASCII that is not printable written as a \u escape:
// the same JSON value, safe on a terminal. encoding/json escapes ASCII
// control characters, U+2028 and U+2029, but writes C1 controls and bidi
// overrides as they are. Such characters can only be in strings, where
// the escape means the same character.
func JSON(b []byte) []byte {
	out := make([]byte, 0, len(b))
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r < utf8.RuneSelf || unicode.IsPrint(r) || r == utf8.RuneError && n == 1 {
			out = append(out, b[i:i+n]...)
		} else {
			for _, u := range utf16.Encode([]rune{r}) {
				out = fmt.Appendf(out, `\u%04x`, u)
			}
		}
		i += n
	}
	return out
}
