package pth

import (
	"archive/zip"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestProvenanceRecord: the record is written as archive/abnconvert.json,
// read back as written, dropped when cleared, and one that claims more
// than the bound is refused before it is read.
func TestProvenanceRecord(t *testing.T) {
	for _, name := range []string{"convbn_zip", "convbn_legacy"} {
		t.Run(name, func(t *testing.T) {
			c := openFixture(t, name)
			defer c.Close()
			if c.Provenance != nil {
				t.Fatalf("a torch-written file has a record: %q", c.Provenance)
			}
			dir := t.TempDir()
			rec := []byte(`{"tool":"abnconvert"}`)
			c.Provenance = rec
			with := filepath.Join(dir, "with.pth")
			if err := c.Write(with, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(with)
			if err != nil {
				t.Fatal(err)
			}
			z, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, f := range z.File {
				names = append(names, f.Name)
			}
			if !strings.Contains(strings.Join(names, " "), "archive/"+ProvenanceRecord+" archive/version") {
				t.Errorf("records %v", names)
			}
			back, err := Open(with)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Provenance, rec) {
				t.Errorf("read back %q", back.Provenance)
			}
			// Written again with the record cleared: none.
			back.Provenance = nil
			without := filepath.Join(dir, "without.pth")
			if err := back.Write(without, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			back.Close()
			again, err := Open(without)
			if err != nil {
				t.Fatal(err)
			}
			defer again.Close()
			if again.Provenance != nil {
				t.Errorf("a cleared record came back: %q", again.Provenance)
			}
		})
	}
	// A record declaring more than the bound: refused with its name.
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, r := range []struct {
		name string
		data []byte
	}{{"archive/data.pkl", []byte("\x80\x02}q\x00.")}, {"archive/version", []byte("3\n")}} {
		w, _ := zw.Create(r.name)
		w.Write(r.data)
	}
	w, _ := zw.CreateRaw(&zip.FileHeader{Name: "archive/" + ProvenanceRecord, Method: zip.Deflate, CompressedSize64: 1 << 20, UncompressedSize64: 1 << 30})
	w.Write(make([]byte, 1<<20))
	zw.Close()
	p := filepath.Join(t.TempDir(), "big.pth")
	os.WriteFile(p, buf.Bytes(), 0o644)
	if _, err := Open(p); err == nil || !strings.Contains(err.Error(), "abnconvert.json is 1073741824 bytes") {
		t.Errorf("oversized record: %v", err)
	}
}
