package onnx

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
)

// TestExternalAliasedRange: initializers whose external data point at one
// byte range of one file (issue 44: one tensor under two names) are still
// converted each on its own. Why it cannot go wrong here: every
// initializer is read into a parameter of its own (its own bytes, its own
// negations), and the writer never writes into the input's data file: a
// changed initializer goes to the output's own data file, the unchanged
// ones keep pointing at the input's range, which nothing changed. This
// test aliases tiny_dense_ext's four conv2 weights ([4 8 3 3]) onto the
// first one's range and checks that each reads back with its own flips
// alone, in memory and from the written model.
func TestExternalAliasedRange(t *testing.T) {
	dir := t.TempDir()
	m := loadProto(t, "testdata/tiny_dense_ext.onnx")
	var aliased []string
	for _, init := range m.Graph.Initializer {
		if !strings.HasSuffix(init.GetName(), ".conv2.weight") {
			continue
		}
		aliased = append(aliased, init.GetName())
		for _, kv := range init.ExternalData {
			if kv.GetKey() == "offset" {
				kv.Value = proto.String("4960") // denseblock1.denselayer1.conv2.weight's
			}
		}
	}
	if len(aliased) != 4 {
		t.Fatalf("%d conv2 weights in the fixture, want 4", len(aliased))
	}
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "m.onnx"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	copyFile(t, "testdata/tiny_dense_ext.data", filepath.Join(dir, "tiny_dense_ext.data"))
	model := mustRead(t, filepath.Join(dir, "m.onnx"))
	before := map[string][]float64{}
	for _, k := range aliased {
		v, err := model.Weights.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		if len(before) > 0 && !equalFloats(v, before[aliased[0]]) {
			t.Fatalf("%s does not read the aliased range", k)
		}
		before[k] = v
	}
	rep := convert(t, model)
	flipped, kept := 0, 0
	want := map[string][]float64{}
	for _, k := range aliased {
		w := append([]float64(nil), before[k]...)
		inner := len(w) / 4
		for _, ch := range rep.Flips[k] {
			for i := ch * inner; i < (ch+1)*inner; i++ {
				w[i] = -w[i]
			}
		}
		if len(rep.Flips[k]) > 0 {
			flipped++
		} else {
			kept++
		}
		want[k] = w
		if got, _ := model.Weights.Values(k); !equalFloats(got, w) {
			t.Errorf("%s after the conversion: not its own flips (%v) alone", k, rep.Flips[k])
		}
	}
	if flipped == 0 || kept == 0 && !differentFlips(rep.Flips, aliased) {
		t.Fatalf("flips %v of the aliased weights: the test proves nothing", rep.Flips)
	}
	for _, k := range aliased {
		t.Logf("%s: flips %v", k, rep.Flips[k])
	}
	out := filepath.Join(dir, "out.onnx")
	if err := model.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	back := mustRead(t, out)
	for _, k := range aliased {
		if got, err := back.Weights.Values(k); err != nil || !equalFloats(got, want[k]) {
			t.Errorf("%s read back from the output: not its own flips alone (%v)", k, err)
		}
	}
	for _, init := range loadProto(t, out).Graph.Initializer {
		for _, kv := range init.ExternalData {
			if kv.GetKey() == "location" && kv.GetValue() == "tiny_dense_ext.data" && len(rep.Flips[init.GetName()]) > 0 {
				t.Errorf("%s, changed, still points at the input's data", init.GetName())
			}
		}
	}
}

// differentFlips reports whether two of keys have different flips.
func differentFlips(flips map[string][]int, keys []string) bool {
	for _, k := range keys[1:] {
		if !equalInts(flips[k], flips[keys[0]]) {
			return true
		}
	}
	return false
}
