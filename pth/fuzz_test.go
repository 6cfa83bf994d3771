package pth

import (
	"archive/zip"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// Fuzz targets. .ci/fuzz.sh runs each for a bounded time; crashers the
// engine finds land in testdata/fuzz/<Target>/ and are replayed by every
// plain `go test` from then on.
//
//	go test ./pth -run '^$' -fuzz '^FuzzScanPickle$' -fuzztime 60s

// hangLimit is how long one fuzz input may take. The engine has no
// per-input timeout, so a slow input would only show as a stalled run;
// watchdog turns it into a crash, which the engine records as a crasher.
const hangLimit = 10 * time.Second

func watchdog() (stop func()) {
	timer := time.AfterFunc(hangLimit, func() {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		panic(fmt.Sprintf("one input took more than %v:\n%s", hangLimit, buf[:n]))
	})
	return func() { timer.Stop() }
}

// fuzzSeeds adds every committed checkpoint and pickle as a seed.
func fuzzSeeds(f *testing.F, pickles bool) {
	globs := []string{filepath.Join("testdata", "*.pth"), filepath.Join("testdata", "hostile", "*.pth")}
	if pickles {
		globs = append(globs, filepath.Join("testdata", "hostile", "*.pkl"))
	}
	for _, g := range globs {
		paths, _ := filepath.Glob(g)
		for _, p := range paths {
			b, err := os.ReadFile(p)
			if err != nil {
				f.Fatal(err)
			}
			if pickles && strings.HasSuffix(p, ".pth") {
				if pkl := dataPkl(b); pkl != nil {
					f.Add(pkl)
				}
				continue
			}
			f.Add(b)
		}
	}
}

// dataPkl extracts data.pkl from a zip checkpoint, nil for other files.
func dataPkl(b []byte) []byte {
	z, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
	if err != nil {
		return nil
	}
	for _, zf := range z.File {
		if strings.HasSuffix(zf.Name, "/data.pkl") {
			rc, err := zf.Open()
			if err != nil {
				return nil
			}
			defer rc.Close()
			pkl, _ := io.ReadAll(rc)
			return pkl
		}
	}
	return nil
}

// FuzzScanPickle feeds arbitrary bytes to the scanner and, when it accepts
// them, to the unpickler with storages resolved to fakes: neither may
// panic, the scanner must return a prefix of its input, and this
// package's own code must never hit the internal-error recovery. The
// scan of the bytes in memory (scanPickleBytes) must give what the scan
// through a reader gives, error included.
func FuzzScanPickle(f *testing.F) {
	fuzzSeeds(f, true)
	f.Fuzz(func(t *testing.T, data []byte) {
		defer watchdog()()
		res, err := scanPickle(bufio.NewReader(bytes.NewReader(data)), int64(len(data)))
		inMem := slices.Clone(data)
		resMem, errMem := scanPickleBytes(inMem)
		if fmt.Sprint(err) != fmt.Sprint(errMem) || !sameScan(res, resMem) {
			t.Fatalf("read through a reader: %v, %+v\nin memory: %v, %+v", err, res, errMem, resMem)
		}
		if err != nil {
			return
		}
		if !bytes.Equal(res.data, data[:len(res.data)]) {
			t.Fatal("scanned bytes are not a prefix of the input")
		}
		if len(refused(res.globals)) > 0 {
			return // Open never decodes these
		}
		u := unpickler{resolve: func(key string, dtype DType, numel int, loc string, class *Global) (*Storage, error) {
			st := &Storage{Key: key, DType: dtype, Numel: numel, Location: loc, Class: class}
			st.rec = record{name: "fake", size: 1 << 20}
			return st, st.checkSize()
		}}
		if _, err := u.load(res.data); errors.Is(err, errInternal) {
			t.Fatal(err)
		}
	})
}

// fuzzBase holds the records of a checkpoint but its data.pkl, which the
// fuzz targets supply (convbn_zip.pth for FuzzPickleInZip).
func fuzzBase(f *testing.F, path string) []zrec {
	b, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	z, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
	if err != nil {
		f.Fatal(err)
	}
	var recs []zrec
	for _, zf := range z.File {
		if strings.HasSuffix(zf.Name, "/data.pkl") {
			continue
		}
		rc, _ := zf.Open()
		data, _ := io.ReadAll(rc)
		rc.Close()
		name := "archive/" + zf.Name[strings.IndexByte(zf.Name, '/')+1:]
		recs = append(recs, zrec{name: name, data: data})
	}
	return recs
}

// FuzzPickleInZip puts an arbitrary data.pkl among real storage records
// and runs what a conversion runs: Open, decode every tensor of the tree,
// write it out, and read the output back.
func FuzzPickleInZip(f *testing.F) {
	fuzzSeeds(f, true)
	// Hand-written tensors over the base's storages: a view, a strided
	// view, an expanded one, a Parameter, and an optimizer-like nesting.
	view := pTensor("1", "FloatStorage", 2, 1, pints(1), pints(1))
	f.Add(pickle2(pOrdered(pu("a.weight"), view, pu("a.bias"), pTensor("1", "FloatStorage", 2, 0, pints(2, 1), pints(1, 2)))))
	f.Add(pickle2(pOrdered(pu("e"), pTensor("1", "FloatStorage", 2, 0, pints(5, 2), pints(0, 1)))))
	f.Add(pickle2(pOrdered(pu("p"), "ctorch._utils\n_rebuild_parameter\n("+view+"\x88ccollections\nOrderedDict\n)RtR")))
	f.Add(pickle2("}(" + pu("state_dict") + pOrdered(pu("m.w"), view) + pu("optimizer") + "}(" + pu("state") + "}" + pu("param_groups") + "](}(" + pu("params") + "]K\x00au" + "e" + "u" + "u"))
	base := fuzzBase(f, filepath.Join("testdata", "convbn_zip.pth"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, pkl []byte) {
		defer watchdog()()
		roundTrip(t, dir, withPickle(base, pkl))
	})
}

// withPickle is a zip checkpoint of base's records and data.pkl.
func withPickle(base []zrec, pkl []byte) []byte {
	recs := append([]zrec{{name: "archive/data.pkl", data: pkl}}, base...)
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, r := range recs {
		w, _ := zw.CreateHeader(&zip.FileHeader{Name: r.name, Method: zip.Store})
		w.Write(r.data)
	}
	zw.Close()
	return buf.Bytes()
}

// FuzzOpenModule is FuzzPickleInZip for whole pickled modules: an arbitrary
// data.pkl among the records of a pickled torchvision model goes through
// OpenModule, and the state dict it builds must write and read back.
func FuzzOpenModule(f *testing.F) {
	mods, _ := filepath.Glob(filepath.Join("..", "fixtures", "testdata", "formats4", "*_module.pth"))
	if len(mods) == 0 {
		f.Skip("no whole-module fixtures")
	}
	for _, p := range mods {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(dataPkl(b))
	}
	var base []zrec
	for _, p := range mods {
		base = append(base, fuzzBase(f, p)...) // storage keys differ between models
	}
	// Keep the largest record of each name, so that every model's storages
	// fit (records may be longer than their storage).
	largest := map[string]int{}
	var uniq []zrec
	for _, r := range base {
		i, ok := largest[r.name]
		switch {
		case !ok:
			largest[r.name] = len(uniq)
			uniq = append(uniq, r)
		case len(r.data) > len(uniq[i].data):
			uniq[i] = r
		}
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, pkl []byte) {
		defer watchdog()()
		in := filepath.Join(dir, "in.pth")
		if err := os.WriteFile(in, withPickle(uniq, pkl), 0o644); err != nil {
			t.Fatal(err)
		}
		c, _, err := OpenModule(in)
		if errors.Is(err, errInternal) {
			t.Fatal(err)
		}
		if err != nil {
			return
		}
		defer c.Close()
		var out bytes.Buffer
		if _, err := c.WriteTo(&out); err != nil {
			return
		}
		outPath := filepath.Join(dir, "out.pth")
		os.WriteFile(outPath, out.Bytes(), 0o644)
		c2, err := Open(outPath)
		if err != nil {
			t.Fatalf("the state dict written from a module does not open: %v", err)
		}
		defer c2.Close()
		if !reflect.DeepEqual(c2.Keys(), c.Keys()) {
			t.Fatalf("keys %q became %q", c.Keys(), c2.Keys())
		}
	})
}

// FuzzOpenWrite is roundTrip on arbitrary file bytes: the zip container,
// the legacy layout and the pickles all come from the fuzzer.
func FuzzOpenWrite(f *testing.F) {
	fuzzSeeds(f, false)
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		defer watchdog()()
		roundTrip(t, dir, data)
	})
}

// roundTrip opens data as a checkpoint; when that succeeds, every tensor of
// the tree is decoded, the checkpoint is written, and the written file must
// open again with the same state-dict keys and values. Scan must agree
// with Open on the globals. No step may panic or reach the internal-error
// recovery.
func roundTrip(t *testing.T, dir string, data []byte) {
	in := filepath.Join(dir, "in.pth")
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	globals, scanErr := Scan(in)
	c, err := Open(in)
	if errors.Is(err, errInternal) || errors.Is(scanErr, errInternal) {
		t.Fatal(err, scanErr)
	}
	if err != nil {
		return
	}
	defer c.Close()
	if scanErr != nil || !reflect.DeepEqual(globals, c.Globals) {
		t.Fatalf("Scan %q (%v) disagrees with Open %q", globals, scanErr, c.Globals)
	}
	values := map[string][]float64{}
	walkTensors(c.Root, map[any]bool{}, func(tn *Tensor) { c.TensorValues(tn) })
	for _, k := range c.Keys() {
		if v, err := c.Values(k); err == nil {
			values[k] = v
		}
	}
	var out bytes.Buffer
	if _, err := c.WriteTo(&out); err != nil {
		return // refusing to write (a record that fails its CRC) is fine
	}
	outPath := filepath.Join(dir, "out.pth")
	if err := os.WriteFile(outPath, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	c2, err := Open(outPath)
	if err != nil {
		t.Fatalf("the written checkpoint does not open: %v", err)
	}
	defer c2.Close()
	if !reflect.DeepEqual(c2.Keys(), c.Keys()) {
		t.Fatalf("keys %q became %q", c.Keys(), c2.Keys())
	}
	for k, v := range values {
		v2, err := c2.Values(k)
		if err != nil || !sameFloats(v, v2) {
			t.Fatalf("%s: %v became %v (%v)", k, v, v2, err)
		}
	}
}

// sameFloats compares values, counting NaN equal to NaN.
func sameFloats(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] && !(a[i] != a[i] && b[i] != b[i]) {
			return false
		}
	}
	return true
}

// sameScan reports whether two scans found the same: bytes, globals,
// events, memo, protocol, frames and duplicate key.
func sameScan(a, b scanned) bool {
	return bytes.Equal(a.data, b.data) && slices.Equal(a.globals, b.globals) && slices.Equal(a.events, b.events) &&
		a.memo == b.memo && a.protocol == b.protocol && a.frameReach == b.frameReach && fmt.Sprint(a.dupKey) == fmt.Sprint(b.dupKey)
}
