package verify

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/pth"
)

func fixture(name string) string { return filepath.Join("..", "fixtures", "testdata", name+".pth") }

func converted(t *testing.T, name, relu string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), name+"_abn.pth")
	if _, err := convert.Run(convert.Options{Input: fixture(name), Output: out, ReLU: relu}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPreserved: every committed fixture, under both policies, verifies.
func TestPreserved(t *testing.T) {
	for _, name := range []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg", "tiny_resnet_nested"} {
		for _, relu := range []string{"leaky", "abn"} {
			t.Run(name+"/"+relu, func(t *testing.T) {
				res, err := Run(Options{Original: fixture(name), Converted: converted(t, name, relu), ReLU: relu, Size: 32})
				if err != nil {
					t.Fatal(err)
				}
				if !res.Preserved {
					t.Fatalf("not preserved: %v\n%+v", res.Failed, res.Checks)
				}
				if relu == "leaky" && (res.Drift == nil || res.Drift.Sites == 0) {
					t.Errorf("no drift reported under --relu leaky")
				}
				if relu == "abn" && res.Drift != nil && res.Drift.Sites != 0 {
					t.Errorf("drift of %d approximated sites under --relu abn", res.Drift.Sites)
				}
				grads := 0
				for _, c := range res.Checks {
					if strings.HasPrefix(c.Name, "gradient ") {
						grads++
					}
				}
				if grads == 0 {
					t.Error("no parameter gradient compared")
				}
			})
		}
	}
}

// rewriteKey writes a copy of src with one tensor changed by f.
func rewriteKey(t *testing.T, src, key string, f func([]float64)) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	v, err := ck.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	f(v)
	if err := ck.SetValues(key, v); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "changed.pth")
	if err := ck.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

// withoutRecord is a copy of a converted checkpoint without its
// provenance record, as an older abnconvert wrote it.
func withoutRecord(t *testing.T, src string) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if ck.Provenance == nil {
		t.Fatalf("%s has no provenance record", src)
	}
	ck.Provenance = nil
	out := filepath.Join(t.TempDir(), "norecord.pth")
	if err := ck.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestFlagsFromRecord: a converted file's record gives the flags; a flag
// that contradicts it is refused with both values; a file without one is
// verified with the flags given, and the result says which to give.
func TestFlagsFromRecord(t *testing.T) {
	abn := converted(t, "tiny_resnext", "abn")
	res, err := Run(Options{Original: fixture("tiny_resnext"), Converted: abn, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Preserved || !strings.Contains(res.FlagsFrom, "--relu abn") {
		t.Errorf("a --relu abn conversion verified with no flags: preserved %v, flags from %q, failed %v", res.Preserved, res.FlagsFrom, res.Failed)
	}
	for _, c := range []struct {
		opt       Options
		gave, rec string
	}{
		{Options{ReLU: "leaky"}, "--relu leaky", "--relu abn"},
		{Options{Slope: 0.2}, "--slope 0.2", "--slope 0.01"},
		{Options{Sync: true}, "--sync", "did not use --sync"},
		{Options{Arch: "resnet18"}, "--arch resnet18", "--arch auto"},
		{Options{Graph: fixture("tiny_vgg")}, "--graph", "recogniser"},
	} {
		o := c.opt
		o.Original, o.Converted, o.Size = fixture("tiny_resnext"), abn, 32
		_, err := Run(o)
		if err == nil || !strings.Contains(err.Error(), c.gave) || !strings.Contains(err.Error(), c.rec) {
			t.Errorf("%+v: %v, want it to name %q and %q", c.opt, err, c.gave, c.rec)
		}
	}
	// Agreeing flags are fine.
	if res, err := Run(Options{Original: fixture("tiny_resnext"), Converted: abn, ReLU: "abn", Size: 32}); err != nil || !res.Preserved {
		t.Errorf("agreeing flag: %v %+v", err, res)
	}
	// Another original than the one converted: said, and verified anyway.
	other := rewriteKey(t, fixture("tiny_resnext"), "fc.bias", func(v []float64) { v[0] += 1 })
	res, err = Run(Options{Original: other, Converted: abn, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Warnings) != 1 || !strings.Contains(res.Warnings[0], "was converted from tiny_resnext.pth") || res.Preserved {
		t.Errorf("another original: warnings %q, preserved %v", res.Warnings, res.Preserved)
	}
	bare := withoutRecord(t, abn)
	res, err = Run(Options{Original: fixture("tiny_resnext"), Converted: bare, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	if res.FlagsFrom != "command line" || len(res.Warnings) != 1 || !strings.Contains(res.Warnings[0], "no provenance record") || !strings.Contains(res.Warnings[0], "--relu") {
		t.Errorf("no record: from %q, warnings %q", res.FlagsFrom, res.Warnings)
	}
	if res, err := Run(Options{Original: fixture("tiny_resnext"), Converted: bare, ReLU: "abn", Size: 32}); err != nil || !res.Preserved {
		t.Errorf("no record, right flags: %v %+v", err, res)
	}
}

// TestCaught: what verify exists to refuse.
func TestCaught(t *testing.T) {
	good := converted(t, "tiny_resnext", "leaky")
	cases := []struct {
		name, original, converted, relu string
		strict                          bool
		want                            string // a failing check
	}{
		{"one conv weight perturbed", fixture("tiny_resnext"),
			rewriteKey(t, good, "layer2.0.conv2.weight", func(v []float64) { v[7] += 0.05 }), "leaky", false, "eval output"},
		{"one BN bias perturbed", fixture("tiny_resnext"),
			rewriteKey(t, good, "layer3.0.bn3.bias", func(v []float64) { v[0] += 0.01 }), "leaky", false, "eval output"},
		{"one running_var perturbed", fixture("tiny_resnext"),
			rewriteKey(t, good, "layer1.0.bn1.running_var", func(v []float64) { v[1] *= 1.01 }), "leaky", false, "eval output"},
		// The naive conversion: BN weights copied as they are (no |w|+eps
		// reparametrisation, no sign folding): the original file itself.
		{"naive weight copy", fixture("tiny_resnext"), fixture("tiny_resnext"), "leaky", false, "eval output"},
		{"naive copy, exact policy", fixture("tiny_densenet"), fixture("tiny_densenet"), "leaky", false, "eval output"},
		// A converted file without a provenance record is rebuilt from the
		// flags given: wrong ones fail.
		{"flags differ from the conversion's, no record", fixture("tiny_resnext"), withoutRecord(t, good), "abn", false, "eval output"},
		{"drift under --strict", fixture("tiny_resnext"), good, "leaky", true, "drift (--strict)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res, err := Run(Options{Original: c.original, Converted: c.converted, ReLU: c.relu, Strict: c.strict, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			if res.Preserved {
				t.Fatal("verify passed a broken conversion")
			}
			found := false
			for _, f := range res.Failed {
				found = found || f == c.want
			}
			if !found {
				t.Errorf("failed checks %v lack %q", res.Failed, c.want)
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	cases := []struct{ name, original, converted, want string }{
		{"other network", fixture("tiny_resnext"), fixture("tiny_vgg"), "not a conversion of it"},
		{"missing file", fixture("tiny_vgg"), filepath.Join(t.TempDir(), "none.pth"), "none.pth"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Run(Options{Original: c.original, Converted: c.converted})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one mentioning %q", err, c.want)
			}
		})
	}
}

// writeNPY writes a float32 C-order array.
func writeNPY(t *testing.T, path string, shape []int, data []float32) {
	t.Helper()
	hdr := "{'descr': '<f4', 'fortran_order': False, 'shape': ("
	for _, d := range shape {
		hdr += strings.TrimSpace(strings.Repeat(" ", 0)) + itoa(d) + ", "
	}
	hdr += "), }"
	for (10+len(hdr)+1)%64 != 0 {
		hdr += " "
	}
	hdr += "\n"
	b := []byte("\x93NUMPY\x01\x00")
	b = binary.LittleEndian.AppendUint16(b, uint16(len(hdr)))
	b = append(b, hdr...)
	for _, v := range data {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func itoa(d int) string {
	if d == 0 {
		return "0"
	}
	s := ""
	for ; d > 0; d /= 10 {
		s = string(rune('0'+d%10)) + s
	}
	return s
}

func TestInputData(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x.npy")
	data := make([]float32, 1*3*24*24)
	for i := range data {
		data[i] = float32(math.Sin(float64(i)))
	}
	writeNPY(t, path, []int{1, 3, 24, 24}, data)
	x, err := ReadNPY(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(x.Shape) != 4 || x.Shape[3] != 24 || x.Data[5] != data[5] {
		t.Fatalf("read %v, %v", x.Shape, x.Data[:6])
	}
	res, err := Run(Options{Original: fixture("tiny_vgg"), Converted: converted(t, "tiny_vgg", "abn"), ReLU: "abn", InputData: path})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Preserved || res.Input[0] != 1 || res.Input[2] != 24 {
		t.Fatalf("preserved %v, input %v", res.Preserved, res.Input)
	}
	bad := filepath.Join(dir, "bad.npy")
	writeNPY(t, bad, []int{3, 24, 24}, data)
	if _, err := ReadNPY(bad); err == nil || !strings.Contains(err.Error(), "want [N, C, H, W]") {
		t.Fatalf("3-d input: %v", err)
	}
	os.WriteFile(bad, []byte("not numpy"), 0o644)
	if _, err := ReadNPY(bad); err == nil || !strings.Contains(err.Error(), "bad.npy") {
		t.Fatalf("garbage: %v", err)
	}
}
