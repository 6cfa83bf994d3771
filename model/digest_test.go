package model

import (
	"archive/zip"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"testing"
)

// TestDigests: the digests a conversion records are those their
// definitions give, written with fmt, on every .pth fixture (CRCs with
// leading zeros among them): the zip records' list taken while the
// checkpoint is opened as read again from the path, and the layout.
func TestDigests(t *testing.T) {
	paths, _ := filepath.Glob(testdata("*.pth"))
	more, _ := filepath.Glob(testdata("*", "*.pth"))
	paths = append(paths, more...)
	if len(paths) < 10 {
		t.Fatalf("%d fixtures", len(paths))
	}
	zeroPadded := false
	for _, p := range paths {
		m, err := Open(p)
		if err != nil {
			continue // refused fixtures
		}
		r, err := zip.OpenReader(p)
		if err != nil {
			m.Close()
			continue // legacy format
		}
		h := sha256.New()
		for _, f := range r.File {
			fmt.Fprintf(h, "%d:%s %d %08x\n", len(f.Name), f.Name, f.UncompressedSize64, f.CRC32)
			zeroPadded = zeroPadded || f.CRC32 < 1<<28
		}
		r.Close()
		want := hex.EncodeToString(h.Sum(nil))
		if d, err := DigestInput(p); err != nil || d.SHA256 != want || d.Method != DigestZipRecords {
			t.Errorf("%s: DigestInput %+v, %v; want %s", p, d, err, want)
		}
		if d, err := m.DigestInput(); err != nil || d.SHA256 != want || d.File != filepath.Base(p) {
			t.Errorf("%s: Model.DigestInput %+v, %v; want %s", p, d, err, want)
		}
		if m.Checkpoint != nil && m.Module == nil {
			if _, ok := m.Checkpoint.RecordsSHA256(); !ok {
				t.Errorf("%s: no records digest taken while opening", p)
			}
		}
		if m.Weights != nil {
			h := sha256.New()
			for _, k := range m.Weights.Keys() {
				s, _ := m.Weights.Shape(k)
				fmt.Fprintf(h, "%s %v\n", k, s)
			}
			if got, want := LayoutSHA256(m.Weights), hex.EncodeToString(h.Sum(nil)); got != want {
				t.Errorf("%s: LayoutSHA256 %s, want %s", p, got, want)
			}
		}
		m.Close()
	}
	if !zeroPadded {
		t.Error("no CRC below 0x10000000 among the fixtures: the zero padding is untested")
	}
}
