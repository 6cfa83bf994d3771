package command

import (
	"encoding/json"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestVerdictSaysWhatWasPreserved: a default conversion (--relu leaky)
// changes outputs by design, and its verdict says so in the verdict's line
// (how many sites, which activation, how far eval and a training step
// moved), in the text and in --json (exact false, approximations,
// verdict); an exact one (--relu abn) says none of that. Both exit 0.
func TestVerdictSaysWhatWasPreserved(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	dir := t.TempDir()
	for _, c := range []struct {
		relu  string
		exact bool
	}{{"leaky", false}, {"abn", true}} {
		out := filepath.Join(dir, c.relu+".pth")
		code, stdout, stderr := run("-i", fixture, "-o", out, "--relu", c.relu, "--verify")
		if code != 0 {
			t.Fatalf("--relu %s: exit %d: %s", c.relu, code, stderr)
		}
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		last := lines[len(lines)-1]
		approx := strings.Contains(last, "exact apart from the declared approximations")
		if !strings.HasPrefix(last, "PRESERVED") || approx == c.exact {
			t.Errorf("--relu %s: verdict %q", c.relu, last)
		}
		if !c.exact && !regexp.MustCompile(`\(12 ReLU site\(s\) now leaky_relu\(0\.01\) .*eval outputs move by max abs [0-9.e-]+ .*a training step's outputs by rel`).MatchString(last) {
			t.Errorf("--relu leaky: the verdict does not say what moved and how far: %q", last)
		}
		code, stdout, stderr = run("verify", "--original", fixture, "--converted", out, "--json", "-q")
		if code != 0 {
			t.Fatalf("verify --relu %s: exit %d: %s", c.relu, code, stderr)
		}
		var res struct {
			Exact          *bool  `json:"exact"`
			Approximations string `json:"approximations"`
			Verdict        string `json:"verdict"`
			Drift          *struct {
				Top1 *float64 `json:"top1_agreement"`
			} `json:"drift"`
		}
		if err := json.Unmarshal([]byte(stdout), &res); err != nil {
			t.Fatal(err)
		}
		if res.Exact == nil || *res.Exact != c.exact || (res.Approximations == "") != c.exact || res.Verdict != last {
			t.Errorf("--relu %s: JSON exact %v, approximations %q, verdict %q (text %q)", c.relu, res.Exact, res.Approximations, res.Verdict, last)
		}
		if !c.exact && (res.Drift == nil || res.Drift.Top1 == nil) {
			t.Errorf("--relu leaky: no top-1 agreement for a classifier's 2-D output: %s", stdout)
		}
	}
}

// TestInspectSummaryAgreesWithTable: the summary counts sites by outcome
// (one a site) and, on a line of its own, the channels the table's NEG,
// FOLDED, FLIPPED and TINY columns count: their totals are the columns'
// sums (a DenseNet under --relu leaky read "0 sign-folded, 0 sign-flipped"
// above non-zero FOLDED and FLIPPED columns).
func TestInspectSummaryAgreesWithTable(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	code, stdout, stderr := run("inspect", fixture)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	m := regexp.MustCompile(`channels \(the table's NEG, FOLDED, FLIPPED, TINY columns\), whatever the site's outcome: (\d+) negative, (\d+) sign-folded in (\d+) sites, (\d+) sign-flipped in (\d+) sites, (\d+) with tiny gamma`).FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("no channel summary:\n%s", stdout)
	}
	want := make([]int, 6)
	for i := range want {
		want[i], _ = strconv.Atoi(m[i+1])
	}
	// Sum the table's columns: NODE ACTIVATION OP OUTCOME NEG FOLDED FLIPPED TINY ...
	got := make([]int, 6)
	rows := 0
	inTable := false
	for _, line := range strings.Split(stdout, "\n") {
		cols := regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1)
		if len(cols) > 0 && cols[0] == "NODE" {
			inTable = true
			continue
		}
		if !inTable || len(cols) < 8 {
			inTable = inTable && line != ""
			continue
		}
		rows++
		n := func(s string) int { v, _ := strconv.Atoi(s); return v } // "-" is 0
		got[0] += n(cols[4])
		got[1] += n(cols[5])
		got[3] += n(cols[6])
		got[5] += n(cols[7])
		if n(cols[5]) > 0 {
			got[2]++
		}
		if n(cols[6]) > 0 {
			got[4]++
		}
	}
	if rows != 13 {
		t.Fatalf("read %d table rows, want 13:\n%s", rows, stdout)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("summary %v, table's columns %v", want, got)
			break
		}
	}
	if got[1] == 0 || got[3] == 0 {
		t.Errorf("the fixture no longer folds and flips channels (folded %d, flipped %d): the test checks nothing", got[1], got[3])
	}
}
