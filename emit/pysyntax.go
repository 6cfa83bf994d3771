package emit

import (
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
	"unicode"
)

// pyStr renders s as a Python string literal. Go's quoting escapes (\n, \t,
// \xNN below 0x80, \uNNNN, \UNNNNNNNN, \\, \") mean the same in Python for
// valid UTF-8, which the emitter checks before it gets here.
func pyStr(s string) string { return strconv.Quote(s) }

// pyFloat renders f as a Python float literal that parses back to the same
// float64: Go's shortest round-trip form, with ".0" added where Python would
// otherwise read an int.
func pyFloat(f float64) string {
	switch {
	case math.IsNaN(f):
		return `float("nan")`
	case math.IsInf(f, 1):
		return `float("inf")`
	case math.IsInf(f, -1):
		return `-float("inf")`
	}
	s := strconv.FormatFloat(f, 'g', -1, 64)
	if !strings.ContainsAny(s, ".e") {
		s += ".0"
	}
	return s
}

func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

func pyPair(p [2]int) string { return fmt.Sprintf("(%d, %d)", p[0], p[1]) }

// pyScale renders a scale factor per spatial axis: one float when both
// are equal, as nn.Upsample(scale_factor=2) is written, else a tuple.
func pyScale(s [2]float64) string {
	if s[0] == s[1] {
		return pyFloat(s[0])
	}
	return fmt.Sprintf("(%s, %s)", pyFloat(s[0]), pyFloat(s[1]))
}

// signMask encodes a +1/-1 vector as a hexadecimal integer whose bit c is set
// when channel c is negated: 2048 channels take at most 512 characters, where
// a literal list would take ten times that. It also returns how many channels
// are negated.
func signMask(sign []int8) (string, int, error) {
	var m big.Int
	neg := 0
	for c, s := range sign {
		switch s {
		case 1:
		case -1:
			m.SetBit(&m, c, 1)
			neg++
		default:
			return "", 0, fmt.Errorf("sign entry %d is %d, want +1 or -1", c, s)
		}
	}
	return "0x" + m.Text(16), neg, nil
}

// docText makes free text safe inside a triple-quoted Python docstring:
// backslashes and quotes are escaped so that nothing in it can end the string
// or start an escape, and control characters other than newline and tab are
// written as escapes.
func docText(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == '\\':
			b.WriteString(`\\`)
		case r == '"':
			b.WriteString(`\"`)
		case r == '\n' || r == '\t':
			b.WriteRune(r)
		case r == unicode.ReplacementChar || !unicode.IsPrint(r) && !unicode.IsSpace(r):
			fmt.Fprintf(&b, `\\u%04x`, r)
		case unicode.IsSpace(r):
			b.WriteByte(' ')
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// commentText makes a name safe on one comment line.
func commentText(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 {
		return s
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}
