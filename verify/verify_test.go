package verify

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/model"
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

var fixtureNames = []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg", "tiny_resnet_nested"}

// seeds are the seeds every fixture must verify at; -short keeps seed 0.
func seeds() []uint64 {
	if testing.Short() {
		return []uint64{0}
	}
	return []uint64{0, 1, 2, 3, 4}
}

// TestPreserved: every committed fixture, under both policies, verifies at
// seeds 0 to 4; every check is counted once, as passed, failed or skipped.
func TestPreserved(t *testing.T) {
	for _, name := range fixtureNames {
		for _, relu := range []string{"leaky", "abn"} {
			t.Run(name+"/"+relu, func(t *testing.T) {
				conv := converted(t, name, relu)
				for _, seed := range seeds() {
					res, err := Run(Options{Original: fixture(name), Converted: conv, ReLU: relu, Size: 32, Seed: seed})
					if err != nil {
						t.Fatal(err)
					}
					if !res.Preserved {
						t.Fatalf("seed %d: not preserved: %v\n%+v", seed, res.Failed, res.Checks)
					}
					checkCounts(t, res)
					if relu == "leaky" && (res.Drift == nil || res.Drift.Sites == 0) {
						t.Errorf("no drift reported under --relu leaky")
					}
					if relu == "abn" && res.Drift != nil && res.Drift.Sites != 0 {
						t.Errorf("drift of %d approximated sites under --relu abn", res.Drift.Sites)
					}
					grads := 0
					for _, c := range res.Checks {
						if strings.HasPrefix(c.Name, "gradient ") && !c.Skipped {
							grads++
						}
					}
					if grads == 0 {
						t.Error("no parameter gradient compared")
					}
				}
			})
		}
	}
}

// checkCounts: the result counts each check once, a skipped check is not a
// pass and carries its reason, and every judged training check has a limit
// below 1 derived from its noise.
func checkCounts(t *testing.T, res *Result) {
	t.Helper()
	passed, failed, skipped := 0, 0, 0
	for _, c := range res.Checks {
		switch {
		case c.Skipped:
			skipped++
			if c.Pass || c.Reason == "" {
				t.Errorf("%s: skipped, pass %v, reason %q", c.Name, c.Pass, c.Reason)
			}
		case c.Pass:
			passed++
		default:
			failed++
		}
		if c.Metric == "l2" && !c.Skipped && (c.Limit >= 1 || c.Limit != 25*math.Max(c.Noise, roundoff)) {
			t.Errorf("%s: limit %g from noise %g", c.Name, c.Limit, c.Noise)
		}
	}
	if passed != res.Passed || failed != len(res.Failed) || skipped != len(res.Skipped) {
		t.Errorf("counted %d passed, %d failed, %d skipped; the result says %d, %v, %v", passed, failed, skipped, res.Passed, res.Failed, res.Skipped)
	}
}

// TestZeroGradientSkipped: VGG's convolutions have biases, each read only
// by a training-mode BN, so their true gradient is zero and their computed
// ones are rounding noise about 100% apart: skipped, with the reason, and
// never counted as passes.
func TestZeroGradientSkipped(t *testing.T) {
	res, err := Run(Options{Original: fixture("tiny_vgg"), Converted: converted(t, "tiny_vgg", "leaky"), Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"gradient features.0.bias": true, "gradient features.4.bias": true, "gradient features.8.bias": true, "gradient features.11.bias": true}
	for _, c := range res.Checks {
		if want[c.Name] != c.Skipped {
			t.Errorf("%s: skipped %v (%s)", c.Name, c.Skipped, c.Reason)
		}
		if c.Skipped && !strings.Contains(c.Reason, "true value zero") {
			t.Errorf("%s: reason %q", c.Name, c.Reason)
		}
	}
	if len(res.Skipped) != len(want) {
		t.Errorf("skipped %v", res.Skipped)
	}
}

// TestTrainCheck: how one training-mode comparison is judged.
func TestTrainCheck(t *testing.T) {
	opt := Options{TrainFactor: 25}
	ref := []float32{1, -2, 3, 4}
	near := []float32{1, -2, 3, 4.00001}
	far := []float32{1.01, -2.02, 3.03, 4.04}
	cases := []struct {
		name      string
		got, want []float32
		noise     float64
		zero      string
		pass      bool
		skip      string // a word of the reason
	}{
		{"within its noise", near, ref, 1e-6, "", true, ""},
		{"1% off, noise 1e-6", far, ref, 1e-6, "", false, ""},
		{"1% off, noise 1e-3", far, ref, 1e-3, "", true, ""},
		{"no noise: one rounding is the floor", near, ref, 0, "", false, ""},
		{"exact, no noise", ref, ref, 0, "", true, ""},
		{"true value zero", far, ref, 1e-6, "true value zero: a bias before a BN", false, "bias"},
		{"reference exactly zero", near, make([]float32, 4), 1e-6, "", false, "exactly zero"},
		{"limit would pass a zero result", make([]float32, 4), ref, 0.05, "", false, "below its float32 noise"},
		{"NaN is never skipped", []float32{1, float32(math.NaN()), 3, 4}, ref, 0.05, "zero", false, ""},
		{"length differs", ref[:3], ref, 1e-6, "", false, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := trainCheck(opt, "x", c.got, c.want, nil, c.noise, c.zero)
			if got.Pass != c.pass || got.Skipped != (c.skip != "") || !strings.Contains(got.Reason, c.skip) {
				t.Errorf("pass %v skipped %v (%q), rel %g limit %g; want pass %v, skip %q", got.Pass, got.Skipped, got.Reason, got.Rel, got.Limit, c.pass, c.skip)
			}
		})
	}
}

// restate writes src's state dict as a new .pth: every key renamed by
// rename, every float32 tensor stored as dtype ("" keeps float32).
func restate(t *testing.T, src string, rename func(string) string, dtype pth.DType) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := filepath.Join(t.TempDir(), filepath.Base(src))
	nc := pth.NewStateDict(out)
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		dt := pth.DType(ck.DType(k))
		if dt == pth.Float32 && dtype != "" {
			dt = dtype
		}
		if err := nc.AddTensor(rename(k), dt, shape, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

func same(k string) string { return k }

// TestKeyNames: the same weights under `module.` keys and under plain keys
// give the same verdict at seeds 0 to 4, figure for figure (the
// perturbation that measures noise is drawn from graph order, not from key
// names). VGG's dropout masks are drawn from node names, which carry the
// prefix: there the verdict and the skipped checks must agree.
func TestKeyNames(t *testing.T) {
	for name, relu := range map[string]string{"tiny_resnet_basic": "leaky", "tiny_densenet": "abn", "tiny_vgg": "abn"} {
		t.Run(name, func(t *testing.T) {
			plain := fixture(name)
			prefixed := restate(t, plain, func(k string) string { return "module." + k }, "")
			cPlain, cPrefixed := converted(t, name, relu), filepath.Join(t.TempDir(), "prefixed_"+relu+".pth")
			if _, err := convert.Run(convert.Options{Input: prefixed, Output: cPrefixed, ReLU: relu}); err != nil {
				t.Fatal(err)
			}
			for _, seed := range seeds() {
				a, err := Run(Options{Original: plain, Converted: cPlain, ReLU: relu, Size: 32, Seed: seed})
				if err != nil {
					t.Fatal(err)
				}
				b, err := Run(Options{Original: prefixed, Converted: cPrefixed, ReLU: relu, Size: 32, Seed: seed})
				if err != nil {
					t.Fatal(err)
				}
				if !a.Preserved || !b.Preserved || len(a.Checks) != len(b.Checks) || len(a.Skipped) != len(b.Skipped) {
					t.Fatalf("%s seed %d: preserved %v (%v skipped) with plain keys, %v (%v skipped) with module. keys", relu, seed, a.Preserved, a.Skipped, b.Preserved, b.Skipped)
				}
				for i, ca := range a.Checks {
					cb := b.Checks[i]
					differ := strings.Replace(cb.Name, "module.", "", 1) != ca.Name || ca.Skipped != cb.Skipped ||
						(name != "tiny_vgg" && (ca.Rel != cb.Rel || ca.Limit != cb.Limit))
					if differ {
						t.Errorf("%s seed %d: %s rel %g limit %g, %s rel %g limit %g", relu, seed, ca.Name, ca.Rel, ca.Limit, cb.Name, cb.Rel, cb.Limit)
					}
				}
			}
		})
	}
}

// TestHalfPrecision: bfloat16 and float16 checkpoints verify at seeds 0 to
// 4 (|gamma| - eps rounds back to |gamma| in half precision, which the noise
// of a reference whose BN weights move by that rounding covers), and what
// the format can hold is still checked: a conv weight moved fails.
func TestHalfPrecision(t *testing.T) {
	for _, name := range []string{"tiny_resnext", "tiny_densenet"} {
		for _, dt := range []pth.DType{pth.BFloat16, pth.Float16} {
			t.Run(name+"/"+string(dt), func(t *testing.T) {
				orig := restate(t, fixture(name), same, dt)
				conv := filepath.Join(t.TempDir(), "abn.pth")
				if _, err := convert.Run(convert.Options{Input: orig, Output: conv}); err != nil {
					t.Fatal(err)
				}
				for _, seed := range seeds() {
					res, err := Run(Options{Original: orig, Converted: conv, Size: 32, Seed: seed})
					if err != nil {
						t.Fatal(err)
					}
					if !res.Preserved {
						t.Fatalf("seed %d: not preserved: %v", seed, res.Failed)
					}
					checkCounts(t, res)
					if seed == 0 {
						t.Logf("eval rel %.2e, limit %.2e; %d checks passed, %d skipped", res.Checks[0].Rel, res.Checks[0].Limit, res.Passed, len(res.Skipped))
					}
				}
				var key string
				if name == "tiny_resnext" {
					key = "layer2.0.conv2.weight"
				} else {
					key = "features.denseblock1.denselayer1.conv1.weight"
				}
				bad := rewriteKey(t, conv, key, func(v []float64) { v[7] += 0.05 })
				res, err := Run(Options{Original: orig, Converted: bad, Size: 32})
				if err != nil {
					t.Fatal(err)
				}
				if res.Preserved {
					t.Errorf("a conv weight moved by 0.05 passed (eval rel %.2e, limit %.2e)", res.Checks[0].Rel, res.Checks[0].Limit)
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

// withRecord is a copy of a converted checkpoint whose provenance record
// edit has changed (an older abnconvert's record, say).
func withRecord(t *testing.T, src string, edit func(*model.Provenance)) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	p, err := model.DecodeProvenance(ck.Provenance)
	if err != nil {
		t.Fatal(err)
	}
	edit(p)
	if ck.Provenance, err = p.Encode(); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "edited.pth")
	if err := ck.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTinyGammaPolicy: tiny_resnext has one in-place site (under --relu
// leaky) with two channels at |gamma| < eps. Each policy verifies from its
// record; approx reports its tiny channels and the training step's drift;
// a record from before --tiny-gamma (no field) and a file without a record
// are verified as approx, which is what they hold; a contradicting flag is
// refused.
func TestTinyGammaPolicy(t *testing.T) {
	orig := fixture("tiny_resnext")
	conv := map[string]string{}
	for _, tiny := range []string{"exact", "approx"} {
		out := filepath.Join(t.TempDir(), tiny+".pth")
		if _, err := convert.Run(convert.Options{Input: orig, Output: out, TinyGamma: tiny}); err != nil {
			t.Fatal(err)
		}
		conv[tiny] = out
		res, err := Run(Options{Original: orig, Converted: out, Size: 32})
		if err != nil {
			t.Fatal(err)
		}
		d := res.Drift
		if !res.Preserved || !strings.Contains(res.FlagsFrom, "--tiny-gamma "+tiny) || d == nil || d.Train == nil {
			t.Fatalf("%s: preserved %v (failed %v), flags from %q, drift %+v", tiny, res.Preserved, res.Failed, res.FlagsFrom, d)
		}
		wantTiny := map[string]int{"exact": 0, "approx": 2}[tiny]
		tr := d.Train
		if d.TinyGamma != wantTiny || !(tr.Output.Rel > 0 && tr.Output.L2 > 0 && tr.InputGradient.Rel > 0) ||
			tr.RunningStats == nil || !(tr.RunningStats.Rel > 0) || !strings.Contains(tr.RunningStats.Name, "running_") {
			t.Errorf("%s: drift %+v, train %+v %+v", tiny, d, tr, tr.RunningStats)
		}
	}
	// Under --relu abn nothing is approximated: no drift at all.
	if res, err := Run(Options{Original: orig, Converted: converted(t, "tiny_resnext", "abn"), Size: 32}); err != nil || !res.Preserved || res.Drift != nil {
		t.Errorf("--relu abn: %v %+v", err, res)
	}

	old := func(p *model.Provenance) { p.TinyGamma = "" }
	for _, c := range []struct {
		name, file, flag string
		preserved        bool
	}{
		{"old record of an approx conversion", withRecord(t, conv["approx"], old), "", true},
		// The same record on a file converted exactly is a lie the
		// checks catch.
		{"old record on an exact conversion", withRecord(t, conv["exact"], old), "", false},
		{"no record, approx conversion", withoutRecord(t, conv["approx"]), "", true},
		{"no record, exact conversion", withoutRecord(t, conv["exact"]), "", false},
		{"no record, exact conversion, flag given", withoutRecord(t, conv["exact"]), "exact", true},
	} {
		res, err := Run(Options{Original: orig, Converted: c.file, TinyGamma: c.flag, Size: 32})
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if res.Preserved != c.preserved {
			t.Errorf("%s: preserved %v, want %v (failed %v)", c.name, res.Preserved, c.preserved, res.Failed)
		}
	}
	for _, c := range []struct{ file, flag, rec string }{
		{conv["approx"], "exact", "--tiny-gamma approx"},
		{conv["exact"], "approx", "--tiny-gamma exact"},
		{withRecord(t, conv["approx"], old), "exact", "older than the flag"},
	} {
		_, err := Run(Options{Original: orig, Converted: c.file, TinyGamma: c.flag, Size: 32})
		if err == nil || !strings.Contains(err.Error(), "--tiny-gamma "+c.flag+" contradicts") || !strings.Contains(err.Error(), c.rec) {
			t.Errorf("--tiny-gamma %s on a %s record: %v", c.flag, c.rec, err)
		}
	}
}
