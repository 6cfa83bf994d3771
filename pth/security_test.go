package pth

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestReleaseVerdicts: hand-built pickles for each check torch's
// weights_only unpickler makes, with the verdicts real torch 1.13 and 2.6
// gave the same bytes (fixtures/weights_only.py check writes them as
// raw_NAME.pth and loads them in both): "" is accepted, otherwise the
// opcode or the start of the reason.
func TestReleaseVerdicts(t *testing.T) {
	cases := []struct {
		name, pickle string
		v113, v26    string
	}{
		{"protocol 2 dict", "\x80\x02}X\x01\x00\x00\x00aK\x01s.", "", ""},
		{"float", "\x80\x02}X\x01\x00\x00\x00aG?\xb9\x99\x99\x99\x99\x99\x9as.", "opcode BINFLOAT", ""},
		{"frame", "\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00K\x01.", "opcode FRAME", "opcode FRAME"},
		{"newobj odict", "\x80\x02ccollections\nOrderedDict\n)\x81.", "NEWOBJ of collections.OrderedDict", ""},
		{"newobj parameter", "\x80\x02ctorch.nn.parameter\nParameter\n)\x81.", "", ""},
		{"build dict", "\x80\x02}}b.", "BUILD on a value", "BUILD on a value"},
		{"build odict", "\x80\x02ccollections\nOrderedDict\n)R}b.", "", ""},
		{"build size", "\x80\x02ctorch\nSize\n)R}b.", "BUILD on the result of torch.Size", ""},
		{"append dict", "\x80\x02}K\x01a.", "APPEND to a value", "APPEND to a value"},
		{"reduce dict", "\x80\x02})R.", "REDUCE on a callable", "REDUCE on a callable"},
		{"short binunicode", "\x80\x02\x8c\x01a.", "opcode SHORT_BINUNICODE", "opcode SHORT_BINUNICODE"},
		{"stack global", "\x80\x02X\x0b\x00\x00\x00collectionsX\x0b\x00\x00\x00OrderedDict\x93)R.", "opcode STACK_GLOBAL", "opcode STACK_GLOBAL"},
		{"python 2 set", "\x80\x02c__builtin__\nset\n]R.", "global __builtin__.set", ""},
		{"empty set", "\x80\x02\x8f.", "", ""},
		{"additems", "\x80\x02\x8f(K\x01\x90.", "opcode ADDITEMS", "opcode ADDITEMS"},
		{"blocked module", "\x80\x02cos\nsystem\n.", "global os.system", "global os.system (module os is blocked)"},
		{"first reason wins", "\x80\x02cargparse\nNamespace\nG?\xf0\x00\x00\x00\x00\x00\x00\x86.", "global argparse.Namespace", "global argparse.Namespace"},
	}
	if len(Releases()) != 2 || Releases()[0].Torch != "1.13" || Releases()[1].Torch != "2.6" {
		t.Fatalf("releases %v, want 1.13 and 2.6", Releases())
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res, err := scanPickle(bufio.NewReader(bytes.NewReader([]byte(c.pickle))), int64(len(c.pickle)))
			if err != nil {
				t.Fatal(err)
			}
			a := &Audit{pickles: []auditedPickle{{"test", res.events}}}
			for i, want := range []string{c.v113, c.v26} {
				v := Releases()[i].Verdict(a)
				if v.Accepted != (want == "") || !bytes.HasPrefix([]byte(v.Reason), []byte(want)) {
					t.Errorf("torch %s: %+v, want %q", v.Torch, v, want)
				}
			}
		})
	}
}

// TestAuditFile: the committed checkpoints, zip and legacy, at protocol 2
// (accepted by both releases) and one that references argparse.Namespace.
func TestAuditFile(t *testing.T) {
	for _, c := range []struct {
		file     string
		format   Format
		protocol int
		accepted bool
	}{
		{"convbn_zip.pth", FormatZip, 2, true},
		{"convbn_legacy.pth", FormatLegacy, 2, true},
		{"refused.pth", FormatZip, 2, false},
	} {
		a, err := AuditFile(filepath.Join("testdata", c.file))
		if err != nil {
			t.Fatal(err)
		}
		if a.Format != c.format || a.Protocol != c.protocol || len(a.Globals) < 2 {
			t.Errorf("%s: %s protocol %d globals %v", c.file, a.Format, a.Protocol, a.Globals)
		}
		for _, r := range Releases() {
			if v := r.Verdict(a); v.Accepted != c.accepted {
				t.Errorf("%s: torch %s %+v", c.file, r.Torch, v)
			}
		}
	}
	if _, err := AuditFile(filepath.Join("testdata", "convbn_zip.json")); err == nil {
		t.Error("a JSON file audited without error")
	}
}

// TestAveragedModelCount: an AveragedModel state dict's n_averaged (0-dim
// integer, every other key under "module.") is carried, not a weight; the
// same key in any other layout stays a weight, so that the recogniser
// still reports it.
func TestAveragedModelCount(t *testing.T) {
	count := &Tensor{Shape: []int{}, Storage: &Storage{DType: Int64, Numel: 1}}
	float := &Tensor{Shape: []int{}, Storage: &Storage{DType: Float32, Numel: 1}}
	vec := &Tensor{Shape: []int{2}, Storage: &Storage{DType: Int64, Numel: 2}}
	w := &Tensor{Shape: []int{4}, Storage: &Storage{DType: Float32, Numel: 4}}
	for _, c := range []struct {
		name    string
		keys    []string
		count   *Tensor
		carried bool
	}{
		{"AveragedModel", []string{"n_averaged", "module.conv1.weight", "module.fc.weight"}, count, true},
		{"no module. prefix", []string{"n_averaged", "conv1.weight", "fc.weight"}, count, false},
		{"float count", []string{"n_averaged", "module.conv1.weight", "module.fc.weight"}, float, false},
		{"not 0-dim", []string{"n_averaged", "module.conv1.weight", "module.fc.weight"}, vec, false},
	} {
		d := NewDict(true)
		for _, k := range c.keys {
			v := w
			if k == "n_averaged" {
				v = c.count
			}
			if err := d.Set(k, v); err != nil {
				t.Fatal(err)
			}
		}
		ck := &Checkpoint{}
		ck.setState(d, []string{})
		carried := len(ck.Carried) == 1 && ck.Carried[0] == "n_averaged" && len(ck.Keys()) == 2
		if carried != c.carried {
			t.Errorf("%s: carried %v keys %v, want carried %v", c.name, ck.Carried, ck.Keys(), c.carried)
		}
		if c.carried && ck.Prefix != "module." {
			t.Errorf("%s: prefix %q, want module.", c.name, ck.Prefix)
		}
	}
}

// The scanner's memo keeps every index where GET finds it, whether
// picklers' dense numbering or a hand-made pickle's sparse one, and counts
// distinct indices for MEMOIZE.
func TestMemoTable(t *testing.T) {
	var m memoTable
	puts := []struct {
		i int
		s string
	}{{0, "a"}, {1, "b"}, {5, "f"}, {2, "c"}, {1, "B"}, {3, "d"}, {4, "e"}, {5, "F"}, {6, "g"}, {1 << 30, "z"}}
	want := map[int]string{}
	for _, p := range puts {
		m.put(p.i, sval{kind: 's', s: p.s})
		want[p.i] = p.s
		if m.n != len(want) {
			t.Fatalf("after put(%d): n = %d, want %d", p.i, m.n, len(want))
		}
	}
	for i := -1; i <= 8; i++ {
		v, ok := m.get(i)
		w, wok := want[i]
		if ok != wok || v.s != w {
			t.Errorf("get(%d) = %q, %v; want %q, %v", i, v.s, ok, w, wok)
		}
	}
	if v, ok := m.get(1 << 30); !ok || v.s != "z" {
		t.Errorf("get(1<<30) = %q, %v", v.s, ok)
	}
}

// TestAuditBarePickle: a pickle.dump under a .pth name is no checkpoint,
// but torch.load unpickles it (as a legacy checkpoint's magic number)
// before it can tell: the audit judges it, for protocol 0 (no PROTO
// opcode, not even a legacy layout) and 2 alike, instead of failing
// where the legacy layout's second pickle should start.
func TestAuditBarePickle(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, data string
		global     string
	}{
		{"proto2", "\x80\x02}q\x00X\x01\x00\x00\x00xq\x01cposix\nsystem\nq\x02X\x02\x00\x00\x00lsq\x03\x85q\x04Rq\x05s.", "posix.system"},
		{"proto0", "(dp0\nVx\np1\ncposix\nsystem\np2\n(Vls\np3\ntp4\nRp5\ns.", "posix.system"},
		{"plain", "\x80\x02}q\x00X\x01\x00\x00\x00xq\x01K\x01s.", ""},
	}
	for _, tc := range cases {
		p := filepath.Join(dir, tc.name+".pth")
		if err := os.WriteFile(p, []byte(tc.data), 0o644); err != nil {
			t.Fatal(err)
		}
		a, err := AuditFile(p)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if a.Stopped == "" {
			t.Errorf("%s: the audit does not say the file stops being a checkpoint", tc.name)
		}
		if tc.global != "" && !slices.Contains(a.Globals, tc.global) {
			t.Errorf("%s: globals %v, want %s among them", tc.name, a.Globals, tc.global)
		}
		for _, r := range Releases() {
			if v := r.Verdict(a); v.Accepted {
				t.Errorf("%s: torch %s accepts it; torch.load fails on it in every case", tc.name, r.Torch)
			}
		}
	}
}
