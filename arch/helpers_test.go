package arch

import (
	"compress/gzip"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// weightsOf builds a shapes-only state dict (values are never read) with
// prefix in front of every key.
func weightsOf(ts []tensor, prefix string) *graph.MemWeights {
	w := graph.NewMemWeights()
	for _, t := range ts {
		w.Put(prefix+t.key, t.shape, nil)
	}
	return w
}

// named returns the generated state dict of a supported name.
func named(t *testing.T, name string, numClasses int) []tensor {
	t.Helper()
	c, ok := lookup(name)
	if !ok {
		t.Fatalf("no config %q", name)
	}
	return c.tensors(numClasses)
}

// edit returns ts without the keys matching drop, with shapes replaced from
// set and keys in add appended.
func edit(ts []tensor, drop string, set map[string][]int, add ...tensor) []tensor {
	var re *regexp.Regexp
	if drop != "" {
		re = regexp.MustCompile(drop)
	}
	var out []tensor
	for _, t := range ts {
		if re != nil && re.MatchString(t.key) {
			continue
		}
		if s, ok := set[t.key]; ok {
			t.shape = s
		}
		out = append(out, t)
	}
	return append(out, add...)
}

// legacyKeys respells dense-layer keys the pre-0.3 way and drops
// num_batches_tracked, as those checkpoints have none.
func legacyKeys(ts []tensor) []tensor {
	re := regexp.MustCompile(`^(.*denselayer\d+\.(?:norm|conv))([12])\.(weight|bias|running_mean|running_var)$`)
	var out []tensor
	for _, t := range ts {
		if strings.HasSuffix(t.key, "num_batches_tracked") {
			continue
		}
		out = append(out, tensor{re.ReplaceAllString(t.key, "$1.$2.$3"), t.shape})
	}
	return out
}

// loadTorchvision reads testdata/torchvision_keys.json.gz (written by
// testdata/gen_keys.py with real torchvision).
func loadTorchvision(t *testing.T) map[string][]tensor {
	t.Helper()
	return loadKeyFile(t, "torchvision_keys.json.gz")
}

// loadKeyFile reads a testdata/*.json.gz of name: [[key, shape], ...].
func loadKeyFile(t *testing.T, file string) map[string][]tensor {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", file))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string][][2]json.RawMessage
	if err := json.NewDecoder(z).Decode(&raw); err != nil {
		t.Fatal(err)
	}
	out := map[string][]tensor{}
	for name, entries := range raw {
		for _, e := range entries {
			var tt tensor
			if err := json.Unmarshal(e[0], &tt.key); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if err := json.Unmarshal(e[1], &tt.shape); err != nil {
				t.Fatalf("%s %s: %v", name, tt.key, err)
			}
			out[name] = append(out[name], tt)
		}
	}
	return out
}

// checkCoverage asserts that the graph references every key of w exactly
// once and nothing else, and that every value has a channel count.
func checkCoverage(t *testing.T, g *graph.Graph, w graph.Weights) {
	t.Helper()
	count := map[string]int{}
	for _, n := range g.Nodes {
		for role, k := range n.Params {
			count[k]++
			if !strings.HasSuffix(k, "."+role) || strings.TrimSuffix(k, "."+role) != n.Name {
				t.Errorf("node %s: role %s maps to key %s, not <node name>.<role>", n.Name, role, k)
			}
		}
		if n.Out.Channels <= 0 {
			t.Errorf("node %s: output has no channel count", n.Name)
		}
	}
	for _, k := range w.Keys() {
		if count[k] != 1 {
			t.Errorf("key %s referenced %d times, want 1", k, count[k])
		}
		delete(count, k)
	}
	var extra []string
	for k := range count {
		extra = append(extra, k)
	}
	sort.Strings(extra)
	if len(extra) > 0 {
		t.Errorf("graph references keys not in the state dict: %v", extra)
	}
	if err := g.Validate(); err != nil {
		t.Error(err)
	}
}

func countOps(g *graph.Graph) map[graph.Op]int {
	m := map[graph.Op]int{}
	for _, n := range g.Nodes {
		m[n.Op]++
	}
	return m
}
