package pth

import (
	"archive/zip"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
)

// TestGoldens reads every fixture and compares it with what torch computed:
// format, state-dict location and keys, prefix, globals, and every tensor
// of the tree (optimizer buffers included) by dtype, shape and values.
func TestGoldens(t *testing.T) {
	for _, name := range fixtures {
		t.Run(name, func(t *testing.T) {
			g := loadGolden(t, name)
			c := openFixture(t, name)
			if string(c.Format) != g.Format {
				t.Errorf("format %s, want %s", c.Format, g.Format)
			}
			if !reflect.DeepEqual(append([]string{}, c.StatePath...), append([]string{}, g.StatePath...)) {
				t.Errorf("state path %q, want %q", c.StatePath, g.StatePath)
			}
			if c.Prefix != g.Prefix {
				t.Errorf("prefix %q, want %q", c.Prefix, g.Prefix)
			}
			if !reflect.DeepEqual(c.Keys(), g.Keys) {
				t.Errorf("keys %q\nwant %q", c.Keys(), g.Keys)
			}
			globals := append([]string{}, c.Globals...)
			sort.Strings(globals)
			if !reflect.DeepEqual(globals, g.Globals) {
				t.Errorf("globals %q, want %q", globals, g.Globals)
			}
			for _, want := range g.Tensors {
				v, err := lookup(c.Root, want.Path)
				if err != nil {
					t.Errorf("%v: %v", want.Path, err)
					continue
				}
				tn, ok := v.(*Tensor)
				if !ok {
					t.Errorf("%v: a %s, not a tensor", want.Path, typeName(v))
					continue
				}
				if string(tn.DType()) != want.DType || !reflect.DeepEqual(append([]int{}, tn.Shape...), append([]int{}, want.Shape...)) {
					t.Errorf("%v: %s%v, want %s%v", want.Path, tn.DType(), tn.Shape, want.DType, want.Shape)
				}
				got, err := c.TensorValues(tn)
				if err != nil {
					t.Errorf("%v: %v", want.Path, err)
					continue
				}
				if !reflect.DeepEqual(got, append([]float64{}, want.Values...)) {
					t.Errorf("%v: values %v\nwant %v", want.Path, got, want.Values)
				}
			}
			// The graph.Weights view agrees with the tree.
			for _, k := range c.Keys() {
				shape, ok := c.Shape(k)
				v, err := c.Values(k)
				if !ok || err != nil || len(v) != prod(shape) || c.DType(k) == "" {
					t.Errorf("%s: shape %v ok=%v, %d values, err %v", k, shape, ok, len(v), err)
				}
			}
		})
	}
}

func prod(s []int) int {
	n := 1
	for _, d := range s {
		n *= d
	}
	return n
}

// TestSharedAndViews checks the storage structure torch wrote: shared
// storages are one *Storage, tied weights (one object) a tensor each of one
// storage whose copy names the object read as its twin, views keep their
// offsets and strides.
func TestSharedAndViews(t *testing.T) {
	c := openFixture(t, "shared")
	a, _ := c.Tensor("a.weight")
	b, _ := c.Tensor("a.bias")
	x, _ := c.Tensor("tied.x")
	y, _ := c.Tensor("tied.y")
	if a.Storage != b.Storage || a.Offset != 0 || b.Offset != 4 {
		t.Errorf("a.weight/a.bias: storages %p %p, offsets %d %d", a.Storage, b.Storage, a.Offset, b.Offset)
	}
	if x == y || x.Storage != y.Storage || y.twin != x || y.object() != x.object() {
		t.Errorf("tied.x and tied.y: one tensor %v, storages %p %p, twin %p of %p: want a tensor each, one storage, tied.y the twin of tied.x", x == y, x.Storage, y.Storage, y.twin, x)
	}
	v := openFixture(t, "views")
	tr, _ := v.Tensor("m.t")
	col, _ := v.Tensor("m.col")
	if tr.Contiguous() || !reflect.DeepEqual(tr.Stride, []int{1, 4}) || col.Offset != 1 || !reflect.DeepEqual(col.Stride, []int{4}) {
		t.Errorf("m.t stride %v, m.col offset %d stride %v", tr.Stride, col.Offset, col.Stride)
	}
}

// TestRefused: a checkpoint with an argparse.Namespace is refused with an
// error naming the global and the file, and Scan still lists the globals.
func TestRefused(t *testing.T) {
	g := loadGolden(t, "refused")
	path := filepath.Join("testdata", "refused.pth")
	_, err := Open(path)
	var re *RefusedError
	if !errors.As(err, &re) {
		t.Fatalf("Open: %v, want a *RefusedError", err)
	}
	if !reflect.DeepEqual(re.Refused, g.Refused) {
		t.Errorf("refused %q, want %q", re.Refused, g.Refused)
	}
	msg := err.Error()
	if !strings.Contains(msg, "argparse.Namespace") || !strings.Contains(msg, path) || strings.Contains(msg, "\n") {
		t.Errorf("error %q should name the file and the global on one line", msg)
	}
	globals, err := Scan(path)
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(globals)
	if !reflect.DeepEqual(globals, g.Globals) {
		t.Errorf("Scan: %q, want %q", globals, g.Globals)
	}
}

// pickleOf builds a minimal legacy-format file around a main pickle, so
// that hand-written pickles can be fed to Open.
func legacyFile(main []byte, keys []byte) []byte {
	var b bytes.Buffer
	// Magic number (LONG1), protocol 1001, sys info {}.
	b.Write([]byte{0x80, 2, 0x8a, 10, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, '.'})
	b.Write([]byte{0x80, 2, 'M', 0xe9, 0x03, '.'})
	b.Write([]byte{0x80, 2, '}', '.'})
	b.Write(main)
	if keys == nil {
		keys = []byte{0x80, 2, ']', '.'}
	}
	b.Write(keys)
	return b.Bytes()
}

// TestMalformed feeds hostile and broken inputs: each must give an error
// naming the file, never a panic or a huge allocation.
func TestMalformed(t *testing.T) {
	convbn, err := os.ReadFile(filepath.Join("testdata", "convbn_zip.pth"))
	if err != nil {
		t.Fatal(err)
	}
	legacy, err := os.ReadFile(filepath.Join("testdata", "convbn_legacy.pth"))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "not a PyTorch checkpoint"},
		{"text", []byte("hello, world\n"), "not a PyTorch checkpoint"},
		{"onnx named .pth", mustRead(t, "../fixtures/testdata/acts/act_net_op13.onnx"), "looks like an ONNX model: give it a .onnx name"},
		{"safetensors named .pth", mustRead(t, "../fixtures/testdata/formats4/dtypes.safetensors"), "looks like a safetensors file"},
		{"truncated zip", convbn[:len(convbn)/2], "zip"},
		{"truncated legacy", legacy[:len(legacy)-10], "legacy storage"},
		{"legacy header only", legacy[:200], "legacy"},
		{"posix.system", legacyFile([]byte("\x80\x02cposix\nsystem\nX\x02\x00\x00\x00lsR."), nil), "posix.system"},
		{"builtins.eval", legacyFile([]byte("\x80\x02c__builtin__\neval\nX\x01\x00\x00\x001\x85R."), nil), "builtins.eval"},
		{"stack global", legacyFile([]byte("\x80\x04\x8c\x05posix\x94\x8c\x06system\x94\x93."), nil), "posix.system"},
		{"numpy scalar", legacyFile([]byte("\x80\x02cnumpy.core.multiarray\nscalar\n)R."), nil), "numpy.core.multiarray.scalar"},
		{"huge length", legacyFile([]byte("\x80\x02X\xff\xff\xff\x7f."), nil), "runs past the end"},
		{"empty LONG1", legacyFile([]byte("\x80\x02\x8a\x00."), nil), "malformed pickle"},
		{"stack underflow", legacyFile([]byte("\x80\x02s."), nil), "malformed pickle"},
		{"unknown opcode", legacyFile([]byte("\x80\x02\xff."), nil), "unknown pickle opcode"},
		{"cycle", legacyFile([]byte("\x80\x02]q\x00h\x00a."), nil), "cycle"},
		{"no stop", append(legacyFile(nil, []byte{}), 0x80, 2, ']'), "runs past the end"},
		{"bad persistent id", legacyFile([]byte("\x80\x02X\x03\x00\x00\x00abcQ."), nil), "storage"},
		{"storage out of range", legacyFile([]byte(
			"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQK\x00K\x05\x85K\x01\x85\x89NtR."),
			[]byte("\x80\x02]X\x01\x00\x00\x000a.")), "reaches element 4"},
		{"missing storage data", legacyFile([]byte(
			"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQK\x00K\x02\x85K\x01\x85\x89NtR."),
			[]byte("\x80\x02]X\x01\x00\x00\x000a.")), "legacy storage \"0\""},
		{"sparse tensor", legacyFile([]byte("\x80\x02ctorch._utils\n_rebuild_sparse_tensor\n)R."), nil), "not supported"},
		{"set", legacyFile([]byte("\x80\x04\x8f."), nil), "unsupported Python object"},
	}
	dir := t.TempDir()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".pth")
			if err := os.WriteFile(path, tc.data, 0o644); err != nil {
				t.Fatal(err)
			}
			c, err := Open(path)
			if err == nil {
				c.Close()
				t.Fatalf("Open succeeded, want an error containing %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Errorf("error %q, want one naming %s and containing %q", err, path, tc.want)
			}
		})
	}
}

// FuzzOpen checks that no input makes Open or a full write panic.
func FuzzOpen(f *testing.F) {
	for _, name := range []string{"convbn_legacy", "views_legacy", "dtypes"} {
		b, err := os.ReadFile(filepath.Join("testdata", name+".pth"))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(dir, "in.pth")
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		c, err := Open(path)
		if err != nil {
			return
		}
		defer c.Close()
		for _, k := range c.Keys() {
			c.Values(k)
		}
		var buf bytes.Buffer
		c.WriteTo(&buf)
	})
}

// TestScanLegacy: Scan lists a legacy file's globals, refused ones
// included, without an error.
func TestScanLegacy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "evil.pth")
	if err := os.WriteFile(path, legacyFile([]byte("\x80\x02cposix\nsystem\nX\x02\x00\x00\x00lsR."), nil), 0o644); err != nil {
		t.Fatal(err)
	}
	globals, err := Scan(path)
	if err != nil || !reflect.DeepEqual(globals, []string{"posix.system"}) {
		t.Errorf("Scan: %q, %v", globals, err)
	}
	globals, err = Scan(filepath.Join("testdata", "nested_legacy.pth"))
	sort.Strings(globals)
	if g := loadGolden(t, "nested_legacy"); err != nil || !reflect.DeepEqual(globals, g.Globals) {
		t.Errorf("Scan: %q, %v, want %q", globals, err, g.Globals)
	}
}

// TestDeflated reads a checkpoint whose records were re-zipped with
// deflate (as an archiver may do): values decode by streaming, and writing
// re-stores the records uncompressed.
func TestDeflated(t *testing.T) {
	src, err := zip.OpenReader(filepath.Join("testdata", "views.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, f := range src.File {
		w, err := zw.CreateHeader(&zip.FileHeader{Name: f.Name, Method: zip.Deflate})
		if err != nil {
			t.Fatal(err)
		}
		rc, _ := f.Open()
		io.Copy(w, rc)
		rc.Close()
	}
	zw.Close()
	dir := t.TempDir()
	in := filepath.Join(dir, "deflated.pth")
	if err := os.WriteFile(in, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	g := loadGolden(t, "views")
	for _, want := range g.Tensors {
		v, _ := lookup(c.Root, want.Path)
		got, err := c.TensorValues(v.(*Tensor))
		if err != nil || !reflect.DeepEqual(got, want.Values) {
			t.Errorf("%v: %v %v, want %v", want.Path, got, err, want.Values)
		}
	}
	change(t, c, "m.col")
	out := filepath.Join(dir, "out.pth")
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	readZip(t, out)
	verifyWithTorch(t, c, out)
}

// TestFirstInvalid: FirstInvalid finds the element a loop over the
// decoded values finds (not finite; or below zero, -0 excepted, where
// asked), on a float32 vector written to a checkpoint with each kind of
// bad value at each place (tested as its bytes lie), and on every tensor
// of every dtype of a fixture torch wrote (decoded).
func TestFirstInvalid(t *testing.T) {
	naive := func(v []float64, nonNegative bool) (int, bool) {
		for i, x := range v {
			if x-x != 0 || nonNegative && x < 0 {
				return i, true
			}
		}
		return 0, false
	}
	dir := t.TempDir()
	const key = "1.running_var"
	bad := []float64{math.NaN(), math.Inf(1), math.Inf(-1), math.Copysign(0, -1), -1e-40, -2, math.SmallestNonzeroFloat32, 0, 3}
	n := 0
	for at := 0; at < 4; at++ {
		for _, x := range bad {
			n++
			c := openFixture(t, "convbn_zip")
			v := []float64{1, 0.5, 2, 4}
			v[at] = x
			if err := c.SetValues(key, v); err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(dir, fmt.Sprintf("v%d.pth", n))
			if err := c.Write(p, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			d, err := Open(p)
			if err != nil {
				t.Fatal(err)
			}
			stored, err := d.Values(key)
			if err != nil {
				t.Fatal(err)
			}
			for _, nonNeg := range []bool{false, true} {
				i, found, err := d.FirstInvalid(key, nonNeg)
				wi, wfound := naive(stored, nonNeg)
				if err != nil || found != wfound || found && i != wi {
					t.Errorf("%v at %d (stored %v), nonNegative %v: FirstInvalid %d %v %v, want %d %v", x, at, stored, nonNeg, i, found, err, wi, wfound)
				}
			}
			d.Close()
		}
	}
	c := openFixture(t, "dtypes")
	for _, k := range c.Keys() {
		v, err := c.Values(k)
		if err != nil {
			continue // (a dtype without real values: FirstInvalid fails too)
		}
		for _, nonNeg := range []bool{false, true} {
			i, found, err := c.FirstInvalid(k, nonNeg)
			wi, wfound := naive(v, nonNeg)
			if err != nil || found != wfound || found && i != wi {
				t.Errorf("%s, nonNegative %v: FirstInvalid %d %v %v, want %d %v", k, nonNeg, i, found, err, wi, wfound)
			}
		}
	}
	if _, _, err := c.FirstInvalid("no.such", false); err == nil {
		t.Error("FirstInvalid of a key the state dict lacks: no error")
	}
}

// TestCompareValues: CompareValues says what comparing a vector with
// Values would: whether any value differs (a NaN equals a NaN) and
// whether the bits are the same (-0 and 0 are not), for a float32 vector
// as stored, one with values set since, one with negated channels, and
// every dtype of a torch fixture (decoded).
func TestCompareValues(t *testing.T) {
	naive := func(a, b []float64) (differ, same bool) {
		if len(a) != len(b) {
			return true, false
		}
		same = true
		for i := range a {
			if a[i] != b[i] && !(a[i] != a[i] && b[i] != b[i]) {
				differ = true
			}
			if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
				same = false
			}
		}
		return differ, same && !differ
	}
	check := func(c *Checkpoint, key string) {
		t.Helper()
		stored, err := c.Values(key)
		if err != nil {
			t.Fatal(err)
		}
		variants := [][]float64{slices.Clone(stored), append(slices.Clone(stored), 1)}
		for i := range stored {
			for _, x := range []float64{math.NaN(), math.Copysign(0, -1), 0, stored[i] + 1, -stored[i]} {
				v := slices.Clone(stored)
				v[i] = x
				variants = append(variants, v)
			}
		}
		for _, v := range variants {
			d, same, err := c.CompareValues(key, v)
			wd, wsame := naive(v, stored)
			if err != nil || d != wd || !d && same != wsame {
				t.Errorf("%s: %v against %v: CompareValues %v %v %v, want %v %v", key, v, stored, d, same, err, wd, wsame)
			}
		}
	}
	c := openFixture(t, "convbn_zip")
	check(c, "1.running_var") // as stored
	if err := c.SetValues("1.weight", []float64{1, math.NaN(), 0, -2}); err != nil {
		t.Fatal(err)
	}
	check(c, "1.weight") // set since
	if _, err := c.NegateChannels("0.weight", []int{1}); err != nil {
		t.Fatal(err)
	}
	check(c, "0.weight") // negated channels
	d := openFixture(t, "dtypes")
	for _, key := range d.Keys() {
		if _, err := d.Values(key); err == nil {
			check(d, key)
		}
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
