package pth

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const python = "/usr/bin/python3"

// golden is what fixtures/formats.py computed with torch for one fixture.
type golden struct {
	File      string   `json:"file"`
	Format    string   `json:"format"`
	Globals   []string `json:"globals"`
	Refused   []string `json:"refused"`
	StatePath []string `json:"state_path"`
	Prefix    string   `json:"prefix"`
	Keys      []string `json:"keys"`
	Tensors   []struct {
		Path   []any     `json:"path"`
		DType  string    `json:"dtype"`
		Shape  []int     `json:"shape"`
		Values []float64 `json:"values"`
	} `json:"tensors"`
}

var fixtures = []string{"convbn_zip", "convbn_legacy", "dtypes", "dtypes_legacy", "shared", "views", "views_legacy", "nested", "nested_legacy", "adam", "rmsprop"}

func loadGolden(t *testing.T, name string) *golden {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var g golden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatalf("%s.json: %v", name, err)
	}
	return &g
}

func openFixture(t *testing.T, name string) *Checkpoint {
	t.Helper()
	c, err := Open(filepath.Join("testdata", name+".pth"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// lookup follows a golden path (string keys, int dict keys or list
// indices, as JSON numbers) through the tree.
func lookup(root Value, path []any) (Value, error) {
	v := root
	for _, p := range path {
		switch node := v.(type) {
		case *Dict:
			var k Value
			switch p := p.(type) {
			case string:
				k = p
			case float64:
				k = int64(p)
			}
			next, ok := node.Get(k)
			if !ok {
				return nil, fmt.Errorf("no key %v", p)
			}
			v = next
		case *List:
			i := int(p.(float64))
			if i >= len(node.Items) {
				return nil, fmt.Errorf("index %d out of range", i)
			}
			v = node.Items[i]
		case *Tuple:
			v = node.Items[int(p.(float64))]
		default:
			return nil, fmt.Errorf("cannot index a %s with %v", typeName(v), p)
		}
	}
	return v, nil
}

var (
	torchOnce sync.Once
	torchErr  error
)

// needTorch skips the test when real PyTorch is not installed.
func needTorch(t *testing.T) {
	t.Helper()
	torchOnce.Do(func() {
		torchErr = exec.Command(python, "-c", "import torch").Run()
	})
	if torchErr != nil {
		t.Skipf("%s cannot import torch: %v", python, torchErr)
	}
}

// verifyWithTorch loads out with torch.load(weights_only=True) and compares
// it with the expected flattening of c's tree; it returns the load mode
// ("strict" or "binfloat", see testdata/verify.py).
func verifyWithTorch(t *testing.T, c *Checkpoint, out string) string {
	t.Helper()
	needTorch(t)
	want, err := flattenTree(c)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	exp := out + ".expected.json"
	if err := os.WriteFile(exp, b, 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := torchCheck(out, exp)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(res, "OK ") {
		t.Fatalf("torch disagrees with %s:\n%s", out, res)
	}
	return strings.TrimPrefix(res, "OK ")
}

// verifier is one long-lived verify.py process, so that torch is imported
// once per test run rather than once per check.
var verifier struct {
	sync.Mutex
	in  io.Writer
	out *bufio.Reader
	err error
}

func torchCheck(out, expected string) (string, error) {
	verifier.Lock()
	defer verifier.Unlock()
	if verifier.in == nil && verifier.err == nil {
		cmd := exec.Command(python, "testdata/verify.py", "--serve")
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err == nil {
			var o io.ReadCloser
			if o, err = cmd.StdoutPipe(); err == nil {
				if err = cmd.Start(); err == nil {
					verifier.in, verifier.out = in, bufio.NewReader(o)
				}
			}
		}
		verifier.err = err
	}
	if verifier.err != nil {
		return "", verifier.err
	}
	abs1, _ := filepath.Abs(out)
	abs2, _ := filepath.Abs(expected)
	if _, err := fmt.Fprintf(verifier.in, "%s\t%s\n", abs1, abs2); err != nil {
		return "", err
	}
	line, err := verifier.out.ReadBytes('\n')
	if err != nil {
		verifier.err = fmt.Errorf("verify.py stopped: %w", err)
		return "", verifier.err
	}
	var res string
	if err := json.Unmarshal(line, &res); err != nil {
		return "", fmt.Errorf("verify.py answered %q: %w", line, err)
	}
	return res, nil
}

// flattenTree renders c's tree as verify.py renders what torch loads:
// [path, descriptor] pairs in tree order, with tensors as the write plan
// lays them out and changed values as their dtype stores them.
func flattenTree(c *Checkpoint) ([]any, error) {
	plan, err := c.plan()
	if err != nil {
		return nil, err
	}
	var out []any
	groups := map[*outStorage]string{}
	var walk func(v Value, path string) error
	walk = func(v Value, path string) error {
		switch v := v.(type) {
		case *Tensor:
			vals, err := c.TensorValues(v)
			if err != nil {
				return err
			}
			if v.Changed() {
				b, err := encode(v.DType(), vals)
				if err != nil {
					return err
				}
				if err := decode(v.DType(), b, vals); err != nil {
					return err
				}
			}
			o := plan.tensors[v]
			var st any
			if v.Numel() > 0 {
				if _, ok := groups[o.st]; !ok {
					groups[o.st] = path
				}
				st = groups[o.st]
			}
			rg := v.RequiresGrad
			if v.Param {
				rg = v.ParamRequiresGrad
			}
			shape := append([]int{}, v.Shape...)
			stride := append([]int{}, o.stride...)
			out = append(out, []any{path, map[string]any{"t": "tensor", "dtype": string(v.DType()), "shape": shape,
				"values": vals, "param": v.Param, "requires_grad": rg, "storage": st, "offset": o.offset, "stride": stride}})
		case *Dict:
			kind := "dict"
			if v.Ordered {
				kind = "odict"
			}
			out = append(out, []any{path, map[string]any{"t": kind, "n": v.Len()}})
			for i, k := range v.keys {
				var ks string
				switch k := k.(type) {
				case string:
					ks = "s:" + k
				case int64:
					ks = "i:" + strconv.FormatInt(k, 10)
				default:
					return fmt.Errorf("key %v not supported by the test flattening", k)
				}
				if err := walk(v.vals[i], path+"/"+ks); err != nil {
					return err
				}
			}
			if v.Ordered && v.State != nil {
				names := []string{}
				for _, k := range v.State.keys {
					names = append(names, k.(string))
				}
				sort.Strings(names)
				for _, n := range names {
					sv, _ := v.State.Get(n)
					if err := walk(sv, path+"/@"+n); err != nil {
						return err
					}
				}
			}
		case *List:
			out = append(out, []any{path, map[string]any{"t": "list", "n": len(v.Items)}})
			for i, it := range v.Items {
				if err := walk(it, path+"/#"+strconv.Itoa(i)); err != nil {
					return err
				}
			}
		case *Tuple:
			out = append(out, []any{path, map[string]any{"t": "tuple", "n": len(v.Items)}})
			for i, it := range v.Items {
				if err := walk(it, path+"/#"+strconv.Itoa(i)); err != nil {
					return err
				}
			}
		case nil, bool:
			out = append(out, []any{path, map[string]any{"t": "const", "v": v}})
		case int64:
			out = append(out, []any{path, map[string]any{"t": "int", "v": strconv.FormatInt(v, 10)}})
		case *big.Int:
			out = append(out, []any{path, map[string]any{"t": "int", "v": v.String()}})
		case float64:
			out = append(out, []any{path, map[string]any{"t": "float", "v": v}})
		case string:
			out = append(out, []any{path, map[string]any{"t": "str", "v": v}})
		case Bytes:
			out = append(out, []any{path, map[string]any{"t": "bytes", "v": fmt.Sprintf("%x", []byte(v))}})
		case *Global:
			out = append(out, []any{path, map[string]any{"t": "global", "v": v.String()}})
		default:
			return fmt.Errorf("%s: %T not supported by the test flattening", path, v)
		}
		return nil
	}
	if err := walk(c.Root, ""); err != nil {
		return nil, err
	}
	return out, nil
}

// TestMain maps every stored record, however small, so that the fixtures
// (all under mapMin) take the mapped copy; the tests that want the
// buffered one turn mapCopy off.
func TestMain(m *testing.M) {
	mapMin = 1
	mapProbe = false // the tests choose maps or reads (mapCopy)
	os.Exit(m.Run())
}
