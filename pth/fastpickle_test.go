package pth

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// fakeStorages resolves every storage to one of 1 MiB, so that the tree
// does not depend on the archive around the pickle.
func fakeStorages(key string, dtype DType, numel int, loc string, class *Global) (*Storage, error) {
	st := &Storage{Key: key, DType: dtype, Numel: numel, Location: loc, Class: class}
	st.rec = record{name: "fake", size: 1 << 20}
	return st, st.checkSize()
}

// bothWays decodes a pickle the fast way and the general way (gopickle,
// then convertTree).
func bothWays(data []byte) (fast Value, ok bool, general Value, err error) {
	fu := unpickler{resolve: fakeStorages}
	fast, ok = fu.fastLoad(data)
	gu := unpickler{resolve: fakeStorages}
	raw, err := gu.run(data)
	if err == nil {
		general, err = convertTree(raw)
	}
	return fast, ok, general, err
}

// fixturePaths lists every checkpoint fixture torch wrote.
func fixturePaths(t *testing.T) []string {
	var paths []string
	for _, g := range []string{
		filepath.Join("testdata", "*.pth"),
		filepath.Join("..", "fixtures", "testdata", "*.pth"),
		filepath.Join("..", "fixtures", "testdata", "*", "*.pth"),
	} {
		p, _ := filepath.Glob(g)
		paths = append(paths, p...)
	}
	if len(paths) < 20 {
		t.Fatalf("found %d fixtures, expected the repository's (over 20)", len(paths))
	}
	return paths
}

// The fast decoder takes every state dict torch writes (the refused file
// aside, whose globals Open refuses before decoding) and builds the tree
// the general path builds, and an Open gives the same checkpoint both
// ways, legacy files (several pickles each) included.
func TestFastPickleSame(t *testing.T) {
	taken := 0
	for _, p := range fixturePaths(t) {
		name := p
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		// Whole pickled modules name classes only Open's module path
		// resolves; the refused file's globals are refused before decoding.
		general := !strings.HasSuffix(p, "_module.pth") && !strings.Contains(p, "refused")
		if pkl := dataPkl(b); pkl != nil && general {
			fast, ok, general, err := bothWays(pkl)
			switch {
			case err != nil:
				t.Errorf("%s: the general path fails: %v", name, err)
			case !ok:
				// Protocols 4 and 5 (FRAME, MEMOIZE), which torch.save
				// writes only when asked, are the general path's.
				if !strings.Contains(p, "proto4") && !strings.Contains(p, "proto5") {
					t.Errorf("%s: the fast decoder declines a torch-written state dict", name)
				}
			case !reflect.DeepEqual(fast, general):
				t.Errorf("%s: the fast decoder's tree differs from the general path's", name)
			default:
				taken++
			}
		}
		var roots [2]Value
		var errs [2]error
		for i, off := range []bool{false, true} {
			noFastPickle = off
			c, err := Open(p)
			noFastPickle = false
			if errs[i] = err; err == nil {
				roots[i] = c.Root
				c.Close()
			}
		}
		if (errs[0] == nil) != (errs[1] == nil) || (errs[0] != nil && errs[0].Error() != errs[1].Error()) {
			t.Errorf("%s: Open fails with %v fast, %v without", name, errs[0], errs[1])
		}
		if !reflect.DeepEqual(roots[0], roots[1]) {
			t.Errorf("%s: Open's tree differs between the two paths", name)
		}
	}
	if taken < 15 {
		t.Errorf("the fast decoder took %d fixtures' data.pkl, expected every state dict's (over 15)", taken)
	}
}

// Hand-made pickles the fast decoder must decline (the general path then
// decides), and small ones it must take as the general path does.
func TestFastPickleDeclines(t *testing.T) {
	view := pTensor("1", "FloatStorage", 2, 1, pints(1), pints(1))
	cases := []struct {
		name, pkl string
		take      bool
	}{
		{"state dict", pOrdered(pu("a.weight"), view), true},
		{"metadata", pOrdered(pu("a"), view) + "}(" + pu("_metadata") + pOrdered(pu(""), "}("+pu("version")+"K\x01u") + "ub", true},
		{"torch.Size", pOrdered(pu("s"), "ctorch\nSize\n(K\x02tR"), true},
		{"shared list", "](K\x01aq\x00(h\x00h\x00t", false},
		{"list in itself", "]q\x00h\x00a", false},
		{"dup key", "}(" + pu("k") + "K\x01" + pu("k") + "K\x02u", false},
		{"ordered dup key", pOrdered(pu("k"), "K\x01", pu("k"), "K\x02"), false},
		{"bare storage", "(" + pu("storage") + "ctorch\nFloatStorage\n" + pu("0") + pu("cpu") + "K\x01tQ", false},
		{"storage in a list", "](" + pu("storage") + "ctorch\nFloatStorage\n" + pu("0") + pu("cpu") + "K\x01tQa", false},
		{"empty setitems on a list", "](u", false},
		{"empty setitems on a tuple", ")(u", false},
		{"empty appends on a dict", "}(e", false},
		{"unknown opcode", "K\x01K\x02\x32", false}, // DUP
		{"long1 empty", "\x8a\x00", false},
		{"no stop", "K\x01", false},
		{"not allowlisted", "cos\nsystem\n(" + pu("x") + "tR", false},
		{"deep", strings.Repeat("(", 100) + strings.Repeat("t", 100), false},
	}
	for _, tc := range cases {
		data := []byte("\x80\x02" + tc.pkl + ".")
		if tc.name == "no stop" {
			data = data[:len(data)-1]
		}
		fast, ok, general, err := bothWays(data)
		if ok != tc.take {
			t.Errorf("%s: taken %v, want %v", tc.name, ok, tc.take)
		}
		if ok && (err != nil || !reflect.DeepEqual(fast, general)) {
			t.Errorf("%s: taken, but the general path gives %v (error %v), the fast one %v", tc.name, general, err, fast)
		}
	}
}

// FuzzFastPickle: on whatever passes the scan (as Open decodes nothing
// else), a tree the fast decoder builds is the general path's, which
// succeeds.
func FuzzFastPickle(f *testing.F) {
	fuzzSeeds(f, true)
	f.Fuzz(func(t *testing.T, data []byte) {
		defer watchdog()()
		res, err := scanPickle(bufio.NewReader(bytes.NewReader(data)), int64(len(data)))
		if err != nil || len(refused(res.globals)) > 0 || res.dupKey != nil {
			return
		}
		fast, ok, general, err := bothWays(res.data)
		if !ok {
			return
		}
		if err != nil {
			t.Fatalf("the fast decoder takes a pickle the general path refuses: %v", err)
		}
		if !reflect.DeepEqual(fast, general) {
			t.Fatal("the fast decoder's tree differs from the general path's")
		}
	})
}
