package pth

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"io"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/abnconvert/abnconvert/output"
)

// view is one state-dict entry of a hand-built checkpoint: a float32 view
// of storage st, or (same non-empty) the tensor object of an earlier key.
type view struct {
	key           string
	st, offset    int
	shape, stride []int
	same          string
}

// aliasZip is a zip checkpoint whose state dict holds views, over float32
// storages of sizes elements each (storage i's element j is 100*i+j+1),
// pickled as torch.save pickles them (one object under two keys: pickled
// once, referenced again). It returns the file and the pickle.
func aliasZip(t *testing.T, sizes []int, views ...view) (string, []byte) {
	t.Helper()
	sts := make([]*outStorage, len(sizes))
	recs := []zrec{}
	for i, n := range sizes {
		sts[i] = &outStorage{key: string(rune('0' + i)), class: &Global{"torch", "FloatStorage"}, location: "cpu", numel: n}
		data := make([]byte, 4*n)
		for j := range n {
			binary.LittleEndian.PutUint32(data[4*j:], math.Float32bits(float32(100*i+j+1)))
		}
		recs = append(recs, zrec{name: "archive/data/" + sts[i].key, data: data})
	}
	plan := &writePlan{tensors: map[*Tensor]outTensor{}}
	d := NewDict(true)
	byKey := map[string]*Tensor{}
	for _, v := range views {
		tn := byKey[v.same]
		if tn == nil {
			tn = &Tensor{Storage: &Storage{Key: sts[v.st].key, DType: Float32, Numel: sizes[v.st]}, Offset: v.offset, Shape: v.shape, Stride: v.stride}
			plan.tensors[tn] = outTensor{sts[v.st], v.offset, v.stride}
		}
		byKey[v.key] = tn
		if err := d.Set(v.key, tn); err != nil {
			t.Fatal(err)
		}
	}
	pkl, err := newPickler(plan).dump(d)
	if err != nil {
		t.Fatal(err)
	}
	recs = append([]zrec{{name: "archive/data.pkl", data: pkl}}, recs...)
	recs = append(recs, zrec{name: "archive/version", data: []byte("3\n")}, zrec{name: "archive/byteorder", data: []byte("little")})
	return writeTemp(t, t.TempDir(), "alias.pth", buildZip(t, recs...)), pkl
}

func TestAliases(t *testing.T) {
	cases := []struct {
		name  string
		sizes []int
		views []view
		want  []Alias
	}{
		{"one object under two keys", []int{6}, []view{
			{key: "a.weight", shape: []int{2, 3}, stride: []int{3, 1}},
			{key: "b.weight", same: "a.weight"},
		}, []Alias{{Keys: []string{"a.weight", "b.weight"}, Storage: "0", SameObject: true}}},
		{"overlapping views", []int{12}, []view{
			{key: "m.col", offset: 1, shape: []int{3}, stride: []int{4}},
			{key: "m.x", st: 0, shape: []int{3, 4}, stride: []int{4, 1}},
			{key: "m.off", offset: 5, shape: []int{4}, stride: []int{1}},
		}, []Alias{{Keys: []string{"m.col", "m.x", "m.off"}, Storage: "0"}}},
		{"disjoint views (a flat buffer's weight and bias)", []int{6}, []view{
			{key: "fc.weight", shape: []int{2, 2}, stride: []int{2, 1}},
			{key: "fc.bias", offset: 4, shape: []int{2}, stride: []int{1}},
		}, nil},
		{"a chain: the middle view overlaps both ends", []int{10}, []view{
			{key: "p", shape: []int{4}, stride: []int{1}},
			{key: "r", offset: 6, shape: []int{4}, stride: []int{1}},
			{key: "q", offset: 3, shape: []int{4}, stride: []int{1}},
			{key: "s", offset: 4, shape: []int{0}, stride: []int{1}},
		}, []Alias{{Keys: []string{"p", "r", "q"}, Storage: "0"}}},
		{"two storages, two groups, in file order", []int{4, 4}, []view{
			{key: "x", st: 1, shape: []int{4}, stride: []int{1}},
			{key: "a", st: 0, shape: []int{4}, stride: []int{1}},
			{key: "y", st: 1, offset: 2, shape: []int{2}, stride: []int{1}},
			{key: "b", same: "a"},
			{key: "c", st: 0, offset: 3, shape: []int{1}, stride: []int{1}},
		}, []Alias{{Keys: []string{"x", "y"}, Storage: "1"}, {Keys: []string{"a", "b", "c"}, Storage: "0"}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path, _ := aliasZip(t, tc.sizes, tc.views...)
			c, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if got := c.Aliases(); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Aliases() = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// tiedCheckpoint is a hand-built checkpoint holding one 4x2 tensor object
// under "conv1.weight" and "conv2.weight", and a view "conv3.weight" of
// its storage's second half.
func tiedCheckpoint(t *testing.T) (string, []byte) {
	return aliasZip(t, []int{8},
		view{key: "conv1.weight", shape: []int{4, 2}, stride: []int{2, 1}},
		view{key: "conv2.weight", same: "conv1.weight"},
		view{key: "conv3.weight", offset: 4, shape: []int{2, 2}, stride: []int{2, 1}},
	)
}

// TestAliasUnchangedKept: an alias the conversion does not change is
// written as it was read: the same pickle (one object referenced again),
// the same record.
func TestAliasUnchangedKept(t *testing.T) {
	path, pkl := tiedCheckpoint(t)
	c, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	out := filepath.Join(t.TempDir(), "out.pth")
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	recs := readZip(t, out)
	if !bytes.Equal(recs["archive/data.pkl"], pkl) {
		t.Fatal("the pickle of an unchanged alias changed: the one object is no longer referenced again")
	}
	in := zipContents(t, path)
	if !bytes.Equal(recs["archive/data/0"], in["archive/data/0"]) || len(recs) != len(in) {
		t.Fatalf("records %d (input %d), or record 0 changed", len(recs), len(in))
	}
}

// TestAliasChangedSeparately: a change made through one key of an alias
// reaches that key only, and the writer gives the changed key a record
// of its own, whichever way the record is copied (Write, Prewrite,
// PrewriteLater, the chunked copy), all to the same bytes.
func TestAliasChangedSeparately(t *testing.T) {
	path, _ := tiedCheckpoint(t)
	want := map[string][]float64{
		"conv1.weight": {1, 2, -3, -4, 5, 6, -7, -8}, // channels 1 and 3 negated
		"conv2.weight": {1, 2, 3, 4, 5, 6, 7, 8},     // the tied key keeps the input's values
		"conv3.weight": {-10, -12, 7, 8},             // set through the view
	}
	change := func(t *testing.T, c *Checkpoint) {
		t.Helper()
		if changed, err := c.NegateChannels("conv1.weight", []int{1, 3}); err != nil || !changed {
			t.Fatalf("NegateChannels: %v, %v", changed, err)
		}
		if err := c.SetValues("conv3.weight", want["conv3.weight"]); err != nil {
			t.Fatal(err)
		}
		for k, w := range want {
			if got, err := c.Values(k); err != nil || !slices.Equal(got, w) {
				t.Fatalf("%s after the changes: %v, %v; want %v", k, got, err, w)
			}
		}
	}
	ref, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	change(t, ref)
	var wantBytes bytes.Buffer
	if _, err := ref.WriteTo(&wantBytes); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	refOut := writeTemp(t, dir, "ref.pth", wantBytes.Bytes())
	back, err := Open(refOut)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	for k, w := range want {
		if got, err := back.Values(k); err != nil || !slices.Equal(got, w) {
			t.Errorf("%s read back: %v, %v; want %v", k, got, err, w)
		}
	}
	t1, _ := back.Tensor("conv1.weight")
	t2, _ := back.Tensor("conv2.weight")
	if t1.Storage == t2.Storage {
		t.Error("conv1.weight, changed, still shares conv2.weight's record")
	}
	if in, out := zipContents(t, path)["archive/data/0"], readZip(t, refOut)["archive/data/"+t2.Storage.Key]; !bytes.Equal(in, out) {
		t.Error("the unchanged key's record is not the input's, byte for byte")
	}
	verifyWithTorch(t, ref, refOut)

	defer func(c bool, s chunkSource, n int64) { chunkCopy, chunkSourceFor, chunkLen = c, s, n }(chunkCopy, chunkSourceFor, chunkLen)
	for _, mode := range []struct {
		name    string
		chunked chunkSource
		later   bool
	}{{"prewrite", 0, false}, {"prewrite later", 0, true}, {"chunked", chunkFromReads, true}} {
		t.Run(mode.name, func(t *testing.T) {
			chunkCopy, chunkSourceFor = mode.chunked != 0, mode.chunked
			if mode.chunked != 0 {
				chunkLen = 8
			}
			c, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			out := filepath.Join(t.TempDir(), "out.pth")
			set := output.New(output.Options{})
			defer set.Abort()
			var p *Prewrite
			if mode.later {
				p, err = c.PrewriteLater(set, out, func(string, []int) When { return Now })
			} else {
				p, err = c.Prewrite(set, out)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer p.Stop()
			change(t, c)
			p.Settle()
			if err := p.Finish(); err != nil {
				t.Fatal(err)
			}
			if err := set.Commit(); err != nil {
				t.Fatal(err)
			}
			got := readZip(t, out)
			for name, b := range readZip(t, refOut) {
				if !bytes.Equal(got[name], b) {
					t.Errorf("%s differs from Write's", name)
				}
			}
		})
	}
}

// zipContents is every record of a zip, which readZip would find laid out
// otherwise than torch lays it out (a hand-built input).
func zipContents(t *testing.T, path string) map[string][]byte {
	t.Helper()
	z, err := zip.OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	out := map[string][]byte{}
	for _, f := range z.File {
		rc, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatalf("%s: %v", f.Name, err)
		}
		out[f.Name] = b
	}
	return out
}
