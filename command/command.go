// Package command is abnconvert's command-line interface: flags, help text,
// output formats and exit codes. The work itself is in package convert.
package command

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/output"
	"github.com/abnconvert/abnconvert/verify"
)

// Exit codes that scripts can rely on: the error classes of package
// failure, whose Of maps every error to one.
const (
	ExitOK          = int(failure.OK)
	ExitMismatch    = int(failure.Mismatch)    // verify: the conversion changed the outputs
	ExitBadInput    = int(failure.BadInput)    // bad input, bad usage, or a refused conversion
	ExitInternal    = int(failure.Internal)    // a bug in abnconvert (a recovered panic included)
	ExitUnsupported = int(failure.Unsupported) // the network uses an op abnconvert does not support yet
)

// Version is set at build time with -ldflags "-X .../command.Version=...".
var Version = "dev"

// Main runs the command line and returns the process exit code. It never
// panics: a panic is a bug and is reported as one, with exit code 3.
func Main(args []string, stdout, stderr io.Writer) (code int) {
	defer func() {
		if r := recover(); r != nil {
			fmt.Fprintf(stderr, "abnconvert: internal error (please report it): %v\n", r)
			code = ExitInternal
		}
	}()
	app := newApp(stdout, stderr)
	err := app.Run(interspersed(app, args))
	if err == nil {
		return ExitOK
	}
	// A write that failed because a signal's handler removed its file
	// (output) is not the error to report: the signal ends the process.
	output.AwaitInterrupt()
	if msg := oneLine(err.Error()); msg != "" {
		fmt.Fprintln(stderr, "abnconvert: "+msg)
	}
	return exitCode(err)
}

// exitCode is an error's exit code: a usage error's (cli.Exit, exit 2, or
// verify's silent exit 1), else its class (failure.Of: bad input unless
// the error says otherwise where its cause is known).
func exitCode(err error) int {
	var ec cli.ExitCoder
	if errors.As(err, &ec) {
		return ec.ExitCode()
	}
	return int(failure.Of(err))
}

func oneLine(s string) string { return strings.ReplaceAll(strings.TrimSpace(s), "\n", "; ") }

func newApp(stdout, stderr io.Writer) *cli.App {
	app := &cli.App{
		Name:    "abnconvert",
		Usage:   "rewrite BatchNorm + activation into InPlace-ABN to cut training memory",
		Version: Version,
		UsageText: "abnconvert --input model.pth --output model_abn.pth [--emit-module model_abn.py] [flags]\n" +
			"abnconvert convert --input model.pth --output model_abn.pth [flags]\n" +
			"abnconvert inspect model.pth\n" +
			"abnconvert revert --input model_abn.pth --output model_bn.pth [--report report.json]",
		Description: `abnconvert reads a trained PyTorch checkpoint (zip or legacy .pth; a state dict,
possibly nested under "state_dict"/"model" and prefixed by "module."), recognises the
torchvision architecture from its keys and shapes, and rewrites every BatchNorm followed
by an activation (or by nothing, as before a residual add) into InPlace-ABN
(Rota Bulo et al., CVPR 2018), which keeps one tensor per layer for the backward pass
instead of two. DenseNet dense layers are marked for shared-buffer recomputation
(Pleiss et al., 2017). Nothing in the checkpoint is executed.

Other inputs: a .safetensors state dict (written back as .safetensors or .pth, and a
.pth state dict as .safetensors); a whole pickled module (torch.save(model)): a torchvision
classifier or segmentation model (ResNet, DenseNet, VGG, RegNet, MNASNet, MobileNetV2/V3,
ShuffleNetV2, EfficientNet, GoogLeNet, Inception3, FCN, DeepLabV3, LRASPP) or an
nn.Sequential chain, written as its state dict;
a state dict of any other network with --graph model.onnx, its export with
training=torch.onnx.TrainingMode.PRESERVE; and ONNX itself (--onnx-ops). "abnconvert
revert" turns an InPlace-ABN checkpoint back into plain BatchNorm.

The conversion is exact except where you choose otherwise: InPlace-ABN scales by
|weight| + eps, so the stored weight becomes |gamma| - eps, and negative gammas are made
exact by folding the sign into the convolution before them (or by an in-place sign flip,
or, where neither works, the exact non-in-place ABN layer). InPlace-ABN cannot invert a
plain ReLU, so BN + ReLU follows --relu: "leaky" (default) uses leaky_relu(--slope), as
the InPlace-ABN authors trained, and CHANGES the outputs (fine-tune after converting);
"abn" keeps ReLU exactly with the ABN layer (no in-place saving there); "error" refuses.
A channel with |gamma| < eps cannot be represented by |weight| + eps: by default
(--tiny-gamma exact) its site becomes the exact ABN layer, counted in the report;
--tiny-gamma approx keeps it in place with scale eps, approximately.

Exit codes (every command):
  0  success
  1  verification found a difference (verify, --verify)
  2  bad input or usage: one line on stderr names the file and the problem
  3  internal error: a bug in abnconvert (please report it)
  4  the network uses an op abnconvert does not support yet (the input is valid)
On any error no output is written: every output is staged beside its destination
and renamed into place only once all of them are complete, so existing files stay
as they were; an interrupted run (Ctrl-C, SIGTERM) removes what it staged.

Examples:
  abnconvert --input resnet50.pth --output resnet50_abn.pth --emit-module resnet50_abn.py
  abnconvert convert -i ckpt.pth -o ckpt_abn.pth --relu abn --report report.json
  abnconvert inspect densenet121.pth`,
		Flags:                  convertFlags(),
		Action:                 rootAction,
		Writer:                 stdout,
		ErrWriter:              stderr,
		HideHelpCommand:        true,
		UseShortOptionHandling: true,
		OnUsageError: func(c *cli.Context, err error, isSub bool) error {
			return cli.Exit(fmt.Sprintf("%v (see abnconvert --help)", err), ExitBadInput)
		},
		ExitErrHandler: func(*cli.Context, error) {}, // Main decides; never os.Exit inside
		Commands: []*cli.Command{
			{
				Name:      "convert",
				Usage:     "convert a checkpoint (the same as the top-level flags)",
				UsageText: "abnconvert convert --input IN --output OUT [flags]",
				Flags:     convertFlags(),
				Action:    convertAction,
				OnUsageError: func(c *cli.Context, err error, isSub bool) error {
					return cli.Exit(fmt.Sprintf("%v (see abnconvert convert --help)", err), ExitBadInput)
				},
			},
			{
				Name:  "inspect",
				Usage: "show what a checkpoint holds and what would convert, without writing anything",
				UsageText: "abnconvert inspect [--arch NAME] [--relu POLICY] [--json] IN\n" +
					"abnconvert inspect --security [--json] IN",
				Flags: []cli.Flag{
					archFlag(), reluFlag(), slopeFlag(), tinyGammaFlag(), graphFlag(),
					&cli.BoolFlag{Name: "json", Usage: "print the inspection as JSON"},
					&cli.BoolFlag{Name: "security", Usage: "only list the globals the checkpoint's pickle references and whether torch.load(weights_only=True) accepts each (works on files conversion refuses; exit 0 when all are accepted, 2 when some would be refused)"},
				},
				Action: inspectAction,
				OnUsageError: func(c *cli.Context, err error, isSub bool) error {
					return cli.Exit(fmt.Sprintf("%v (see abnconvert inspect --help)", err), ExitBadInput)
				},
			},
			verifyCommand(),
			memoryCommand(),
			revertCommand(), // revert.go
		},
	}
	return app
}

func archFlag() cli.Flag {
	return &cli.StringFlag{Name: "arch", Value: "auto", Usage: "architecture: auto (recognise from keys and shapes) or a name such as resnet50, densenet121, vgg16_bn"}
}

func reluFlag() cli.Flag {
	return &cli.StringFlag{Name: "relu", Value: "leaky", Usage: "BN + ReLU policy: leaky (InPlace-ABN leaky_relu(--slope); outputs change), abn (exact ABN relu, no in-place saving), error (refuse)"}
}

// tinyGammaUsage says what --tiny-gamma chooses between.
const tinyGammaUsage = "in-place sites with channels whose |gamma| < eps (which InPlace-ABN, scaling by |weight| + eps, cannot represent): exact (ABN for those sites: exact in eval and training, not in place) or approx (in place with scale eps there: outputs and, more, the training step change)"

func tinyGammaFlag() cli.Flag {
	return &cli.StringFlag{Name: "tiny-gamma", Value: "exact", Usage: tinyGammaUsage}
}

func graphFlag() cli.Flag {
	return &cli.StringFlag{Name: "graph", Usage: "an ONNX export of the network (torch.onnx.export with training=torch.onnx.TrainingMode.PRESERVE) giving the structure of a state dict no recogniser knows; parameters are matched by name"}
}

func slopeFlag() cli.Flag {
	return &cli.Float64Flag{Name: "slope", Value: 0.01, Usage: "leaky_relu slope used by --relu leaky"}
}

func convertFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "input", Aliases: []string{"i"}, Usage: "checkpoint to convert (.pth/.pt zip or legacy, a whole pickled module, .safetensors, or .onnx)"},
		&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "converted checkpoint to write: .pth (zip format, loads with torch.load(weights_only=True)), .safetensors, or .onnx for an ONNX input"},
		&cli.StringFlag{Name: "emit-module", Usage: "also write a Python file defining class Model (inplace_abn layers) that loads the output strictly"},
		&cli.StringFlag{Name: "report", Usage: "also write the per-site report as JSON to this file"},
		archFlag(), reluFlag(), slopeFlag(), tinyGammaFlag(), graphFlag(),
		&cli.BoolFlag{Name: "sync", Usage: "use InPlaceABNSync (batch statistics across torch.distributed ranks)"},
		&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "overwrite existing output files"},
		&cli.BoolFlag{Name: "fsync", Usage: "flush outputs to disk before renaming them into place (durable against power loss; a failed run never leaves partial output either way)"},
		&cli.BoolFlag{Name: "json", Usage: "print the report as JSON on stdout instead of a table"},
		&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no table and no progress; errors still go to stderr"},
		&cli.StringFlag{Name: "dump-after", Usage: "print the IR after the named rewrite pass (to stderr), for debugging"},
		&cli.StringFlag{Name: "onnx-ops", Value: "custom", Usage: "ONNX output: custom (InPlaceABN nodes in the ai.abnconvert domain), standard (BatchNormalization + activation, runs anywhere), fold (BN folded into Conv, for inference)"},
		&cli.BoolFlag{Name: "verify", Usage: "then verify the output against the input, as abnconvert verify does with its defaults (exit 1 when not preserved)"},
		probeFlag(), // probe.go; implies --verify
	}
}

func rootAction(c *cli.Context) error {
	if !c.IsSet("input") && !c.IsSet("output") && c.NArg() == 0 {
		return cli.ShowAppHelp(c)
	}
	return convertAction(c)
}

func convertAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return cli.Exit(fmt.Sprintf("unexpected argument %q: give the checkpoint with --input (see --help)", c.Args().First()), ExitBadInput)
	}
	opt := convert.Options{
		Input:      c.String("input"),
		Output:     c.String("output"),
		EmitModule: c.String("emit-module"),
		ReportPath: c.String("report"),
		Arch:       c.String("arch"),
		ReLU:       c.String("relu"),
		Slope:      c.Float64("slope"),
		TinyGamma:  c.String("tiny-gamma"),
		Sync:       c.Bool("sync"),
		Force:      c.Bool("force"),
		Fsync:      c.Bool("fsync"),
		ONNXOps:    c.String("onnx-ops"),
		Graph:      c.String("graph"),
		DumpAfter:  c.String("dump-after"),
		Command:    strings.Join(os.Args, " "),
		Version:    Version,
	}
	if opt.Input == "" || opt.Output == "" {
		return cli.Exit("both --input and --output are required (see abnconvert convert --help)", ExitBadInput)
	}
	if opt.DumpAfter != "" {
		opt.Dump = c.App.ErrWriter
	}
	if !c.Bool("quiet") {
		opt.Progress = c.App.ErrWriter
	}
	opt.Table = !c.Bool("json") && !c.Bool("quiet")
	// A probe is read before anything is written: a bad one is bad input,
	// and leaves no output behind.
	probe := c.String("probe")
	if probe != "" {
		if _, err := verify.ReadProbe(probe); err != nil {
			return err
		}
	}
	res, err := convert.Run(opt)
	if err != nil {
		return err
	}
	var ver *verify.Result
	if c.Bool("verify") || probe != "" {
		vopt := verify.Options{Original: opt.Input, Converted: opt.Output, Arch: opt.Arch, Graph: opt.Graph, ReLU: opt.ReLU, Slope: opt.Slope, TinyGamma: opt.TinyGamma, Sync: opt.Sync, Probe: probe}
		if !c.Bool("quiet") {
			vopt.Progress = c.App.ErrWriter
		}
		if ver, err = verify.Run(vopt); err != nil {
			return err
		}
		ver.Verdict = verdictLine(ver)
	}
	switch {
	case c.Bool("json"):
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		out := any(res)
		if ver != nil {
			out = struct {
				*convert.Result
				Verify *verify.Result `json:"verify"`
			}{res, ver}
		}
		if err := enc.Encode(out); err != nil {
			return err
		}
	case !c.Bool("quiet"):
		res.WriteTable(c.App.Writer)
		if ver != nil {
			writeVerify(c.App.Writer, ver)
		}
	}
	if ver != nil && !ver.Preserved {
		return cli.Exit("", ExitMismatch)
	}
	return nil
}

func inspectAction(c *cli.Context) error {
	if c.NArg() != 1 {
		return cli.Exit("inspect takes one checkpoint path (see abnconvert inspect --help)", ExitBadInput)
	}
	if c.Bool("security") {
		return securityAction(c, c.Args().First())
	}
	ins, err := convert.Inspect(c.Args().First(), convert.Options{
		Arch: c.String("arch"), ReLU: c.String("relu"), Slope: c.Float64("slope"), TinyGamma: c.String("tiny-gamma"), Graph: c.String("graph"),
	})
	if err != nil {
		return err
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(ins)
	}
	ins.WriteText(c.App.Writer)
	return nil
}
