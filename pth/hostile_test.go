package pth

import (
	"archive/zip"
	"bufio"
	"bytes"
	"compress/flate"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/abnconvert/abnconvert/failure"
)

// A small assembler for hand-written protocol-2 pickles, so that each
// hostile input below reads as what it is.

func le32(n int) string { return string(binary.LittleEndian.AppendUint32(nil, uint32(n))) }

// pu is BINUNICODE.
func pu(s string) string { return "X" + le32(len(s)) + s }

// pi is the smallest integer opcode for n, as Python's pickler picks it.
func pi(n int64) string {
	switch {
	case n >= 0 && n < 256:
		return "K" + string(byte(n))
	case n >= 0 && n < 65536:
		return "M" + string(binary.LittleEndian.AppendUint16(nil, uint16(n)))
	case n >= -1<<31 && n < 1<<31:
		return "J" + le32(int(n))
	}
	return "\x8a\x08" + string(binary.LittleEndian.AppendUint64(nil, uint64(n)))
}

// ptuple is MARK items TUPLE.
func ptuple(items ...string) string { return "(" + strings.Join(items, "") + "t" }

func pints(ns ...int64) string {
	var items []string
	for _, n := range ns {
		items = append(items, pi(n))
	}
	return ptuple(items...)
}

// pOrdered is collections.OrderedDict() followed by SETITEMS of kv.
func pOrdered(kv ...string) string {
	return "ccollections\nOrderedDict\n)R(" + strings.Join(kv, "") + "u"
}

// pTensor is torch._utils._rebuild_tensor_v2 over a storage persistent id,
// as torch.save writes it.
func pTensor(key, class string, numel, offset int64, size, stride string) string {
	pid := ptuple(pu("storage"), "ctorch\n"+class+"\n", pu(key), pu("cpu"), pi(numel)) + "Q"
	return "ctorch._utils\n_rebuild_tensor_v2\n(" + pid + pi(offset) + size + stride + "\x89ccollections\nOrderedDict\n)Rt" + "R"
}

func pickle2(body string) []byte { return []byte("\x80\x02" + body + ".") }

// zrec is one record of a hand-built zip archive.
type zrec struct {
	name string
	data []byte
	// raw, when set, writes data as given (already compressed with method)
	// under a header declaring usize and crc.
	raw    bool
	method uint16
	usize  uint64
	crc    uint32
}

// buildZip writes records with archive/zip (stored unless raw says
// otherwise); pth must read archives that torch did not write too.
func buildZip(t testing.TB, recs ...zrec) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, r := range recs {
		if r.raw {
			w, err := zw.CreateRaw(&zip.FileHeader{Name: r.name, Method: r.method, CRC32: r.crc,
				CompressedSize64: uint64(len(r.data)), UncompressedSize64: r.usize})
			if err != nil {
				t.Fatal(err)
			}
			w.Write(r.data)
			continue
		}
		w, err := zw.CreateHeader(&zip.FileHeader{Name: r.name, Method: zip.Store})
		if err != nil {
			t.Fatal(err)
		}
		w.Write(r.data)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// ckptZip is a zip checkpoint around a hand-written data.pkl with float32
// storages "0" (8 elements) and "1" (2 elements).
func ckptZip(t testing.TB, pkl []byte) []byte {
	return buildZip(t,
		zrec{name: "archive/data.pkl", data: pkl},
		zrec{name: "archive/data/0", data: make([]byte, 32)},
		zrec{name: "archive/data/1", data: make([]byte, 8)},
		zrec{name: "archive/version", data: []byte("3\n")})
}

func writeTemp(t testing.TB, dir, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestHostilePickles: hand-written pickles that attack the reader. Each
// must fail with an error naming the file and the problem, quickly and
// without a large allocation (the test would run out of memory or time
// otherwise).
func TestHostilePickles(t *testing.T) {
	good := pTensor("0", "FloatStorage", 8, 0, pints(8), pints(1))
	deep := strings.Repeat("]", 100000) + strings.Repeat("a", 99999)
	// A tuple that holds the previous one twice, 64 levels deep: 2^64
	// leaves if expanded, 64 objects as stored.
	dag := pu("x") + "\x85"
	for i := 0; i < 64; i++ {
		dag += "q\x00h\x00\x86"
	}
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"valid control", ckptZip(t, pickle2(pOrdered(pu("a.weight"), good))), ""},
		{"duplicate key in state dict", ckptZip(t, pickle2(pOrdered(pu("a.weight"), good, pu("a.weight"), good))), `dict key "a.weight" is set twice`},
		{"duplicate key through the memo", ckptZip(t, pickle2(pOrdered(pu("a.weight")+"q\x05", good, "h\x05", good))), `"a.weight" is set twice`},
		{"duplicate key in a plain dict", ckptZip(t, pickle2("}("+pu("a.weight")+good+pi(1)+pi(2)+pi(1)+pi(3)+"u")), "dict key 1 is set twice"},
		{"duplicate key across SETITEM", ckptZip(t, pickle2("}"+pu("k")+pi(1)+"s"+pu("k")+pi(2)+"s")), `"k" is set twice`},
		{"negative dimension", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(-8), pints(1))))), "negative dimension"},
		{"negative dimension after an empty one", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(0, -3), pints(1, 1))))), "negative dimension"},
		{"negative stride", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 4, pints(2), pints(-1))))), "stride"},
		{"shape overruns storage", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(3, 3), pints(3, 1))))), "reaches element 8"},
		{"stride overruns storage", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(2), pints(8))))), "reaches element 8"},
		{"offset overruns storage", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 8, pints(1), pints(1))))), "reaches element 8"},
		{"numel overflows", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 1<<62, 0, pints(1<<40), pints(1))))), "fewer than 4611686018427387904 elements"},
		{"numel beyond record", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 9, 0, pints(9), pints(1))))), "holds 32 bytes"},
		{"unsupported storage class", ckptZip(t, pickle2(pOrdered(pu("a.weight"), pTensor("0", "QInt8Storage", 8, 0, pints(8), pints(1))))), "unsupported storage class torch.QInt8Storage"},
		{"huge BINUNICODE", ckptZip(t, []byte("\x80\x02X\xff\xff\xff\xff.")), "runs past the end"},
		{"huge BINBYTES8", ckptZip(t, []byte("\x80\x04\x8e\xff\xff\xff\xff\xff\x00\x00\x00.")), "runs past the end"},
		{"huge FRAME", ckptZip(t, []byte("\x80\x04\x95\x00\x00\x00\x00\x00\x01\x00\x00N.")), "FRAME"},
		{"FRAME past STOP", ckptZip(t, []byte("\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N.NNNN")), "FRAME"},
		{"huge LONG4", ckptZip(t, append([]byte("\x80\x02\x8b"+le32(1<<12+1)), make([]byte, 1<<12+2)...)), "integer of 4097 bytes"},
		{"huge LONG text", ckptZip(t, []byte("\x80\x02L"+strings.Repeat("9", 5000)+"L\n.")), "integer of 5001 digits"},
		{"memo index never stored", ckptZip(t, []byte("\x80\x02j\xff\xff\xff\xff.")), "memo entry 4294967295 was never stored"},
		{"negative PUT", ckptZip(t, []byte("\x80\x02Np-1\n.")), "memo index"},
		{"self-referencing list", ckptZip(t, []byte("\x80\x02]q\x00h\x00a.")), "cycle"},
		{"self-referencing dict", ckptZip(t, []byte("\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s.")), "cycle"},
		{"deeply nested lists", ckptZip(t, pickle2(deep)), "nested deeper than"},
		{"deeply nested marks", ckptZip(t, pickle2(strings.Repeat("(", 200000)+"N"+strings.Repeat("t", 200000))), "nested deeper than"},
		{"exponential tuple key", ckptZip(t, pickle2("}"+dag+pi(1)+"s")), "dict key tuple has more than"},
		{"stack underflow", ckptZip(t, []byte("\x80\x02a.")), "APPEND on an empty stack"},
		{"mark underflow", ckptZip(t, []byte("\x80\x02Nt.")), "without a MARK"},
		// Python pops within the frame MARK opened: what lies below the
		// mark is out of reach.
		{"pop across a MARK", ckptZip(t, []byte("\x80\x02N(\x85.")), "TUPLE1/2/3 on an empty stack"},
		{"STACK_GLOBAL through POP", ckptZip(t, []byte("\x80\x04"+"\x8c\x05posix"+"\x8c\x01x0"+"\x8c\x06system"+"\x93.")), "posix.system"},
		{"STACK_GLOBAL on non-strings", ckptZip(t, []byte("\x80\x04K\x01K\x02\x93.")), "<unresolved STACK_GLOBAL>"},
		{"STACK_GLOBAL of OrderedDict-like trick", ckptZip(t, []byte("\x80\x04\x8c\x08copy_reg\x94\x8c\x0e_reconstructor\x94\x93.")), "copyreg._reconstructor"},
		{"builtins.exec via INST", ckptZip(t, []byte("\x80\x02(X\x01\x00\x00\x001ibuiltins\nexec\n.")), "builtins.exec"},
		{"unknown opcode", ckptZip(t, []byte("\x80\x02\xfe.")), "unknown pickle opcode 0xfe"},
	}
	dir := t.TempDir()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, dir, strings.ReplaceAll(tc.name, " ", "_")+".pth", tc.data)
			start := time.Now()
			c, err := Open(path)
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("Open took %v", d)
			}
			if tc.want == "" {
				if err != nil {
					t.Fatalf("control input refused: %v", err)
				}
				c.Close()
				return
			}
			if err == nil {
				c.Close()
				t.Fatalf("Open succeeded, want an error containing %q", tc.want)
			}
			msg := err.Error()
			if !strings.Contains(msg, tc.want) || !strings.Contains(msg, path) || strings.Contains(msg, "\n") {
				t.Errorf("error %q, want one line naming %s and containing %q", msg, path, tc.want)
			}
			if errors.Is(err, errInternal) {
				t.Errorf("internal error: %v", err)
			}
		})
	}
}

// TestHostileArchives: zip containers that lie about their records.
func TestHostileArchives(t *testing.T) {
	pkl := pickle2(pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(8), pints(1))))
	var deflated bytes.Buffer
	fw, _ := flate.NewWriter(&deflated, flate.BestCompression)
	fw.Write(make([]byte, 32))
	fw.Close()
	zeros := crc32.ChecksumIEEE(make([]byte, 32))
	ver := zrec{name: "archive/version", data: []byte("3\n")}
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"zip bomb: deflated record declaring a terabyte", buildZip(t, zrec{name: "archive/data.pkl", data: pkl},
			zrec{name: "archive/data/0", data: deflated.Bytes(), raw: true, method: zip.Deflate, usize: 1 << 40, crc: zeros}, ver),
			"declares 1099511627776 bytes uncompressed"},
		{"deflated data.pkl declaring a gigabyte", buildZip(t, zrec{name: "archive/data.pkl", data: deflated.Bytes(), raw: true, method: zip.Deflate, usize: 1 << 30, crc: 0},
			zrec{name: "archive/data/0", data: make([]byte, 32)}, ver), "more than compression can expand"},
		{"stored record with two sizes", buildZip(t, zrec{name: "archive/data.pkl", data: pkl},
			zrec{name: "archive/data/0", data: make([]byte, 32), raw: true, method: zip.Store, usize: 1 << 20, crc: zeros}, ver),
			"is stored but declares 32 bytes compressed and 1048576 uncompressed"},
		{"missing data.pkl", buildZip(t, zrec{name: "archive/data/0", data: make([]byte, 32)}, ver), "no <folder>/data.pkl"},
		{"two data.pkl", buildZip(t, zrec{name: "a/data.pkl", data: pkl}, zrec{name: "b/data.pkl", data: pkl}, ver), "two data.pkl"},
		{"missing version", buildZip(t, zrec{name: "archive/data.pkl", data: pkl}, zrec{name: "archive/data/0", data: make([]byte, 32)}), "no archive/version record"},
		{"missing storage record", buildZip(t, zrec{name: "archive/data.pkl", data: pkl}, ver), `storage "0" has no record archive/data/0`},
		{"record shorter than its storage", buildZip(t, zrec{name: "archive/data.pkl", data: pkl}, zrec{name: "archive/data/0", data: make([]byte, 31)}, ver), "holds 31 bytes"},
		{"big-endian", buildZip(t, zrec{name: "archive/data.pkl", data: pkl}, zrec{name: "archive/data/0", data: make([]byte, 32)},
			zrec{name: "archive/byteorder", data: []byte("big")}, ver), `"big"-endian`},
		{"bad CRC of data.pkl", buildZip(t, zrec{name: "archive/data.pkl", data: pkl, raw: true, method: zip.Store, usize: uint64(len(pkl)), crc: 1},
			zrec{name: "archive/data/0", data: make([]byte, 32)}, ver), "CRC-32 mismatch"},
	}
	dir := t.TempDir()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, dir, strings.ReplaceAll(tc.name, " ", "_")+".pth", tc.data)
			c, err := Open(path)
			if err == nil {
				c.Close()
				t.Fatalf("Open succeeded, want an error containing %q", tc.want)
			}
			if msg := err.Error(); !strings.Contains(msg, tc.want) || !strings.Contains(msg, path) {
				t.Errorf("error %q, want one naming %s and containing %q", msg, path, tc.want)
			}
		})
	}
}

// TestStoredRecordPastEnd patches a real checkpoint's central directory
// so that a stored record claims a megabyte the file does not have.
func TestStoredRecordPastEnd(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "convbn_zip.pth"))
	if err != nil {
		t.Fatal(err)
	}
	patched := append([]byte{}, b...)
	found := false
	for off := 0; ; {
		i := bytes.Index(patched[off:], []byte("PK\x01\x02"))
		if i < 0 {
			break
		}
		h := off + i
		nameLen := int(binary.LittleEndian.Uint16(patched[h+28:]))
		if strings.HasSuffix(string(patched[h+46:h+46+nameLen]), "/data/0") {
			binary.LittleEndian.PutUint32(patched[h+20:], 1<<20) // compressed size
			binary.LittleEndian.PutUint32(patched[h+24:], 1<<20) // uncompressed size
			found = true
		}
		off = h + 4
	}
	if !found {
		t.Fatal("fixture has no data/0 record")
	}
	path := writeTemp(t, t.TempDir(), "past_end.pth", patched)
	if _, err := Open(path); err == nil || !strings.Contains(err.Error(), "past the end of the") {
		t.Errorf("Open: %v, want a record past the end of the file", err)
	}
}

// TestCorruptRecordValues: a storage record whose bytes no longer match its
// CRC-32 must not be decoded into values (a conversion would then write the
// corruption out as if it were real), and a second read fails as well.
func TestCorruptRecordValues(t *testing.T) {
	key := "1.running_var"
	c, in := openCorrupted(t, t.TempDir(), key, 0, []byte{0x00, 0x00, 0x80, 0xbf}) // -1.0
	for i := 0; i < 2; i++ {
		if v, err := c.Values(key); err == nil || !strings.Contains(err.Error(), "CRC-32") {
			t.Errorf("read %d: values %v, error %v; want a CRC-32 error", i, v, err)
		}
	}
	// A fresh Open of the corrupted file fails at the first read too.
	c2, err := Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := c2.Values(key); err == nil || !strings.Contains(err.Error(), "is corrupt") {
		t.Errorf("fresh open: %v, want a corrupt-record error", err)
	}
	// Untouched records still read.
	if _, err := c2.Values("1.weight"); err != nil {
		t.Errorf("intact record: %v", err)
	}
}

// TestExpandedTensorBound: a stride-0 tensor claiming many elements over a
// one-element storage is refused instead of being expanded in memory.
func TestExpandedTensorBound(t *testing.T) {
	pkl := pickle2(pOrdered(pu("a.weight"), pTensor("1", "FloatStorage", 2, 0, pints(1<<26), pints(0))))
	path := writeTemp(t, t.TempDir(), "expanded.pth", ckptZip(t, pkl))
	c, err := Open(path)
	if err != nil {
		t.Fatal(err) // legal: torch saves expanded tensors like this
	}
	defer c.Close()
	if _, err := c.Values("a.weight"); err == nil || !strings.Contains(err.Error(), "more than this package decodes") {
		t.Errorf("Values: %v, want a refusal", err)
	}
	small := pickle2(pOrdered(pu("a.weight"), pTensor("1", "FloatStorage", 2, 1, pints(5), pints(0))))
	path = writeTemp(t, t.TempDir(), "expanded_small.pth", ckptZip(t, small))
	c2, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if v, err := c2.Values("a.weight"); err != nil || len(v) != 5 {
		t.Errorf("a small expanded tensor: %v, %v", v, err)
	}
}

// TestSharedDictsFindState: dicts shared under many keys at every level
// (a DAG the pickle memo makes cheap) must not make the state-dict search
// walk every path: 200 keys a level, 5 levels, 200^5 paths, 6 dicts.
func TestSharedDictsFindState(t *testing.T) {
	body := "}q\x0a0" // the innermost dict, memo 10, popped
	for lvl := 9; lvl >= 5; lvl-- {
		body += "}q" + string(byte(lvl)) + "("
		for i := 0; i < 200; i++ {
			body += pu(fmt.Sprintf("k%d", i)) + "h" + string(byte(lvl+1))
		}
		body += "u0"
	}
	pkl := pickle2(body + "h\x05")
	path := writeTemp(t, t.TempDir(), "dag.pth", ckptZip(t, pkl))
	done := make(chan error, 1)
	go func() {
		c, err := Open(path)
		if err == nil {
			c.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Open of a shared-dict DAG did not finish in 10 s")
	}
}

// TestInjectedWriteFault: a write failing midway, as on a full disk or an
// I/O error, leaves neither the output nor a temporary file.
func TestInjectedWriteFault(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after int64
		err   error
		want  string
	}{
		{"disk full at once", 0, syscall.ENOSPC, "no space left on device"},
		{"disk full midway", 3000, syscall.ENOSPC, "no space left on device"},
		{"I/O error midway", 1500, syscall.EIO, "input/output error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c := openFixture(t, "convbn_zip")
			change(t, c, "1.weight")
			restore := InjectWriteFault(tc.after, tc.err)
			err := c.Write(filepath.Join(dir, "out.pth"), WriteOptions{})
			restore()
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, tc.err) {
				t.Errorf("Write: %v, want %q", err, tc.want)
			}
			assertOnly(t, dir)
			// Without the fault the same write succeeds.
			if err := c.Write(filepath.Join(dir, "out.pth"), WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			assertOnly(t, dir, "out.pth")
		})
	}
}

// corpusGlobals is what fixtures/hostile.py recorded with Python's own
// unpickler.
func corpusGlobals(t testing.TB) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "hostile", "globals.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string][]string
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestScanCorpus walks pickles Python wrote at every protocol: the scanner
// must accept each whole (no false refusal from its stack simulation, no
// duplicate key reported) and list exactly the globals Python's unpickler
// asked for, in the same order.
func TestScanCorpus(t *testing.T) {
	want := corpusGlobals(t)
	if len(want) < 48 {
		t.Fatalf("corpus has %d pickles; run fixtures/hostile.py", len(want))
	}
	for name, globals := range want {
		b, err := os.ReadFile(filepath.Join("testdata", "hostile", name))
		if err != nil {
			t.Fatal(err)
		}
		res, err := scanPickle(bufio.NewReader(bytes.NewReader(b)), int64(len(b)))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if res.dupKey != nil {
			t.Errorf("%s: %v", name, res.dupKey)
		}
		if !bytes.Equal(res.data, b) {
			t.Errorf("%s: scanned %d of %d bytes", name, len(res.data), len(b))
		}
		if globals == nil {
			globals = []string{}
		}
		got := append([]string{}, res.globals...)
		if !reflect.DeepEqual(got, globals) {
			t.Errorf("%s: globals %q, Python asked for %q", name, got, globals)
		}
	}
}

// TestEvilCheckpoints: checkpoints real torch.save wrote around an object
// whose __reduce__ calls os.system are refused by Open with the global
// named, and listed by Scan, in both formats and at protocols 2 and 4.
func TestEvilCheckpoints(t *testing.T) {
	for _, name := range []string{"evil_zip_p2.pth", "evil_zip_p4.pth", "evil_legacy.pth"} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join("testdata", "hostile", name)
			_, err := Open(path)
			var re *RefusedError
			if !errors.As(err, &re) || !reflect.DeepEqual(re.Refused, []string{"posix.system"}) {
				t.Fatalf("Open: %v, want posix.system refused", err)
			}
			globals, err := Scan(path)
			if err != nil || !contains(globals, "posix.system") || !contains(globals, "torch._utils._rebuild_tensor_v2") {
				t.Errorf("Scan: %q, %v", globals, err)
			}
		})
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestAllowedAgreesWithTorch asks real torch.load(weights_only=True) about
// every checkpoint of testdata: the files it loads must have only allowed
// globals (Allowed), the ones it refuses at least one refused global.
func TestAllowedAgreesWithTorch(t *testing.T) {
	needTorch(t)
	paths, _ := filepath.Glob(filepath.Join("testdata", "*.pth"))
	more, _ := filepath.Glob(filepath.Join("testdata", "hostile", "*.pth"))
	paths = append(paths, more...)
	sort.Strings(paths)
	script := `
import sys, torch
for p in sys.argv[1:]:
    try:
        torch.load(p, weights_only=True)
        print("ok")
    except Exception as e:
        m = str(e).split("Unsupported class ")
        print("refused " + m[1].split()[0] if len(m) > 1 else "other")
`
	out, err := exec.Command(python, append([]string{"-c", script}, paths...)...).Output()
	if err != nil {
		t.Fatal(err)
	}
	verdicts := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(verdicts) != len(paths) {
		t.Fatalf("%d verdicts for %d files", len(verdicts), len(paths))
	}
	refusedSome := false
	for i, p := range paths {
		globals, err := Scan(p)
		if err != nil {
			t.Errorf("%s: %v", p, err)
			continue
		}
		safe := true
		for _, g := range globals {
			safe = safe && Allowed(g)
		}
		switch v := verdicts[i]; {
		case v == "ok":
			if !safe {
				t.Errorf("%s: torch loads it with weights_only, but globals %q are not all allowed", p, globals)
			}
		case strings.HasPrefix(v, "refused "):
			refusedSome = true
			name := strings.TrimPrefix(v, "refused ")
			if !contains(globals, name) || Allowed(name) {
				t.Errorf("%s: torch refuses global %s; Scan lists %q, Allowed(%s) = %v", p, name, globals, name, Allowed(name))
			}
		default:
			// Refused for another reason (torch 1.13 refuses BINFLOAT, for
			// instance): says nothing about globals.
		}
	}
	if !refusedSome {
		t.Error("torch refused none of the files: the comparison proves nothing")
	}
}

// TestInterruptedWrite interrupts a write in progress with a real signal:
// a child process (this test binary) stalls its write after 3000 bytes,
// the test sends the signal, and the child must die of it having removed
// its temporary file, leaving the output directory empty.
func TestInterruptedWrite(t *testing.T) {
	if dir := os.Getenv("PTH_INTERRUPT_DIR"); dir != "" {
		c, err := Open(filepath.Join("testdata", "convbn_zip.pth"))
		if err != nil {
			t.Fatal(err)
		}
		InjectWriteFault(3000, nil)
		c.Write(filepath.Join(dir, "out.pth"), WriteOptions{})
		t.Fatal("the stalled write returned")
	}
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			dir := t.TempDir()
			cmd := exec.Command(os.Args[0], "-test.run=^TestInterruptedWrite$")
			cmd.Env = append(os.Environ(), "PTH_INTERRUPT_DIR="+dir)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(20 * time.Second)
			for {
				ents, _ := os.ReadDir(dir)
				if len(ents) == 1 {
					if fi, err := ents[0].Info(); err == nil && fi.Size() >= 3000 {
						break
					}
				}
				if time.Now().After(deadline) {
					cmd.Process.Kill()
					cmd.Wait()
					t.Fatalf("no stalled temporary file appeared; child said:\n%s", out.String())
				}
				time.Sleep(2 * time.Millisecond)
			}
			cmd.Process.Signal(sig)
			err := cmd.Wait()
			ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
			if !ok || !ws.Signaled() || ws.Signal() != sig {
				t.Errorf("child ended with %v (%v), want death by %v; it said:\n%s", err, cmd.ProcessState, sig, out.String())
			}
			assertOnly(t, dir)
		})
	}
}

// pModule is an instance of an allowlisted module class built as
// torch.save(model) pickles it: NEWOBJ, then BUILD with its __dict__.
func pModule(class string, children ...string) string {
	mod, name := class[:strings.LastIndexByte(class, '.')], class[strings.LastIndexByte(class, '.')+1:]
	return "c" + mod + "\n" + name + "\n)\x81}(" +
		pu("_parameters") + pOrdered() + pu("_buffers") + pOrdered() +
		pu("_modules") + pOrdered(children...) + pu("training") + "\x88ub"
}

// TestModuleDAG: a whole pickled module whose children share one module
// object at every level (30 names for the same child, 12 levels: 30^12
// paths, 13 objects) must be refused quickly, not expanded path by path;
// an attribute tuple that shares one tuple the same way must not be
// expanded either.
func TestModuleDAG(t *testing.T) {
	body := pModule("torch.nn.modules.activation.ReLU") + "q\x01"
	for lvl := 1; lvl <= 12; lvl++ {
		var kids []string
		for i := 0; i < 30; i++ {
			kids = append(kids, pu(fmt.Sprintf("m%d", i)), "h"+string(byte(lvl)))
		}
		body += "0" + pModule("torch.nn.modules.container.Sequential", kids...) + "q" + string(byte(lvl+1))
	}
	modules := ckptZip(t, pickle2(body))
	attr := "K\x01\x85q\x01"
	for lvl := 1; lvl <= 7; lvl++ { // 30^7 leaves, within plainAttr's depth bound
		attr += "0(" + strings.Repeat("h"+string(byte(lvl)), 30) + "tq" + string(byte(lvl+1))
	}
	attrs := ckptZip(t, pickle2(attr+"0"+"ctorch.nn.modules.activation\nReLU\n)\x81}("+pu("_parameters")+pOrdered()+pu("_buffers")+pOrdered()+
		pu("_modules")+pOrdered()+pu("shape")+"h\x08ub"))
	for name, data := range map[string][]byte{"shared children": modules, "shared attribute tuples": attrs} {
		t.Run(name, func(t *testing.T) {
			path := writeTemp(t, t.TempDir(), "m.pth", data)
			done := make(chan error, 1)
			go func() {
				c, _, err := OpenModule(path)
				if err == nil {
					c.Close()
				}
				done <- err
			}()
			select {
			case err := <-done:
				// Huge shared attributes are dropped (the IR needs none);
				// a huge module tree is refused.
				if name == "shared children" && (err == nil || !strings.Contains(err.Error(), "more than 65536 modules")) {
					t.Errorf("OpenModule: %v, want a refusal", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("OpenModule did not finish in 10 s")
			}
		})
	}
}

// TestInternalClass: a panic in this package's own tree conversion is an
// internal error (exit code 3), which FuzzConvert fails on; gopickle's
// panics on malformed pickles stay bad input.
func TestInternalClass(t *testing.T) {
	err := fmt.Errorf("x.pth: %w", fmt.Errorf("%w: %v", errInternal, "index out of range"))
	if failure.Of(err) != failure.Internal {
		t.Errorf("%v: class %v, want internal", err, failure.Of(err))
	}
	u := &unpickler{}
	if _, err := u.run([]byte("\x80\x02R.")); err == nil || failure.Of(err) != failure.BadInput {
		t.Errorf("gopickle on a bad pickle: %v, class %v, want bad input", err, failure.Of(err))
	}
}
