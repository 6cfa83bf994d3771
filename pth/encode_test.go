package pth

import (
	"bytes"
	"math"
	"math/big"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// extras builds a subtree with every kind of value the pickler writes,
// around the edges of each integer opcode and the 1000-item batches.
func extras() *Dict {
	d := NewDict(false)
	ints := &List{}
	for _, n := range []int64{0, 1, 255, 256, 65535, 65536, -1, -256, math.MaxInt32, math.MinInt32, math.MaxInt32 + 1, math.MinInt32 - 1, math.MaxInt64, math.MinInt64} {
		ints.Items = append(ints.Items, n)
	}
	for i := 0; i < 1500; i++ {
		ints.Items = append(ints.Items, int64(i*i-700))
	}
	d.Set("ints", ints)
	big1, _ := new(big.Int).SetString("1267650600228229401496703205376", 10) // 2^100
	d.Set("big", &List{Items: []Value{big1, new(big.Int).Neg(big1), new(big.Int).Lsh(big.NewInt(1), 63)}})
	d.Set("floats", &List{Items: []Value{0.1, math.Copysign(0, -1), 1e300, -2.5}})
	d.Set("strings", &List{Items: []Value{"", "ünïcode ✓", "with\nnewline"}})
	d.Set("tuples", &List{Items: []Value{&Tuple{}, &Tuple{Items: []Value{int64(1)}}, &Tuple{Items: []Value{"a", "b"}},
		&Tuple{Items: []Value{nil, true, false}}, &Tuple{Items: []Value{int64(1), int64(2), int64(3), int64(4), int64(5)}}}})
	byID := NewDict(false)
	for i := 0; i < 1200; i++ {
		byID.Set(int64(i), &List{Items: []Value{int64(i)}})
	}
	d.Set("by_id", byID)
	shared := &List{Items: []Value{"shared"}}
	d.Set("shared1", shared)
	d.Set("shared2", shared)
	d.Set("dtype", &Global{Module: "torch", Name: "float32"})
	return d
}

// TestTreeRoundTrip adds every kind of value to a checkpoint's tree and
// checks that torch loads exactly that, and that this package reads it
// back unchanged.
func TestTreeRoundTrip(t *testing.T) {
	c := openFixture(t, "nested")
	root := c.Root.(*Dict)
	root.Set("extras", extras())
	out := filepath.Join(t.TempDir(), "out.pth")
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	verifyWithTorch(t, c, out)
	back, err := Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	want, err := flattenTree(c)
	if err != nil {
		t.Fatal(err)
	}
	got, err := flattenTree(back)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("tree read back differs")
	}
	e, _ := back.Root.(*Dict).Get("extras")
	s1, _ := e.(*Dict).Get("shared1")
	s2, _ := e.(*Dict).Get("shared2")
	if s1 != s2 {
		t.Errorf("a list referenced twice came back as two lists")
	}
}

// TestBytes: bytes are pickled as _codecs.encode(text, "latin1"), as
// Python's protocol 2 does, and read back.
func TestBytes(t *testing.T) {
	want := Bytes{0, 1, 0x7f, 0x80, 0xff, 'a'}
	tree := &List{Items: []Value{want, want, Bytes{}}}
	data, err := newPickler(&writePlan{}).dump(tree)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(data, []byte("c_codecs\nencode\n")) {
		t.Errorf("bytes not pickled through _codecs.encode")
	}
	u := unpickler{resolve: noStorages}
	got, err := u.load(data)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, &List{Items: []Value{want, want, Bytes{}}}) {
		t.Errorf("read back %#v", got)
	}
}

// TestPickleAsTorch re-pickles the tree of every zip checkpoint torch.save
// wrote in testdata and ../fixtures/testdata, unchanged, and wants torch's
// own data.pkl back byte for byte: the memo indices, the opcodes and their
// order are the ones torch's pickler chooses, which a round trip through
// the unpickler alone would not notice. (Torch memoizes by identity, the
// pickler strings by value: where torch.save met one string as two
// objects, the pickler refers back to the first, and the files differ
// there; those files are named in byIdentity.)
func TestPickleAsTorch(t *testing.T) {
	byIdentity := map[string]bool{"adam.pth": true, "rmsprop.pth": true, "convbn_zip.pth": true}
	var paths []string
	for _, g := range []string{filepath.Join("testdata", "*.pth"), filepath.Join("..", "fixtures", "testdata", "*.pth")} {
		p, _ := filepath.Glob(g)
		paths = append(paths, p...)
	}
	compared := 0
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		want := dataPkl(b)
		if want == nil || byIdentity[filepath.Base(path)] || filepath.Base(path) == "refused.pth" {
			continue // a legacy (pre-zip) file, or one named above, or one refused
		}
		t.Run(filepath.Base(path), func(t *testing.T) {
			c, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			plan, err := c.plan()
			if err != nil {
				t.Fatal(err)
			}
			got, err := newPickler(plan).dump(c.Root)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				i := 0
				for i < min(len(got), len(want)) && got[i] == want[i] {
					i++
				}
				t.Fatalf("%d bytes, torch's %d: they differ from byte %d on (got % x, want % x)", len(got), len(want), i, got[i:min(i+16, len(got))], want[i:min(i+16, len(want))])
			}
		})
		compared++
	}
	if compared < 5 {
		t.Fatalf("compared %d checkpoints, want at least 5", compared)
	}
}
