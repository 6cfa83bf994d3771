package command

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/verify"
)

func verifyCommand() *cli.Command {
	return &cli.Command{
		Name:  "verify",
		Usage: "prove that a converted checkpoint computes what the original does (eval and one training step)",
		UsageText: "abnconvert verify --original IN --converted OUT [--relu POLICY --slope S --sync] [--seed N --batch N --size N | --input-data x.npy] [--probe P.probe.pth] [--json]\n\n" +
			"Runs both networks in abnconvert's own runtime: eval outputs, then one training step\n" +
			"(outputs, input gradient, every parameter gradient and running statistic, mapped\n" +
			"through the reparametrisation and sign folding), then eval again. The converted\n" +
			"network is rebuilt from the flags the conversion used, which the converted file's\n" +
			"provenance record gives: none needs repeating, and one given that contradicts the\n" +
			"record is refused (exit 2). A file without a record (an older abnconvert's, or\n" +
			"another tool's) is verified with the flags given (--relu, --slope, --tiny-gamma, --sync,\n" +
			"--arch, --graph), defaults for the rest. Sites the ReLU policy approximated are compared\n" +
			"exactly against the original made leaky there (and |gamma| < eps channels under\n" +
			"--tiny-gamma approx against the original with scale eps there), and their drift from\n" +
			"the original is reported, for eval and for the training step;\n" +
			"drift fails only with --strict. A check that cannot tell a right result from a\n" +
			"wrong one (true value zero, or below its float32 noise) is listed as skip, with\n" +
			"its reason, and is not counted as passed.\n\n" +
			"The original is rebuilt from its keys and shapes, --graph, a whole module or\n" +
			"the ONNX input; a rebuild from keys and shapes is an assumption, and the verdict\n" +
			"says so. --probe FILE (python/abnexport.py records it from your model) compares\n" +
			"the rebuild with what PyTorch computed first: eval, one training step, eval again;\n" +
			"a difference fails the verdict with its likely cause.\n\n" +
			"Exit codes: 0 preserved, 1 not preserved, 2 bad input, 3 internal error, 4 an op the\n" +
			"runtime does not model (the network is valid; abnconvert cannot run it yet).",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "original", Usage: "the checkpoint before conversion"},
			&cli.StringFlag{Name: "converted", Usage: "the checkpoint abnconvert wrote"},
			archFlag(), reluFlag(), slopeFlag(),
			&cli.StringFlag{Name: "tiny-gamma", Usage: "the conversion's --tiny-gamma (exact or approx); read from the provenance record where there is one; without one, approx (what abnconvert did before the flag)"},
			&cli.StringFlag{Name: "graph", Usage: "the ONNX export the conversion took its structure from (--graph)"},
			&cli.BoolFlag{Name: "sync", Usage: "the conversion used --sync"},
			&cli.Uint64Flag{Name: "seed", Value: 0, Usage: "seed of the random input and output gradient"},
			&cli.IntFlag{Name: "batch", Value: 2, Usage: "batch size of the random input"},
			&cli.IntFlag{Name: "size", Value: 64, Usage: "height and width of the random input"},
			&cli.StringFlag{Name: "input-data", Usage: "a float32/float64 .npy array [N, C, H, W] to use as input instead"},
			probeFlag(),
			&cli.Float64Flag{Name: "atol", Value: 1e-6, Usage: "absolute tolerance of eval comparisons"},
			&cli.Float64Flag{Name: "rtol", Value: 1e-4, Usage: "tolerance of eval comparisons, relative to the reference's largest magnitude"},
			&cli.Float64Flag{Name: "train-factor", Value: 25, Usage: "each training comparison passes within this many times its noise: the reference's own float32 error for that tensor, measured on the run"},
			&cli.BoolFlag{Name: "strict", Usage: "also fail when the declared approximations (ReLU policy, |gamma| < eps) move the outputs beyond --rtol"},
			&cli.StringFlag{Name: "device", Value: "cpu", Usage: "cpu, or cuda in a binary built with make cuda"},
			&cli.BoolFlag{Name: "json", Usage: "print the result as JSON"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress lines"},
		},
		Action: verifyAction,
		OnUsageError: func(c *cli.Context, err error, isSub bool) error {
			return cli.Exit(fmt.Sprintf("%v (see abnconvert verify --help)", err), ExitBadInput)
		},
	}
}

func verifyAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return cli.Exit(fmt.Sprintf("unexpected argument %q: give files with --original and --converted", c.Args().First()), ExitBadInput)
	}
	opt := verify.Options{
		Original: c.String("original"), Converted: c.String("converted"),
		Graph: c.String("graph"), Sync: c.Bool("sync"),
		Seed: c.Uint64("seed"), Batch: c.Int("batch"), Size: c.Int("size"), InputData: c.String("input-data"),
		Atol: c.Float64("atol"), Rtol: c.Float64("rtol"), TrainFactor: c.Float64("train-factor"),
		Strict: c.Bool("strict"), Device: c.String("device"), Probe: c.String("probe"),
	}
	if opt.Original == "" || opt.Converted == "" {
		return cli.Exit("both --original and --converted are required (see abnconvert verify --help)", ExitBadInput)
	}
	// Only the conversion flags given: the others come from the converted
	// file's provenance record (or, without one, their defaults).
	if c.IsSet("arch") {
		opt.Arch = c.String("arch")
	}
	if c.IsSet("relu") {
		opt.ReLU = c.String("relu")
	}
	if c.IsSet("slope") {
		opt.Slope = c.Float64("slope")
	}
	if c.IsSet("tiny-gamma") {
		switch opt.TinyGamma = c.String("tiny-gamma"); opt.TinyGamma {
		case "exact", "approx":
		default:
			return cli.Exit(fmt.Sprintf("--tiny-gamma %q: want exact or approx (see abnconvert verify --help)", opt.TinyGamma), ExitBadInput)
		}
	}
	if !c.Bool("quiet") {
		opt.Progress = c.App.ErrWriter
	}
	nb, err := backendFor(opt.Device, opt.Progress)
	if err != nil {
		return err
	}
	opt.NewBackend = nb
	res, err := verify.Run(opt)
	if err != nil {
		return err
	}
	res.Verdict = verdictLine(res)
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		if err := enc.Encode(res); err != nil {
			return err
		}
	} else {
		writeVerify(c.App.Writer, res)
	}
	if !res.Preserved {
		return cli.Exit("", ExitMismatch)
	}
	return nil
}

func writeVerify(w io.Writer, r *verify.Result) {
	fmt.Fprintf(w, "%s -> %s (%s, input %v, seed %d, device %s)\n", r.Original, r.Converted, r.Arch, r.Input, r.Seed, r.Device)
	if r.FlagsFrom != "" {
		fmt.Fprintf(w, "  conversion flags from the %s\n", r.FlagsFrom)
	}
	for _, wn := range r.Warnings {
		fmt.Fprintf(w, "  warning: %s\n", wn)
	}
	writeProbe(w, r) // probe.go
	grads, gradFail, gradSkip := 0, 0, 0
	for _, c := range r.Checks {
		many := strings.HasPrefix(c.Name, "gradient ") || strings.HasPrefix(c.Name, "running ")
		if many {
			grads++
		}
		switch {
		case c.Skipped:
			if many {
				gradSkip++
			}
			fmt.Fprintf(w, "  skip %-48s %s\n", c.Name, c.Reason)
		case many && !c.Pass:
			gradFail++
			fmt.Fprintf(w, "  FAIL %-48s rel %.2e > limit %.2e (noise %.2e) %s\n", c.Name, c.Rel, c.Limit, c.Noise, c.Note)
		case !many:
			mark := "ok  "
			if !c.Pass {
				mark = "FAIL"
			}
			fmt.Fprintf(w, "  %s %-48s rel %.2e (limit %.2e, noise %.2e) %s\n", mark, c.Name, c.Rel, c.Limit, c.Noise, c.Note)
		}
	}
	fmt.Fprintf(w, "  %d parameter gradients and running statistics compared: %d passed, %d failed, %d skipped\n", grads, grads-gradFail-gradSkip, gradFail, gradSkip)
	if d := r.Drift; d != nil {
		rounded := ""
		if d.Rounded > 0 {
			rounded = fmt.Sprintf(", %d BN scales rounded by half-precision storage", d.Rounded)
		}
		agree := ""
		switch {
		case d.Top1Agree != nil:
			agree = fmt.Sprintf(", top-1 agreement %.0f%%", 100**d.Top1Agree)
		case d.PixelAgree != nil:
			agree = fmt.Sprintf(", per-pixel agreement %.2f%% (argmax over channels)", 100**d.PixelAgree)
		}
		fmt.Fprintf(w, "  drift from the original (%d sites approximated by the ReLU policy, %d tiny-gamma channels%s): max abs %.3g, rel %.2e, cosine %.6f%s\n",
			d.Sites, d.TinyGamma, rounded, d.MaxAbs, d.Rel, d.Cosine, agree)
		if t := d.Train; t != nil {
			stats := ""
			if s := t.RunningStats; s != nil {
				stats = fmt.Sprintf(", running statistics rel %.2e (l2 %.2e, %s)", s.Rel, s.L2, s.Name)
			}
			fmt.Fprintf(w, "  training-step drift from the original: output rel %.2e (l2 %.2e), input gradient rel %.2e (l2 %.2e)%s\n",
				t.Output.Rel, t.Output.L2, t.InputGradient.Rel, t.InputGradient.L2, stats)
		}
	}
	fmt.Fprintln(w, r.Verdict)
}

// verdictLine is the verdict's line (verdict, probe.go), for the text and
// the JSON alike.
func verdictLine(r *verify.Result) string {
	skipped := ""
	if len(r.Skipped) > 0 {
		skipped = fmt.Sprintf(" (%d check(s) skipped: they cannot tell a right result from a wrong one)", len(r.Skipped))
	}
	return verdict(r, skipped)
}
