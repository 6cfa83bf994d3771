package arch

import (
	"fmt"
	"strings"
	"testing"
)

// rankAll is the ranking bestCandidate prunes: every suggested pair scored
// and sorted (most keys, then the shorter prefix, then suggestion order);
// the first is the best.
func rankAll(keys []string, family string) (candidate, bool) {
	seen := map[candidate]bool{}
	var out []candidate
	for _, fam := range families {
		if family != "" && fam != family {
			continue
		}
		for _, k := range keys {
			for _, a := range anchors[fam] {
				var p string
				switch {
				case k == a:
				case strings.HasSuffix(k, "."+a):
					p = k[:len(k)-len(a)]
				default:
					continue
				}
				c := candidate{family: fam, prefix: p}
				if seen[c] {
					continue
				}
				seen[c] = true
				c.score = score(keys, fam, p)
				out = append(out, c)
			}
		}
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && better(out[j], out[j-1]); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	if len(out) == 0 {
		return candidate{}, false
	}
	return out[0], true
}

// TestBestCandidate: the pruned search picks what scoring every pair picks,
// on every configuration's keys, under prefixes, mixed with another
// family's keys, and where pairs tie.
func TestBestCandidate(t *testing.T) {
	keysOf := func(c config, prefix string) []string {
		var ks []string
		for _, x := range c.tensors(1000) {
			ks = append(ks, prefix+x.key)
		}
		return ks
	}
	type tc struct {
		name string
		keys []string
	}
	var cases []tc
	for _, c := range configs {
		cases = append(cases,
			tc{c.name, keysOf(c, "")},
			tc{c.name + " under module.", keysOf(c, "module.")},
			tc{c.name + " under two prefixes", append(keysOf(c, "a."), keysOf(c, "b.")...)},
		)
	}
	rn50, _ := lookup("resnet50")
	dn121, _ := lookup("densenet121")
	cases = append(cases,
		tc{"resnet50 beside densenet121", append(keysOf(rn50, "x."), keysOf(dn121, "")...)},
		tc{"anchors only", []string{"conv1.weight", "fc.weight", "features.conv0.weight", "m.conv1.weight"}},
		tc{"tie: equal scores, equal prefix lengths", []string{"b.conv1.weight", "a.conv1.weight", "a.fc.weight", "b.fc.weight"}},
		tc{"tie: shorter prefix wins", []string{"long.conv1.weight", "s.conv1.weight", "s.fc.weight", "long.fc.weight"}},
		tc{"nothing", []string{"x.y", "z"}},
	)
	for _, c := range cases {
		for _, fam := range append([]string{""}, families...) {
			t.Run(fmt.Sprintf("%s/%q", c.name, fam), func(t *testing.T) {
				got, gotOK := bestCandidate(c.keys, fam)
				want, wantOK := rankAll(c.keys, fam)
				// The winner's score may be counted only as far as it
				// had to be to win.
				if got.score > want.score || (gotOK && got.score < 1 && want.score > 0) {
					t.Errorf("bestCandidate scored %+v, scoring every pair gives %+v", got, want)
				}
				got.score, want.score = 0, 0
				if got != want || gotOK != wantOK {
					t.Errorf("bestCandidate = %+v, %v; scoring every pair gives %+v, %v", got, gotOK, want, wantOK)
				}
			})
		}
	}
}

// TestInFeatures: the classifier width exactName checks first is the one
// the configuration's tensors list, for every configuration.
func TestInFeatures(t *testing.T) {
	for _, c := range configs {
		ts := c.tensors(10)
		var got []int
		for _, x := range ts {
			if x.key == classifierKey(c.family) {
				got = x.shape
			}
		}
		if len(got) != 2 || got[1] != c.inFeatures() {
			t.Errorf("%s: classifier %v in its tensors, inFeatures %d", c.name, got, c.inFeatures())
		}
	}
}
