package rewrite

import (
	"os"
	"strings"
	"testing"
)

// The passes' tests check the graph after every pass (checkEachPass).
func TestMain(m *testing.M) {
	checkEachPass = true
	os.Exit(m.Run())
}

// TestBrokenGraphCaught: a pass that breaks the graph is named when every
// pass is checked, and a conversion that checks only the last one still
// refuses the result.
func TestBrokenGraphCaught(t *testing.T) {
	defer func(p []Pass) { Pipeline, checkEachPass = p, true }(Pipeline)
	broken := Pass{Name: "break", Run: func(st *State) error {
		st.g.Nodes[1].Name += "-renamed" // not in the name index any more
		return nil
	}}
	Pipeline = append(append(append([]Pass(nil), Pipeline[:1]...), broken), Pipeline[1:]...)
	for _, tc := range []struct {
		each bool
		want string
	}{{true, "after pass break:"}, {false, "after pass " + Pipeline[len(Pipeline)-1].Name + ":"}} {
		checkEachPass = tc.each
		b := convBNAct("", 0)
		_, err := Run(b.g, b.w, Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "missing from the name index") {
			t.Errorf("checkEachPass %v: err = %v, want one naming %q", tc.each, err, tc.want)
		}
	}
}
