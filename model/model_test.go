package model

import (
	"path/filepath"
	"strings"
	"testing"
)

func testdata(parts ...string) string {
	return filepath.Join(append([]string{"..", "fixtures", "testdata"}, parts...)...)
}

// TestOpen: every input kind opens into the right parts, and a structure.
func TestOpen(t *testing.T) {
	cases := []struct {
		path, format, family string
		opt                  Options
		source               string
	}{
		{testdata("tiny_resnext.pth"), "zip", "resnet", Options{}, SourceRecogniser},
		{testdata("formats4", "tiny_resnet_basic.safetensors"), "safetensors", "resnet", Options{}, SourceRecogniser},
		{testdata("formats4", "densenet_module.pth"), "whole pickled module torchvision.models.densenet.DenseNet", "densenet", Options{}, SourceModule},
		{testdata("formats4", "custom.pth"), "zip", "graph", Options{Graph: testdata("formats4", "custom.onnx")}, SourceGraph},
		{filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx"), "onnx (opset", "onnx", Options{}, SourceONNX},
	}
	for _, c := range cases {
		t.Run(filepath.Base(c.path), func(t *testing.T) {
			n, err := OpenNetwork(c.path, c.opt)
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			if !strings.Contains(n.Format, c.format) || n.Match.Family != c.family || len(n.Weights.Keys()) == 0 {
				t.Errorf("format %q, family %q, %d keys", n.Format, n.Match.Family, len(n.Weights.Keys()))
			}
			parts := 0
			for _, set := range []bool{n.Checkpoint != nil, n.Safetensors != nil, n.ONNX != nil} {
				if set {
					parts++
				}
			}
			if parts != 1 || n.Provenance != nil || n.ProvenanceError != nil {
				t.Errorf("%d format parts set, provenance %v %v", parts, n.Provenance, n.ProvenanceError)
			}
			src, err := n.StructureSource(c.opt)
			if err != nil {
				t.Fatal(err)
			}
			if src.Source != c.source || len(src.SHA256) != 64 {
				t.Errorf("structure source %+v", src)
			}
		})
	}
	if _, err := Open(testdata("none.pth")); err == nil || !strings.Contains(err.Error(), "none.pth") {
		t.Errorf("a missing file: %v", err)
	}
}

// TestDecodeProvenance: records another tool or a newer abnconvert wrote
// are refused with the reason.
func TestDecodeProvenance(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"tool":"abnconvert","schema":1,"relu":"abn"}`, ""},
		{`not json`, "not JSON"},
		{`{"tool":"other","schema":1}`, `written by "other"`},
		{`{"tool":"abnconvert","schema":2}`, "schema 2"},
		{`{"tool":"abnconvert"}`, "schema 0"},
	} {
		p, err := DecodeProvenance([]byte(c.in))
		switch {
		case c.want == "" && (err != nil || p.ReLU != "abn"):
			t.Errorf("%s: %v", c.in, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want %q", c.in, err, c.want)
		}
	}
}
