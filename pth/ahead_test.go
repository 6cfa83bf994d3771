package pth

import (
	"bytes"
	"compress/flate"
	"encoding/binary"
	"hash/crc32"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestPickleAheadUsed: on checkpoints torch wrote, the pickle scanned from
// the first record before the directory is read is the one kept.
func TestPickleAheadUsed(t *testing.T) {
	for _, name := range []string{"convbn_zip", "adam", "dtypes", "nested", "shared", "views", "rmsprop"} {
		t.Run(name, func(t *testing.T) {
			c := openFixture(t, name)
			ahead := c.pickleAhead()
			if ahead == nil {
				t.Fatal("pickleAhead found no pickle in the first record")
			}
			a, err := c.openZip()
			if err != nil {
				t.Fatal(err)
			}
			if !ahead.matches(a, a.record("data.pkl")) {
				t.Fatal("the pickle scanned ahead does not match the directory's data.pkl")
			}
			want, err := a.readPickle(nil)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(ahead.res.data, want.data) || !slices.Equal(ahead.res.globals, want.globals) || ahead.res.memo != want.memo {
				t.Error("the scan ahead differs from the scan of the record")
			}
			// Its size, which bounds the scan's buffers, from the
			// directory's first entry.
			if n, ok := c.pickleSize(ahead.name); !ok || n != int64(len(want.data)) {
				t.Errorf("pickleSize: %d, %v; want the pickle's %d bytes", n, ok, len(want.data))
			}
			if _, ok := c.pickleSize(ahead.name + "x"); ok {
				t.Error("pickleSize gave a size for a name the first entry does not have")
			}
		})
	}
}

// TestPickleAheadSameOutcome: Open gives the same checkpoint, or the same
// error, with the pickle scanned ahead of the directory and without, on
// archives where the scan ahead must be refused (and one where it is
// kept): every check the scan of the record makes must hold of it.
func TestPickleAheadSameOutcome(t *testing.T) {
	body := pOrdered(pu("a.weight"), pTensor("0", "FloatStorage", 8, 0, pints(8), pints(1)))
	pkl := pickle2(body)
	le64 := func(n int) string { return string(binary.LittleEndian.AppendUint64(nil, uint64(n))) }
	// Two frames, the first said to end past the record: the scan of the
	// record refuses it; a scan limited by the file alone would not.
	framed := []byte("\x80\x04\x95" + le64(400) + "\x95" + le64(len(body)+1) + body + ".")
	var deflated bytes.Buffer
	fw, _ := flate.NewWriter(&deflated, flate.BestCompression)
	fw.Write(pkl)
	fw.Close()
	rest := []zrec{{name: "archive/data/0", data: make([]byte, 32)}, {name: "archive/data/1", data: make([]byte, 400)}, {name: "archive/version", data: []byte("3\n")}}
	with := func(first ...zrec) []byte { return buildZip(t, append(first, rest...)...) }
	plain := with(zrec{name: "archive/data.pkl", data: pkl})
	badDesc := bytes.Clone(plain)
	if i := bytes.Index(badDesc, pkl); i < 0 || binary.LittleEndian.Uint32(badDesc[i+len(pkl):]) != 0x08074b50 {
		t.Fatal("no data descriptor after the pickle")
	} else {
		badDesc[i+len(pkl)+4] ^= 1
	}
	cases := []struct {
		name  string
		data  []byte
		taken bool // the scan ahead is kept
	}{
		{"as archive-zip writes it", plain, true},
		{"bytes after the STOP", with(zrec{name: "archive/data.pkl", data: append(bytes.Clone(pkl), "junk"...)}), false},
		{"bad CRC", with(zrec{name: "archive/data.pkl", data: pkl, raw: true, method: 0, usize: uint64(len(pkl)), crc: 1}), false},
		{"bad CRC in the data descriptor", badDesc, false},
		{"frame past the record", with(zrec{name: "archive/data.pkl", data: framed}), false},
		{"deflated", with(zrec{name: "archive/data.pkl", data: deflated.Bytes(), raw: true, method: 8, usize: uint64(len(pkl)), crc: crc32.ChecksumIEEE(pkl)}), false},
		{"not the first record", buildZip(t, rest[0], zrec{name: "archive/data.pkl", data: pkl}, rest[1], rest[2]), false},
		{"truncated pickle", with(zrec{name: "archive/data.pkl", data: pkl[:len(pkl)-1]}), false},
	}
	dir := t.TempDir()
	defer func(on bool, max int64) { scanAhead, readWholeMax = on, max }(scanAhead, readWholeMax)
	whole := readWholeMax
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, dir, strings.ReplaceAll(tc.name, " ", "_")+".pth", tc.data)
			// Without the scan ahead; with it, the pickle read whole
			// and scanned in memory; with it, scanned as it is read.
			var outcome [3]string
			for i, mode := range []struct {
				on    bool
				whole int64
			}{{false, whole}, {true, whole}, {true, 0}} {
				on := mode.on
				scanAhead, readWholeMax = on, mode.whole
				c, err := Open(path)
				if err != nil {
					outcome[i] = "error: " + err.Error()
					continue
				}
				outcome[i] = strings.Join(c.Keys(), ",") + " " + strings.Join(c.Globals, ",")
				if on {
					a, err := c.openZip()
					if err != nil {
						t.Fatal(err)
					}
					if got := c.pickleAhead().matches(a, a.record("data.pkl")); got != tc.taken {
						t.Errorf("scan ahead kept: %v, want %v", got, tc.taken)
					}
				}
				c.Close()
			}
			if outcome[0] != outcome[1] || outcome[0] != outcome[2] {
				t.Errorf("without the scan ahead: %s\nwith it, read whole: %s\nwith it, as read: %s", outcome[0], outcome[1], outcome[2])
			}
			t.Logf("%s: %s", filepath.Base(path), outcome[1])
		})
	}
}
