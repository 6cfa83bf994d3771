package command

import (
	"fmt"
	"io"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/verify"
)

func probeFlag() cli.Flag {
	return &cli.StringFlag{Name: "probe", Usage: "a probe python/abnexport.py recorded from your model (PREFIX.probe.pth): the rebuild of the original is first compared with what PyTorch computed on it (eval, one training step, eval again); a difference fails the verdict (on convert it implies --verify)"}
}

// writeProbe prints the comparison of the rebuild of the original with the
// probe: each output check on its line, the running statistics counted
// (their failures named), then the likely cause of a failure.
func writeProbe(w io.Writer, r *verify.Result) {
	p := r.Probe
	if p == nil {
		return
	}
	random := ""
	if p.RandomLayersEval > 0 {
		random = fmt.Sprintf(", %d Dropout/StochasticDepth layers in eval mode during the step on both sides", p.RandomLayersEval)
	}
	fmt.Fprintf(w, "  the original as abnconvert rebuilt it (%s) against what PyTorch computed on your model (%s, input %v%s):\n", r.Arch, p.File, p.Input, random)
	stats, statFail, statSkip := 0, 0, 0
	skipReason := ""
	const shown = 5 // failing running statistics printed; --json has all
	for _, c := range p.Checks {
		mark := "ok  "
		if !c.Pass {
			mark = "FAIL"
		}
		if strings.HasPrefix(c.Name, "running ") {
			stats++
			if c.Skipped {
				statSkip++
				skipReason = c.Reason
				continue
			}
			if c.Pass {
				continue
			}
			if statFail++; statFail > shown {
				continue
			}
		}
		fmt.Fprintf(w, "  %s probe: %-41s rel %.2e (limit %.2e, %s) %s\n", mark, c.Name, c.Rel, c.Limit, c.Metric, c.Note)
	}
	more := ""
	if statFail > shown {
		more = fmt.Sprintf(" (%d not listed: --json has every check)", statFail-shown)
	}
	if statSkip > 0 {
		more += fmt.Sprintf(", %d skipped: %s", statSkip, skipReason)
	}
	fmt.Fprintf(w, "  probe: %d running statistics compared: %d passed, %d failed%s\n", stats, stats-statFail-statSkip, statFail, more)
}

// verdict is the verdict's last line. Its first words say what kind of
// success it is: PRESERVED means the outputs are the original's (up to
// float rounding); CONVERTED AS SPECIFIED means the conversion declared
// approximations (--relu leaky, the default, changes outputs by design;
// --tiny-gamma approx) and is exact apart from them, with how far they
// moved the outputs, so that no one reads "outputs unchanged" into it.
// Both exit 0; NOT PRESERVED exits 1.
func verdict(r *verify.Result, skipped string) string {
	head, promised := "PRESERVED", "the converted checkpoint computes what the conversion promised"
	if !r.Exact {
		head = "CONVERTED AS SPECIFIED"
		promised = fmt.Sprintf("outputs changed on purpose by the declared approximations, and only by them (%s)", r.Approximations)
	}
	switch {
	case !r.Preserved && r.Probe != nil && r.Probe.Cause != "":
		return fmt.Sprintf("NOT PRESERVED: %d check(s) failed: %s\n%s", len(r.Failed), summarize(r.Failed, 8), r.Probe.Cause)
	case !r.Preserved:
		return fmt.Sprintf("NOT PRESERVED: %d check(s) failed: %s", len(r.Failed), strings.Join(r.Failed, ", "))
	case r.Conditional:
		return fmt.Sprintf("%s, assuming %s: %s; a network modified in ways that keep keys and shapes would pass too; record a probe with python/abnexport.py and pass --probe%s", head, r.Assumption, promised, skipped)
	case r.Probe != nil:
		return fmt.Sprintf("%s: %s, and the original's rebuild computes what PyTorch computed on your model%s", head, promised, skipped)
	}
	return fmt.Sprintf("%s: %s%s", head, promised, skipped)
}

// summarize joins the first n names and counts the rest.
func summarize(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:n], ", ") + fmt.Sprintf(" and %d more", len(names)-n)
}
