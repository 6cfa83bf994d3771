package command

import (
	"encoding/json"
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/convert"
)

func revertCommand() *cli.Command {
	return &cli.Command{
		Name:  "revert",
		Usage: "turn an InPlace-ABN checkpoint back into plain BatchNorm (gamma = |weight| + eps), for export and deployment",
		UsageText: "abnconvert revert --input model_abn.pth --output model_bn.pth [--report report.json] [--eps 1e-5] [--json]\n\n" +
			"InPlace-ABN scales by |weight| + eps, so a plain BatchNorm needs gamma = |weight| + eps\n" +
			"(weight.abs() alone drops eps). The converted file's provenance record (or, for a file\n" +
			"without one, the conversion's --report) says which layers were InPlace-ABN and which ABN\n" +
			"(kept as stored), each layer's eps, and every sign the conversion moved into a\n" +
			"convolution or onto a layer's input: revert moves them back, so converting then\n" +
			"reverting gives the original checkpoint (channels with |gamma| < eps come back at scale\n" +
			"eps). With neither (a checkpoint from inplace_abn's own training scripts, \"module.\"\n" +
			"prefix and nesting included) every BN-family layer is taken as InPlace-ABN with --eps. Keys, nesting and other entries are kept; .pth and\n" +
			".safetensors in and out. The activation is not in a checkpoint: the output lists the\n" +
			"one each layer ran (leaky_relu where the conversion replaced a ReLU), which the BN\n" +
			"network must apply to compute what the InPlace-ABN network computed.\n\n" +
			"Exit codes: 0 done, 2 bad input, 3 internal error.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "input", Aliases: []string{"i"}, Usage: "the InPlace-ABN checkpoint (.pth or .safetensors)"},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "the plain-BN checkpoint to write"},
			&cli.StringFlag{Name: "report", Usage: "the conversion's report (convert --report), for a file without a provenance record"},
			&cli.Float64Flag{Name: "eps", Value: 1e-5, Usage: "eps of the layers the report does not give one for (all of them without a report)"},
			&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "overwrite an existing output"},
			&cli.BoolFlag{Name: "fsync", Usage: "flush the output to disk before renaming it into place"},
			&cli.BoolFlag{Name: "json", Usage: "print the result as JSON"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no table and no progress"},
		},
		Action: revertAction,
		OnUsageError: func(c *cli.Context, err error, isSub bool) error {
			return cli.Exit(fmt.Sprintf("%v (see abnconvert revert --help)", err), ExitBadInput)
		},
	}
}

func revertAction(c *cli.Context) error {
	if c.NArg() > 0 {
		return cli.Exit(fmt.Sprintf("unexpected argument %q: give the checkpoint with --input (see abnconvert revert --help)", c.Args().First()), ExitBadInput)
	}
	opt := convert.RevertOptions{
		Input: c.String("input"), Output: c.String("output"), Report: c.String("report"),
		Eps: c.Float64("eps"), Force: c.Bool("force"), Fsync: c.Bool("fsync"),
	}
	if opt.Input == "" || opt.Output == "" {
		return cli.Exit("both --input and --output are required (see abnconvert revert --help)", ExitBadInput)
	}
	if !c.Bool("quiet") {
		opt.Progress = c.App.ErrWriter
	}
	res, err := convert.Revert(opt)
	if err != nil {
		return err
	}
	switch {
	case c.Bool("json"):
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	case !c.Bool("quiet"):
		res.WriteTable(c.App.Writer)
	}
	return nil
}
