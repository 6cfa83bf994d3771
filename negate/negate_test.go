package negate

import (
	"bytes"
	"io"
	"testing"
)

func TestXor(t *testing.T) {
	tests := []struct{ a, b, want []int }{
		{nil, []int{1, 3}, []int{1, 3}},
		{[]int{1, 3}, []int{3, 4}, []int{1, 4}},
		{[]int{1}, []int{1}, []int{}},
		{[]int{0, 2, 5}, []int{1, 2, 6}, []int{0, 1, 5, 6}},
	}
	for _, tc := range tests {
		got := Xor(tc.a, tc.b)
		if len(got) != len(tc.want) {
			t.Errorf("xor(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("xor(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
			}
		}
	}
}

// Channel boundaries that fall inside reads, and element sign bytes that
// straddle them, are flipped exactly once.
func TestReaderChannelsAcrossReads(t *testing.T) {
	// 3 channels of 5 float16 elements: flip channel 1 through 3-byte reads.
	data := make([]byte, 30)
	for i := range data {
		data[i] = byte(i)
	}
	r := &Reader{R: &chunked{data, 3}, Layout: Layout{ChannelBytes: 10, ElemSize: 2, SignByte: 1}, Chans: []int{1}}
	var out bytes.Buffer
	if _, err := out.ReadFrom(r); err != nil {
		t.Fatal(err)
	}
	for i, b := range out.Bytes() {
		want := byte(i)
		if i >= 10 && i < 20 && i%2 == 1 {
			want ^= 0x80
		}
		if b != want {
			t.Fatalf("byte %d = %#x, want %#x", i, b, want)
		}
	}
}

type chunked struct {
	b []byte
	n int
}

func (c *chunked) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := min(c.n, len(p), len(c.b))
	copy(p, c.b[:n])
	c.b = c.b[n:]
	return n, nil
}

func TestAnyNonzero(t *testing.T) {
	l, _ := FloatLayout(true, 2, []int{2, 2})
	tests := []struct {
		b    []byte
		want bool
	}{
		{[]byte{0, 0, 0, 0x80}, false}, // +0, -0
		{[]byte{0, 0, 1, 0x80}, true},  // a negative subnormal
		{[]byte{0, 0x7e, 0, 0}, true},
	}
	for _, tc := range tests {
		if got := l.AnyNonzero(tc.b); got != tc.want {
			t.Errorf("AnyNonzero(% x) = %v, want %v", tc.b, got, tc.want)
		}
	}
}
