package negate

import (
	"bytes"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"slices"
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

// TestCRCDelta: the CRC of a tensor's bytes with channels' signs flipped
// is the original's CRC changed by CRCDelta, for every float width, sign
// byte, channel set (runs and single channels) and window, aligned to
// elements or not.
func TestCRCDelta(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 400; trial++ {
		c := randomFlip(t, r, 5, trial%5 == 0, 3)
		l, es, shape, data, chans, pos, n := c.l, c.es, c.shape, c.data, c.chans, c.pos, c.n
		win := append([]byte(nil), data[pos:pos+n]...)
		want := crc32.ChecksumIEEE(win)
		l.Apply(chans, pos, win)
		got := crc32.ChecksumIEEE(data[pos:pos+n]) ^ l.CRCDelta(chans, pos, n)
		if flipped := crc32.ChecksumIEEE(win); got != flipped {
			t.Fatalf("trial %d: es %d sign byte %d shape %v chans %v window [%d, %d): CRC %08x, want %08x (unflipped %08x)",
				trial, es, l.SignByte, shape, chans, pos, pos+n, got, flipped, want)
		}
	}
}

// TestShiftComposes: shift by a+b is shift by a then b, past 2^32 bytes
// (where the powers table wraps), and agrees with appending zeros.
func TestShiftComposes(t *testing.T) {
	v := rawCRC([]byte("abnconvert"))
	zeros := make([]byte, 1000)
	if got, want := shift(v, 1000), ^crc32.Update(^v, crc32.IEEETable, zeros); got != want {
		t.Fatalf("shift by 1000: %08x, appending zeros %08x", got, want)
	}
	for _, ab := range [][2]int64{{1 << 32, 5}, {3 << 33, 1<<34 + 7}, {1<<40 - 1, 1}} {
		if got, want := shift(shift(v, ab[0]), ab[1]), shift(v, ab[0]+ab[1]); got != want {
			t.Errorf("shift by %d then %d: %08x, by the sum %08x", ab[0], ab[1], got, want)
		}
	}
}

// TestCopyApply: the one-pass copy and flip writes what copy then a byte
// by byte flip of every sign byte writes, for every float width and sign
// byte, any window, in place too.
func TestCopyApply(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for trial := 0; trial < 400; trial++ {
		// Channels of up to 7·3 elements, and every fifth trial of up
		// to 200·3, whose flipped runs take xorRun's four-word steps.
		mid := 7
		if trial%5 == 0 {
			mid = 200
		}
		c := randomFlip(t, r, mid, trial%4 == 0, 2)
		l, es, shape, src, chans, pos, n := c.l, c.es, c.shape, c.data, c.chans, c.pos, c.n
		// The reference: every sign byte of a listed channel, one by one.
		want := append([]byte(nil), src[pos:pos+n]...)
		in := map[int]bool{}
		for _, c := range chans {
			in[c] = true
		}
		for i := pos; i < pos+n; i++ {
			if in[int(i/l.ChannelBytes)] && (i%l.ChannelBytes)%l.ElemSize == l.SignByte {
				want[i-pos] ^= 0x80
			}
		}
		got := make([]byte, n)
		l.CopyApply(got, src[pos:pos+n], chans, pos)
		if !bytes.Equal(got, want) {
			t.Fatalf("trial %d: CopyApply es %d sign %d shape %v chans %v [%d, %d) differs", trial, es, l.SignByte, shape, chans, pos, pos+n)
		}
		// Segments needs Flipped's bytes of scratch, no more.
		scratch := make([]byte, l.Flipped(chans, pos, n))
		if vec := l.Segments(scratch, src[pos:pos+n], chans, pos, nil); !bytes.Equal(bytes.Join(vec, nil), want) {
			t.Fatalf("trial %d: Segments es %d sign %d shape %v chans %v [%d, %d) differ", trial, es, l.SignByte, shape, chans, pos, pos+n)
		}
		inPlace := append([]byte(nil), src[pos:pos+n]...)
		l.Apply(chans, pos, inPlace)
		if !bytes.Equal(inPlace, want) {
			t.Fatalf("trial %d: Apply es %d sign %d shape %v chans %v [%d, %d) differs", trial, es, l.SignByte, shape, chans, pos, pos+n)
		}
	}
}

// flipCase is a random float tensor, channels to flip and a window of it.
type flipCase struct {
	l      Layout
	es     int
	shape  []int
	data   []byte
	chans  []int
	pos, n int64
}

// randomFlip draws a flipCase: a float width, a shape whose middle
// dimension is below mid, any sign byte position when anySign, each
// channel listed with odds 1 in chanOdds, a non-empty window anywhere.
func randomFlip(t *testing.T, r *rand.Rand, mid int, anySign bool, chanOdds int) flipCase {
	t.Helper()
	c := flipCase{es: []int{2, 4, 8}[r.IntN(3)]}
	c.shape = []int{1 + r.IntN(12), 1 + r.IntN(mid), 1 + r.IntN(3)}
	l, ok := FloatLayout(true, c.es, c.shape)
	if !ok {
		t.Fatal("no layout")
	}
	if anySign {
		l.SignByte = int64(r.IntN(c.es))
	}
	c.l = l
	total := int64(c.shape[0]) * l.ChannelBytes
	c.data = make([]byte, total)
	for i := range c.data {
		c.data[i] = byte(r.Uint32())
	}
	for ch := 0; ch < c.shape[0]; ch++ {
		if r.IntN(chanOdds) == 0 {
			c.chans = append(c.chans, ch)
		}
	}
	c.pos = r.Int64N(total)
	c.n = r.Int64N(total-c.pos) + 1
	return c
}

// Set sorts, drops repeats and names the first channel out of range, in
// the order given.
func TestSet(t *testing.T) {
	cases := []struct {
		in      []int
		n       int
		want    []int
		bad     int
		wantOK  bool
		comment string
	}{
		{nil, 4, nil, 0, true, "none"},
		{[]int{3, 1, 3, 0, 1}, 4, []int{0, 1, 3}, 0, true, "repeats, unsorted"},
		{[]int{2}, 4, []int{2}, 0, true, "one"},
		{[]int{1, 5, -1}, 4, nil, 5, false, "first bad is 5"},
		{[]int{1, -1, 5}, 4, nil, -1, false, "first bad is -1"},
	}
	for _, c := range cases {
		in := append([]int(nil), c.in...)
		got, bad, ok := Set(in, c.n)
		if ok != c.wantOK || bad != c.bad || !slices.Equal(got, c.want) {
			t.Errorf("%s: Set(%v, %d) = %v, %d, %v; want %v, %d, %v", c.comment, c.in, c.n, got, bad, ok, c.want, c.bad, c.wantOK)
		}
		if !slices.Equal(in, c.in) {
			t.Errorf("%s: Set changed its argument to %v", c.comment, in)
		}
	}
}

// BenchmarkXorRun: a flipped run of float32 channels copied with its sign
// bits flipped (the copy of a sign-folded record's negated channels).
func BenchmarkXorRun(b *testing.B) {
	l, _ := FloatLayout(true, 4, []int{64, 1024})
	src := make([]byte, 1<<20)
	dst := make([]byte, len(src))
	b.SetBytes(int64(len(src)))
	for i := 0; i < b.N; i++ {
		l.xorRun(dst, src, 0)
	}
}

// TestPowCache: xPow's table answers what the powers compute, for lengths
// that share a slot (many more than it has), asked again, and for lengths
// it does not hold (2^32 and above); shift by one of them agrees with
// appending zeros.
func TestPowCache(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	if got := xPow(0); got != 1<<31 {
		t.Fatalf("xPow(0) = %08x, want x^0 (%08x)", got, uint32(1<<31))
	}
	ns := []int64{1, 2, 3, 1<<32 - 1, 1 << 32, 1<<40 + 3}
	for range 3 * len(powCache) {
		ns = append(ns, 1+r.Int64N(1<<34))
	}
	for pass := range 2 {
		for _, n := range ns {
			if got, want := xPow(n), powOf(n); got != want {
				t.Fatalf("pass %d: xPow(%d) = %08x, the powers give %08x", pass, n, got, want)
			}
		}
	}
	v := rawCRC([]byte("abnconvert"))
	zeros := make([]byte, 4096)
	for _, n := range []int64{7, 4096, 100} {
		if got, want := shift(v, n), ^crc32.Update(^v, crc32.IEEETable, zeros[:n]); got != want {
			t.Fatalf("shift by %d: %08x, appending zeros %08x", n, got, want)
		}
	}
}

// BenchmarkCRCDelta: a 1,024-channel convolution's record (3x3, 512 input
// channels, float32) with every ninth channel negated, as a trained
// checkpoint's sign folds leave it: one run a channel.
func BenchmarkCRCDelta(b *testing.B) {
	l, _ := FloatLayout(true, 4, []int{1024, 512, 3, 3})
	var chans []int
	for c := 0; c < 1024; c += 9 {
		chans = append(chans, c)
	}
	n := 1024 * l.ChannelBytes
	for i := 0; i < b.N; i++ {
		l.CRCDelta(chans, 0, n)
	}
}
