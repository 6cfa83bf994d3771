package safetensors

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
)

// FuzzOpen: no input makes Open, Values or Write panic or read outside the
// file; whatever Open accepts writes back and reopens with the same tensors.
func FuzzOpen(f *testing.F) {
	seed, _ := os.ReadFile(fixture("dtypes.safetensors"))
	f.Add(seed)
	hdr := `{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"__metadata__":{"k":"v"}}`
	f.Add(append(append(binary.LittleEndian.AppendUint64(nil, uint64(len(hdr))), hdr...), 1, 2, 3, 4))
	f.Add([]byte{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '})
	f.Fuzz(func(t *testing.T, b []byte) {
		dir := t.TempDir()
		p := filepath.Join(dir, "in.safetensors")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Skip()
		}
		sf, err := Open(p)
		if err != nil {
			return
		}
		defer sf.Close()
		for _, k := range sf.Keys() {
			sf.Values(k)
		}
		out := filepath.Join(dir, "out.safetensors")
		if err := sf.Write(out, WriteOptions{Force: true}); err != nil {
			t.Fatalf("an accepted file does not write back: %v", err)
		}
		back, err := Open(out)
		if err != nil {
			t.Fatalf("the written file does not reopen: %v", err)
		}
		defer back.Close()
		if len(back.Keys()) != len(sf.Keys()) {
			t.Fatalf("%d tensors written back, %d read", len(back.Keys()), len(sf.Keys()))
		}
		for _, k := range sf.Keys() {
			a, _ := sf.Raw(k)
			c, _ := back.Raw(k)
			if string(a) != string(c) {
				t.Fatalf("%q: bytes differ after writing", k)
			}
		}
	})
}
