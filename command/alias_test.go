package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/pth"
)

// TestAliasedKeys: a state dict holding one storage under two keys
// (fixtures/alias.py, torch 1.13) converts each key on its own, through
// every write path a .pth input takes (.pth, .safetensors, revert):
// verify, which runs both networks, exits 0 (1 before issue 44, where one
// storage received both keys' sign folds); the keys the conversion
// changes no longer share a storage and the others read back as the
// input; convert, its report and inspect name the keys.
func TestAliasedKeys(t *testing.T) {
	const a, b = "layer1.0.conv1.weight", "layer1.0.conv2.weight"
	cases := []struct {
		file       string
		keys       []string
		changed    []string // under the default --relu leaky
		sameObject bool
	}{
		{"tied_keep_vars", []string{a, b}, []string{a, b}, true},
		{"tied_detached", []string{a, b}, []string{a, b}, false},
		{"assigned", []string{a, b}, []string{a, b}, true},
		{"tied_untouched", []string{b, "layer1.1.conv2.weight"}, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.file, func(t *testing.T) {
			in := filepath.Join("..", "fixtures", "testdata", "alias", tc.file+".pth")
			dir := t.TempDir()
			out, rep := filepath.Join(dir, "out.pth"), filepath.Join(dir, "report.json")
			code, stdout, stderr := run("convert", "-i", in, "-o", out, "--report", rep)
			if code != 0 {
				t.Fatalf("convert exit %d: %s", code, stderr)
			}
			if want := "aliased keys: " + strings.Join(tc.keys, ", ") + " share storage"; !strings.Contains(stdout, want) {
				t.Errorf("the table lacks %q:\n%s", want, stdout)
			}
			var res convert.Result
			raw, err := os.ReadFile(rep)
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(raw, &res); err != nil {
				t.Fatal(err)
			}
			if len(res.Aliases) != 1 {
				t.Fatalf("report aliases %+v, want one group", res.Aliases)
			}
			g := res.Aliases[0]
			var changed []string
			for _, c := range g.Changed {
				changed = append(changed, c.Key)
				if !strings.Contains(c.Why, "negative gamma") {
					t.Errorf("%s: why %q names no negative gamma", c.Key, c.Why)
				}
			}
			want := "shared"
			if len(tc.changed) > 0 {
				want = "separate"
			}
			if !slices.Equal(g.Keys, tc.keys) || !slices.Equal(changed, tc.changed) || g.SameObject != tc.sameObject || g.Written != want {
				t.Errorf("report group %+v: want keys %v, changed %v, same object %v, written %s", g, tc.keys, tc.changed, tc.sameObject, want)
			}

			if code, stdout, stderr := run("verify", "--original", in, "--converted", out, "--quiet"); code != 0 {
				t.Fatalf("verify exit %d: %s%s", code, tail(stdout), stderr)
			}
			src, conv := openPth(t, in), openPth(t, out)
			t0, _ := conv.Tensor(tc.keys[0])
			t1, _ := conv.Tensor(tc.keys[1])
			if shared := t0.Storage == t1.Storage; shared != (len(tc.changed) == 0) {
				t.Errorf("output keys share a storage: %v, with %d of them changed", shared, len(tc.changed))
			}
			if len(tc.changed) == 0 {
				if al := conv.Aliases(); len(al) != 1 || al[0].SameObject != tc.sameObject {
					t.Errorf("the untouched alias is not kept as read: %+v", al)
				}
			}
			for _, k := range tc.keys {
				before, _ := src.Values(k)
				after, _ := conv.Values(k)
				if same := slices.Equal(before, after); same == slices.Contains(tc.changed, k) {
					t.Errorf("%s: output equals input %v, changed by the conversion %v", k, same, slices.Contains(tc.changed, k))
				}
			}

			st := filepath.Join(dir, "out.safetensors")
			if code, _, stderr := run("convert", "-i", in, "-o", st, "--quiet"); code != 0 {
				t.Fatalf("convert to .safetensors exit %d: %s", code, stderr)
			}
			if code, stdout, stderr := run("verify", "--original", in, "--converted", st, "--quiet"); code != 0 {
				t.Fatalf("verify of the .safetensors exit %d: %s%s", code, tail(stdout), stderr)
			}

			back := filepath.Join(dir, "back.pth")
			if code, _, stderr := run("revert", "-i", out, "-o", back); code != 0 {
				t.Fatalf("revert exit %d: %s", code, stderr)
			}
			rev := openPth(t, back)
			for _, k := range tc.keys {
				before, _ := src.Values(k)
				after, _ := rev.Values(k)
				if !slices.Equal(before, after) {
					t.Errorf("%s: revert does not give the input back", k)
				}
			}

			code, stdout, stderr = run("inspect", "--json", in)
			if code != 0 {
				t.Fatalf("inspect exit %d: %s", code, stderr)
			}
			var ins convert.Inspection
			if err := json.Unmarshal([]byte(stdout), &ins); err != nil {
				t.Fatal(err)
			}
			if len(ins.Aliases) != 1 || !slices.Equal(ins.Aliases[0].Keys, tc.keys) {
				t.Errorf("inspect aliases %+v, want %v", ins.Aliases, tc.keys)
			}
		})
	}
}

func openPth(t *testing.T, path string) *pth.Checkpoint {
	t.Helper()
	c, err := pth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func tail(s string) string {
	if len(s) > 600 {
		return s[len(s)-600:]
	}
	return s
}
