package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/output/outputtest"
	"github.com/abnconvert/abnconvert/pth"
)

func fixture(name string) string {
	return filepath.Join("..", "fixtures", "testdata", "formats4", name)
}

// TestReadsTorchStateDict: every tensor of the safetensors copy of a
// checkpoint decodes to what the checkpoint holds (the .pth read through
// package pth, whose own tests check it against torch).
func TestReadsTorchStateDict(t *testing.T) {
	f, err := Open(fixture("tiny_resnet_basic.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ck, err := pth.Open(filepath.Join("..", "fixtures", "testdata", "tiny_resnet_basic.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if f.Metadata["format"] != "pt" || len(f.Metadata) != 1 {
		t.Errorf("metadata %v, want format=pt", f.Metadata)
	}
	if len(f.Keys()) != len(ck.Keys()) {
		t.Fatalf("%d tensors, the checkpoint has %d", len(f.Keys()), len(ck.Keys()))
	}
	for _, k := range ck.Keys() {
		want, _ := ck.Values(k)
		got, err := f.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		ws, _ := ck.Shape(k)
		gs, _ := f.Shape(k)
		if !equalInts(ws, gs) || !equalFloats(got, want) {
			t.Fatalf("%s: shape %v values %v..., want %v %v...", k, gs, head(got), ws, head(want))
		}
		if f.DType(k).Torch() != pth.DType(ck.DType(k)) {
			t.Errorf("%s: dtype %s, checkpoint %s", k, f.DType(k), ck.DType(k))
		}
	}
}

// TestDTypes: every dtype, and names that need JSON escaping, against the
// values torch computed (dtypes.json).
func TestDTypes(t *testing.T) {
	f, err := Open(fixture("dtypes.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var golden map[string]struct {
		DType  string    `json:"dtype"`
		Shape  []int     `json:"shape"`
		Values []float64 `json:"values"`
	}
	b, err := os.ReadFile(fixture("dtypes.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &golden); err != nil {
		t.Fatal(err)
	}
	if len(golden) != len(f.Keys()) {
		t.Fatalf("%d tensors, golden has %d", len(f.Keys()), len(golden))
	}
	for name, g := range golden {
		got, err := f.Values(name)
		if err != nil {
			t.Fatalf("%q: %v", name, err)
		}
		shape, _ := f.Shape(name)
		if string(f.DType(name)) != g.DType || !equalInts(shape, g.Shape) || !equalFloats(got, g.Values) {
			t.Errorf("%q: %s %v %v, want %s %v %v", name, f.DType(name), shape, got, g.DType, g.Shape, g.Values)
		}
	}
	if f.Metadata["note"] != "fixture \"dtypes\"\n" {
		t.Errorf("metadata note %q", f.Metadata["note"])
	}
}

// TestRewriteIsIdentical: writing a file back unchanged gives the very
// bytes the reference layout (followed by the fixture writer) gives.
func TestRewriteIsIdentical(t *testing.T) {
	for _, name := range []string{"dtypes.safetensors", "tiny_resnet_basic.safetensors"} {
		t.Run(name, func(t *testing.T) {
			f, err := Open(fixture(name))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			out := filepath.Join(t.TempDir(), name)
			if err := f.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			want, _ := os.ReadFile(fixture(name))
			got, _ := os.ReadFile(out)
			if !bytes.Equal(got, want) {
				t.Fatalf("output differs from the input (%d vs %d bytes)", len(got), len(want))
			}
		})
	}
}

// TestSetValues: a changed tensor is re-encoded in its dtype, the others
// keep their bytes, and values a dtype cannot hold are refused at once.
func TestSetValues(t *testing.T) {
	f, err := Open(fixture("dtypes.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.SetValues("f16", []float64{1, 2, 3, 4, 5, 65504}); err != nil {
		t.Fatal(err)
	}
	if err := f.SetValues("u8", []float64{0, 1, 2, 3, 4, 256}); err == nil {
		t.Error("256 accepted for a U8 tensor")
	}
	if err := f.SetValues("f32", []float64{1}); err == nil {
		t.Error("1 value accepted for a [2 3] tensor")
	}
	out := filepath.Join(t.TempDir(), "x.safetensors")
	if err := f.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := f.Write(out, WriteOptions{}); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second write without Force: %v", err)
	}
	g, err := Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if v, _ := g.Values("f16"); !equalFloats(v, []float64{1, 2, 3, 4, 5, 65504}) {
		t.Errorf("f16 after write: %v", v)
	}
	if g.DType("f16") != F16 {
		t.Errorf("f16 written as %s", g.DType("f16"))
	}
	for _, k := range f.Keys() {
		if k == "f16" {
			continue
		}
		a, _ := f.Raw(k)
		b, _ := g.Raw(k)
		if !bytes.Equal(a, b) {
			t.Errorf("%q: bytes changed", k)
		}
	}
	if got := f.Changed(); len(got) != 1 || got[0] != "f16" {
		t.Errorf("Changed() = %v", got)
	}
}

// TestReferenceVectors: the byte-exact files of the reference
// implementation's own tests (safetensors/src/tensor.rs).
func TestReferenceVectors(t *testing.T) {
	f32s := func(v ...float32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b
	}
	data := f32s(0, 1, 2, 3, 4, 5)
	cases := []struct {
		name    string
		tensors []Tensor
		meta    map[string]string
		want    string // header, padding included
	}{
		{"test_serialization", []Tensor{{Name: "attn.0", DType: F32, Shape: []int{1, 2, 3}}}, nil,
			`{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}`},
		{"test_serialization_forced_alignement", []Tensor{{Name: "attn0", DType: F32, Shape: []int{1, 1, 2, 3}}}, nil,
			`{"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}       `},
		{"test_empty", nil, nil, `{}      `},
		{"test_empty with metadata", nil, map[string]string{"framework": "pt"}, `{"__metadata__":{"framework":"pt"}}     `},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for i := range c.tensors {
				c.tensors[i].Write = func(w io.Writer) error { _, err := w.Write(data); return err }
			}
			out := filepath.Join(t.TempDir(), "x.safetensors")
			if err := WriteTensors(out, c.tensors, c.meta, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(out)
			var want []byte
			want = binary.LittleEndian.AppendUint64(want, uint64(len(c.want)))
			want = append(want, c.want...)
			if len(c.tensors) > 0 {
				want = append(want, data...)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("got %q\nwant %q", got, want)
			}
			if _, err := Open(out); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLayoutOrder: tensors by dtype alignment, largest first, then by name
// bytewise, each starting at a multiple of its element size.
func TestLayoutOrder(t *testing.T) {
	ts := []Tensor{
		{Name: "b", DType: F16, Shape: []int{3}}, {Name: "a", DType: BOOL, Shape: []int{1}},
		{Name: "Z", DType: F32, Shape: []int{1}}, {Name: "y", DType: I64, Shape: []int{}},
		{Name: "x", DType: I64, Shape: []int{2}}, {Name: "c", DType: U8, Shape: []int{5}},
	}
	hdr, order, err := Layout(ts, nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, o := range order {
		names = append(names, o.Name)
	}
	if got := strings.Join(names, " "); got != "x y Z b c a" {
		t.Errorf("order %q, want %q", got, "x y Z b c a")
	}
	if !strings.Contains(string(hdr), `"x":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"y":{"dtype":"I64","shape":[],"data_offsets":[16,24]}`) {
		t.Errorf("header %s", hdr)
	}
	if len(hdr)%8 != 0 {
		t.Errorf("header of %d bytes, not padded to 8", len(hdr))
	}
	if _, _, err := Layout([]Tensor{{Name: "a", DType: F32}, {Name: "a", DType: F16}}, nil); err == nil {
		t.Error("a name given twice was accepted")
	}
	if _, _, err := Layout([]Tensor{{Name: "a", DType: "F128"}}, nil); err == nil {
		t.Error("an unknown dtype was accepted")
	}
}

// TestMalformed: hand-built files the reference reader refuses, and
// what this reader says about each.
func TestMalformed(t *testing.T) {
	file := func(header string, data int) []byte {
		var b []byte
		b = binary.LittleEndian.AppendUint64(b, uint64(len(header)))
		b = append(b, header...)
		return append(b, make([]byte, data)...)
	}
	good := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "shorter than the 8-byte header length"},
		{"huge header", binary.LittleEndian.AppendUint64(nil, 1<<40), "more than the 100000000 bytes"},
		{"header past end", append(binary.LittleEndian.AppendUint64(nil, 100), "{}"...), "runs past the end"},
		{"not an object", file(`[1,2]`, 0), "does not start with '{'"},
		{"bad json", file(`{"a":`, 0), "header"},
		{"bad utf8", file("{\"\xff\":1}", 0), "not valid UTF-8"},
		{"duplicate", file(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), `"a" is given twice`},
		{"unknown dtype", file(`{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}`, 16), "unknown dtype"},
		{"missing offsets", file(`{"a":{"dtype":"F32","shape":[1]}}`, 4), "needs dtype, shape and data_offsets"},
		{"size mismatch", file(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, 8), "needs 12"},
		{"gap", file(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), "leave a gap"},
		{"overlap", file(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), "overlap"},
		// Aliasing (issue 44: one tensor under two keys): a header giving
		// two names one byte range is refused like any overlap, as the
		// reference reader refuses it, so a conversion never meets two
		// names whose bytes it would change together. Empty tensors at
		// one offset share no byte and are valid.
		{"alias", file(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 8), `"b": bytes [0, 8) overlap`},
		{"trailing data", file(good, 12), "the file holds 12"},
		{"missing data", file(good, 4), "the file holds 4"},
		{"negative dim", file(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4), "header"},
		{"overflowing shape", file(`{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}`, 4), "too large"},
		{"end before begin", file(`{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}`, 8), "end before they begin"},
		{"metadata not strings", file(`{"__metadata__":{"a":1}}`, 0), "__metadata__ must map strings to strings"},
		{"garbage after object", file(`{}x`, 0), "data after the JSON object"},
	}
	dir := t.TempDir()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_"))
			if err := os.WriteFile(p, c.b, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := Open(p)
			if err == nil {
				f.Close()
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), p) {
				t.Errorf("error %q: want it to name the file and say %q", err, c.want)
			}
			if c.name != "short" && !errors.Is(err, ErrMalformed) {
				t.Errorf("error %q does not wrap ErrMalformed", err)
			}
		})
	}
	p := filepath.Join(dir, "good")
	os.WriteFile(p, file(good, 8), 0o644)
	if f, err := Open(p); err != nil {
		t.Errorf("the good file: %v", err)
	} else {
		f.Close()
	}
}

// TestPythonReader: a checkpoint written as safetensors by Go is read back
// by the pure-Python reader of fixtures/formats4.py, which validates as
// the reference does and compares every tensor, bit for bit, with what
// torch loads from the checkpoint.
func TestPythonReader(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import torch").Run(); err != nil {
		t.Skip("no python3 with torch")
	}
	ref := filepath.Join("..", "fixtures", "testdata", "tiny_resnext.pth")
	ts := checkpointTensors(t, ref)
	out := filepath.Join(t.TempDir(), "x.safetensors")
	if err := WriteTensors(out, ts, map[string]string{"format": "pt"}, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, filepath.Join("..", "fixtures", "formats4.py"), "check-st", out, ref)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func equalFloats(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] && !(math.IsNaN(a[i]) && math.IsNaN(b[i])) {
			return false
		}
	}
	return true
}

func head(v []float64) []float64 {
	if len(v) > 4 {
		return v[:4]
	}
	return v
}

// TestWriteLeavesNoBlocksPastTheEnd: the blocks StageTensors reserves
// for the file it writes (its exact size) are all inside it.
func TestWriteLeavesNoBlocksPastTheEnd(t *testing.T) {
	ts := checkpointTensors(t, filepath.Join("..", "fixtures", "testdata", "tiny_resnext.pth"))
	out := filepath.Join(t.TempDir(), "x.safetensors")
	if err := WriteTensors(out, ts, nil, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	outputtest.NoBlocksPastEnd(t, out)
}

// checkpointTensors describes every tensor of the checkpoint at path for
// WriteTensors, in its own dtypes. The tensors stream from the checkpoint,
// closed when the test ends.
func checkpointTensors(t *testing.T, path string) []Tensor {
	t.Helper()
	ck, err := pth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	ts, err := FromWeights(ck, func(k string) DType { return FromTorch(pth.DType(ck.DType(k))) })
	if err != nil {
		t.Fatal(err)
	}
	return ts
}
