package pth

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func module4(name string) string {
	return filepath.Join("..", "fixtures", "testdata", "formats4", name+".pth")
}

// TestOpenModule: each whole pickled module is refused by Open (as torch's
// weights_only loader refuses it) and read by OpenModule, whose state dict
// has model.state_dict()'s keys in order (golden, from torch) and writes
// back as a plain state dict.
func TestOpenModule(t *testing.T) {
	for _, c := range []struct {
		name, class string
		children    int
	}{
		{"seq_module", "torch.nn.modules.container.Sequential", 15},
		{"resnet_module", "torchvision.models.resnet.ResNet", 10},
		{"densenet_module", "torchvision.models.densenet.DenseNet", 2},
		{"vgg_module", "torchvision.models.vgg.VGG", 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := module4(c.name)
			_, err := Open(path)
			var re *RefusedError
			if !errors.As(err, &re) || !LooksLikeModule(re.Globals) {
				t.Fatalf("Open: %v", err)
			}
			ck, m, err := OpenModule(path)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			if m.Class != c.class || len(m.Children) != c.children {
				t.Errorf("root %s with %d children", m.Class, len(m.Children))
			}
			var gold struct {
				Keys []string `json:"keys"`
			}
			b, _ := os.ReadFile(filepath.Join("..", "fixtures", "testdata", "formats4", c.name+".golden.json"))
			if err := json.Unmarshal(b, &gold); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(ck.Keys(), gold.Keys) {
				t.Fatalf("keys %v\nwant %v", ck.Keys(), gold.Keys)
			}
			out := filepath.Join(t.TempDir(), "sd.pth")
			if err := ck.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			sd, err := Open(out)
			if err != nil {
				t.Fatalf("the written state dict: %v", err)
			}
			defer sd.Close()
			for _, k := range gold.Keys {
				a, _ := ck.Values(k)
				b, _ := sd.Values(k)
				if !reflect.DeepEqual(a, b) {
					t.Fatalf("%s differs after writing", k)
				}
				if tt, _ := sd.Tensor(k); tt.Param {
					t.Errorf("%s written as a Parameter", k)
				}
			}
		})
	}
}

// TestModuleAttrs: the hyper-parameters a module holds come out as data.
func TestModuleAttrs(t *testing.T) {
	ck, m, err := OpenModule(module4("seq_module"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	conv := m.Children[0].Module
	if conv.ShortClass() != "Conv2d" || conv.Attr("out_channels") != int64(6) || conv.Attr("padding_mode") != "zeros" {
		t.Errorf("conv attrs %v", conv.Attrs)
	}
	if k, ok := conv.Attr("kernel_size").(*Tuple); !ok || !reflect.DeepEqual(k.Items, []Value{int64(3), int64(3)}) {
		t.Errorf("kernel_size %v", conv.Attr("kernel_size"))
	}
	if len(conv.Params) != 1 || conv.Params[0].Name != "weight" {
		t.Errorf("conv params %v", conv.Params)
	}
	bn := m.Children[6].Module
	if bn.ShortClass() != "BatchNorm2d" || bn.Attr("momentum") != nil || len(bn.Buffers) != 3 {
		t.Errorf("bn(momentum=None): %v, %d buffers", bn.Attrs, len(bn.Buffers))
	}
	if elu := m.Children[7].Module; elu.Attr("alpha") != 0.8 {
		t.Errorf("elu alpha %v", elu.Attr("alpha"))
	}
}

// TestModuleRefused: a custom class, or any global outside the allowlists,
// is refused by name before anything is decoded; a legacy file is refused.
func TestModuleRefused(t *testing.T) {
	_, _, err := OpenModule(module4("custom_module"))
	var mr *ModuleRefusedError
	if !errors.As(err, &mr) || !reflect.DeepEqual(mr.Refused, []string{"__main__.CustomNet"}) || !strings.Contains(err.Error(), "--graph model.onnx") {
		t.Errorf("custom class: %v", err)
	}
	// The same module with one layer class swapped for posix.system.
	bad := rewritePickle(t, module4("seq_module"), "torch.nn.modules.linear\nIdentity\n", "posix\nsystem\n")
	_, _, err = OpenModule(bad)
	if !errors.As(err, &mr) || !reflect.DeepEqual(mr.Refused, []string{"posix.system"}) {
		t.Errorf("posix.system: %v", err)
	}
	_, _, err = OpenModule(filepath.Join("testdata", "convbn_legacy.pth"))
	if err == nil || !strings.Contains(err.Error(), "zip format") {
		t.Errorf("legacy: %v", err)
	}
	// A state dict is not a module.
	_, _, err = OpenModule(filepath.Join("testdata", "convbn_zip.pth"))
	if err == nil || !strings.Contains(err.Error(), "not a module") {
		t.Errorf("state dict: %v", err)
	}
}

// rewritePickle copies a zip checkpoint with old replaced by new in its
// data.pkl.
func rewritePickle(t *testing.T, path, old, new string) string {
	t.Helper()
	z, err := zip.OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	var buf bytes.Buffer
	w := zip.NewWriter(&buf)
	for _, f := range z.File {
		rc, _ := f.Open()
		b, _ := io.ReadAll(rc)
		rc.Close()
		if strings.HasSuffix(f.Name, "data.pkl") {
			if !bytes.Contains(b, []byte(old)) {
				t.Fatalf("%q not in data.pkl", old)
			}
			b = bytes.Replace(b, []byte(old), []byte(new), 1)
		}
		fw, _ := w.CreateHeader(&zip.FileHeader{Name: f.Name, Method: zip.Store})
		fw.Write(b)
	}
	w.Close()
	out := filepath.Join(t.TempDir(), "bad.pth")
	os.WriteFile(out, buf.Bytes(), 0o644)
	return out
}

// TestNewStateDict: a state dict built in memory writes a checkpoint that
// reads back with its dtypes, shapes and values.
func TestNewStateDict(t *testing.T) {
	out := filepath.Join(t.TempDir(), "sd.pth")
	c := NewStateDict(out)
	add := func(k string, d DType, shape []int, v []float64) {
		if err := c.AddTensor(k, d, shape, v); err != nil {
			t.Fatal(err)
		}
	}
	add("a.weight", Float32, []int{2, 2}, []float64{1, -2, 3.5, 0.1})
	add("a.num_batches_tracked", Int64, []int{}, []float64{7})
	add("b", Float16, []int{3}, []float64{1, 0.5, 65504})
	add("empty", Float32, []int{0, 4}, nil)
	if err := c.AddTensor("b", Float32, []int{1}, []float64{1}); err == nil {
		t.Error("a key added twice")
	}
	if err := c.AddTensor("c", Uint8, []int{1}, []float64{300}); err == nil {
		t.Error("300 accepted as uint8")
	}
	if err := c.AddTensor("d", Complex64, []int{1}, []float64{1}); err == nil {
		t.Error("a complex tensor accepted")
	}
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	r, err := Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if !reflect.DeepEqual(r.Keys(), []string{"a.weight", "a.num_batches_tracked", "b", "empty"}) {
		t.Fatalf("keys %v", r.Keys())
	}
	for k, want := range map[string][]float64{"a.weight": {1, -2, 3.5, float64(float32(0.1))}, "a.num_batches_tracked": {7}, "b": {1, 0.5, 65504}, "empty": {}} {
		got, err := r.Values(k)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s = %v, %v; want %v", k, got, err, want)
		}
	}
	if r.DType("b") != "float16" || r.DType("a.num_batches_tracked") != "int64" {
		t.Errorf("dtypes %s %s", r.DType("b"), r.DType("a.num_batches_tracked"))
	}
}

// TestModuleAttrKinds: a pickled segmentation model is read as data;
// a plain dict attribute (IntermediateLayerGetter.return_layers) is kept,
// and attributes that are not plain data (hook dicts) are named in Opaque
// rather than silently dropped.
func TestModuleAttrKinds(t *testing.T) {
	ck, m, err := OpenModule(filepath.Join("..", "fixtures", "testdata", "structure", "fcn_module.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if m.Class != "torchvision.models.segmentation.fcn.FCN" || len(m.Children) != 2 || m.Children[0].Name != "backbone" {
		t.Fatalf("root %s with %d children", m.Class, len(m.Children))
	}
	if v, ok := m.Attrs["aux_classifier"]; !ok || v != nil {
		t.Errorf("aux_classifier %v, %v", v, ok)
	}
	bb := m.Children[0].Module
	d, ok := bb.Attr("return_layers").(*Dict)
	if !ok || d.Len() != 1 {
		t.Fatalf("return_layers %#v", bb.Attr("return_layers"))
	}
	if v, _ := d.Get("layer4"); v != "out" {
		t.Errorf("return_layers[layer4] = %v", v)
	}
	hooks := false
	for _, name := range bb.Opaque {
		if _, plain := bb.Attrs[name]; plain {
			t.Errorf("%s both plain and opaque", name)
		}
		hooks = hooks || name == "_forward_hooks"
	}
	if !hooks {
		t.Errorf("opaque attributes %v lack _forward_hooks", bb.Opaque)
	}
}
