package convert

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// TestAliasGroups: each group says which keys share a storage, which of
// them the conversion changes and why, and how the output holds them;
// inspect of a file no conversion ran on says only the first.
func TestAliasGroups(t *testing.T) {
	ck, err := pth.Open(filepath.Join("..", "fixtures", "testdata", "alias", "assigned.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	rep := &rewrite.Report{
		Flips:   map[string][]int{"layer1.0.conv1.weight": {1}, "layer1.0.conv2.weight": {3, 0, 2}},
		Changed: []string{"layer1.0.conv1.weight", "layer1.0.conv2.weight"},
		Sites:   []rewrite.Site{{Node: "layer1.0.bn1", FoldedInto: []string{"layer1.0.conv1"}}},
	}
	cases := []struct {
		name   string
		rep    *rewrite.Report
		copies bool
		want   []string
		not    []string
	}{
		{"converted", rep, false, []string{
			"layer1.0.conv1.weight, layer1.0.conv2.weight share storage",
			"(one tensor object)",
			"layer1.0.conv1.weight: its output channel 1 takes the sign of layer1.0.bn1's negative gamma;",
			"layer1.0.conv2.weight: its output channels 0, 2, 3 take a sign flip of the conversion",
			"each changed key is written to a storage of its own",
		}, nil},
		{"to safetensors", rep, true, []string{"written as a tensor per key"}, []string{"storage of its own"}},
		{"unchanged", &rewrite.Report{}, false, []string{"changes none of them: written sharing it, as read"}, []string{"its output"}},
		{"no conversion", nil, false, []string{"share storage"}, []string{"changes", "written"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			gs := aliasGroups(ck, tc.rep, tc.copies)
			if len(gs) != 1 {
				t.Fatalf("%d groups, want 1", len(gs))
			}
			text := gs[0].Text("assigned.pth")
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("%q lacks %q", text, w)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(text, w) {
					t.Errorf("%q has %q", text, w)
				}
			}
		})
	}
	if got := channelList([]int{9, 1, 8, 7, 6, 5, 4, 3, 2, 0}); got != "channels 0, 1, 2, 3, 4, 5, 6, 7, and 2 more" {
		t.Errorf("channelList: %q", got)
	}
}
