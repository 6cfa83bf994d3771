package model

import (
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"unicode/utf8"
)

// Encode is the record as JSON: the bytes json.Marshal writes for it,
// written without reflection. A trained densenet201's record is 260 KB
// (a list of channels for every flip and site), which json.Marshal took
// 1.5-2 ms of a conversion's CPU to write; this takes a fraction of that.
// TestEncodeAsMarshal holds the two to the same bytes. A value JSON cannot
// hold (a NaN or infinite float) gets json.Marshal's own error.
func (p *Provenance) Encode() ([]byte, error) {
	if !p.finite() {
		return json.Marshal(p)
	}
	b := make([]byte, 0, p.sizeHint())
	b = append(b, `{"tool":`...)
	b = appendJSONString(b, p.Tool)
	b = append(b, `,"version":`...)
	b = appendJSONString(b, p.Version)
	b = append(b, `,"schema":`...)
	b = strconv.AppendInt(b, int64(p.Schema), 10)
	b = append(b, `,"input":{"file":`...)
	b = appendJSONString(b, p.Input.File)
	b = append(b, `,"sha256":`...)
	b = appendJSONString(b, p.Input.SHA256)
	if p.Input.Method != "" {
		b = append(b, `,"method":`...)
		b = appendJSONString(b, p.Input.Method)
	}
	b = append(b, `},"structure":{"source":`...)
	b = appendJSONString(b, p.Structure.Source)
	if p.Structure.File != "" {
		b = append(b, `,"file":`...)
		b = appendJSONString(b, p.Structure.File)
	}
	b = append(b, `,"sha256":`...)
	b = appendJSONString(b, p.Structure.SHA256)
	b = append(b, `},"arch":`...)
	b = appendJSONString(b, p.Arch)
	b = append(b, `,"recognised":`...)
	b = appendJSONString(b, p.Recognised)
	b = append(b, `,"relu":`...)
	b = appendJSONString(b, p.ReLU)
	b = append(b, `,"slope":`...)
	b = appendJSONFloat(b, p.Slope)
	b = append(b, `,"sync":`...)
	b = strconv.AppendBool(b, p.Sync)
	if p.TinyGamma != "" {
		b = append(b, `,"tiny_gamma":`...)
		b = appendJSONString(b, p.TinyGamma)
	}
	if p.ONNXOps != "" {
		b = append(b, `,"onnx_ops":`...)
		b = appendJSONString(b, p.ONNXOps)
	}
	b = append(b, `,"bn_eps":`...)
	b = appendJSONMap(b, p.BNEps, appendJSONFloat)
	b = append(b, `,"flips":`...)
	b = appendJSONMap(b, p.Flips, appendJSONInts)
	b = append(b, `,"sites":`...)
	if p.Sites == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i := range p.Sites {
			if i > 0 {
				b = append(b, ',')
			}
			b = p.Sites[i].appendJSON(b)
		}
		b = append(b, ']')
	}
	return append(b, '}'), nil
}

func (s *Site) appendJSON(b []byte) []byte {
	b = append(b, `{"node":`...)
	b = appendJSONString(b, s.Node)
	b = append(b, `,"op":`...)
	b = appendJSONString(b, s.Op)
	b = append(b, `,"activation":`...)
	b = appendJSONString(b, s.Activation)
	if s.ActivationNode != "" {
		b = append(b, `,"activation_node":`...)
		b = appendJSONString(b, s.ActivationNode)
	}
	b = append(b, `,"op_activation":`...)
	b = appendJSONString(b, s.OpActivation)
	if s.OpActivationParam != 0 {
		b = append(b, `,"op_activation_param":`...)
		b = appendJSONFloat(b, s.OpActivationParam)
	}
	b = append(b, `,"outcome":`...)
	b = appendJSONString(b, s.Outcome)
	if len(s.FoldedChannels) > 0 {
		b = append(b, `,"folded_channels":`...)
		b = appendJSONInts(b, s.FoldedChannels)
	}
	if len(s.FoldedInto) > 0 {
		b = append(b, `,"folded_into":[`...)
		for i, x := range s.FoldedInto {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendJSONString(b, x)
		}
		b = append(b, ']')
	}
	if len(s.FlippedChannels) > 0 {
		b = append(b, `,"flipped_channels":`...)
		b = appendJSONInts(b, s.FlippedChannels)
	}
	if len(s.TinyGammaChannels) > 0 {
		b = append(b, `,"tiny_gamma_channels":`...)
		b = appendJSONInts(b, s.TinyGammaChannels)
	}
	if len(s.TinyGammaExactChannels) > 0 {
		b = append(b, `,"tiny_gamma_exact_channels":`...)
		b = appendJSONInts(b, s.TinyGammaExactChannels)
	}
	return append(b, '}')
}

// finite reports whether every float of the record is finite.
func (p *Provenance) finite() bool {
	ok := func(f float64) bool { return !math.IsInf(f, 0) && !math.IsNaN(f) }
	if !ok(p.Slope) {
		return false
	}
	for _, f := range p.BNEps {
		if !ok(f) {
			return false
		}
	}
	for i := range p.Sites {
		if !ok(p.Sites[i].OpActivationParam) {
			return false
		}
	}
	return true
}

// sizeHint is about the record's length, so that its buffer grows once
// or not at all.
func (p *Provenance) sizeHint() int {
	n := 512 + 48*len(p.BNEps)
	for k, v := range p.Flips {
		n += len(k) + 8 + 5*len(v)
	}
	for i := range p.Sites {
		s := &p.Sites[i]
		n += 160 + 2*len(s.Node) + 5*(len(s.FoldedChannels)+len(s.FlippedChannels)+len(s.TinyGammaChannels)+len(s.TinyGammaExactChannels))
		for _, x := range s.FoldedInto {
			n += len(x) + 3
		}
	}
	return n
}

// appendJSONMap writes m as json.Marshal writes a map with string keys:
// null for nil, else its entries in the order of their keys.
func appendJSONMap[V any](b []byte, m map[string]V, value func([]byte, V) []byte) []byte {
	if m == nil {
		return append(b, "null"...)
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = value(b, m[k])
	}
	return append(b, '}')
}

// appendJSONInts writes v as json.Marshal writes an []int (null for nil).
func appendJSONInts(b []byte, v []int) []byte {
	if v == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, x := range v {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(x), 10)
	}
	return append(b, ']')
}

// appendJSONFloat writes a finite f as json.Marshal writes a float64:
// like %g, but with ES6's exponent cutoffs and no padding of the
// exponent (encoding/json's floatEncoder).
func appendJSONFloat(b []byte, f float64) []byte {
	abs := math.Abs(f)
	format := byte('f')
	if abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// e-09 becomes e-9
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}

// appendJSONString writes s quoted as json.Marshal does (HTML-safe:
// encoding/json's appendString with escapeHTML).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '\\', '"':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
