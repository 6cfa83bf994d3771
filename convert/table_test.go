package convert

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

// TestTableLaidOutAhead: the table a conversion lays out while it
// finishes the output (Options.Table) is the one WriteTable writes
// otherwise, on fixtures with warnings and notes.
func TestTableLaidOutAhead(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		t.Run(name, func(t *testing.T) {
			var tables [2]string
			for i, ahead := range []bool{false, true} {
				out := filepath.Join(t.TempDir(), "out.pth")
				res, err := Run(Options{Input: fixture(name), Output: out, Table: ahead})
				if err != nil {
					t.Fatal(err)
				}
				if (res.body != nil) != ahead {
					t.Fatalf("Table %v: laid out ahead %v", ahead, res.body != nil)
				}
				res.Seconds = 0
				var b bytes.Buffer
				res.WriteTable(&b)
				tables[i] = strings.ReplaceAll(b.String(), out, "OUT")
			}
			if tables[0] != tables[1] {
				t.Errorf("laid out at the end:\n%s\nlaid out ahead:\n%s", tables[0], tables[1])
			}
			if !strings.Contains(tables[1], "wrote OUT in 0.00s") || len(tables[1]) < 200 {
				t.Errorf("table:\n%s", tables[1])
			}
		})
	}
}
