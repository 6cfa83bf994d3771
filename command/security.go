package command

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/pth"
)

// Security is the report of inspect --security: every global the
// checkpoint's pickles reference and whether torch.load(weights_only=True)
// would accept it.
type Security struct {
	File    string           `json:"file"`
	Globals []SecurityGlobal `json:"globals"`
	// Safe is true when torch.load(weights_only=True) accepts every global.
	Safe    bool   `json:"safe_with_weights_only"`
	Verdict string `json:"verdict"`
}

// SecurityGlobal is one global and the allowlist's answer for it.
type SecurityGlobal struct {
	Name    string `json:"name"`
	Allowed bool   `json:"allowed"`
}

// securityAction runs inspect --security. The pickle is only walked, never
// decoded or executed, so it works on files that Open refuses. Exit 0 when
// torch.load(weights_only=True) would accept every global, 2 when it would
// refuse some (one line on stderr names them), 2 when the file cannot be
// walked at all.
func securityAction(c *cli.Context, path string) error {
	globals, err := pth.Scan(path)
	if err != nil {
		return err
	}
	sec := &Security{File: path, Globals: []SecurityGlobal{}, Safe: true}
	var refused []string
	for _, g := range globals {
		ok := pth.Allowed(g)
		sec.Globals = append(sec.Globals, SecurityGlobal{Name: g, Allowed: ok})
		if !ok {
			sec.Safe = false
			refused = append(refused, g)
		}
	}
	if sec.Safe {
		sec.Verdict = "safe to load with torch.load(weights_only=True): every global it references is on its allowlist"
	} else {
		sec.Verdict = fmt.Sprintf("NOT safe: torch.load(weights_only=True) refuses it, and a plain torch.load would import and call %s while loading", strings.Join(refused, ", "))
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sec); err != nil {
			return err
		}
	} else {
		sec.WriteText(c.App.Writer)
	}
	if !sec.Safe {
		return cli.Exit(fmt.Sprintf("%s: references %s, which torch.load(weights_only=True) refuses", path, strings.Join(refused, ", ")), ExitBadInput)
	}
	return nil
}

// WriteText prints the report for a person: one global a line, then the
// verdict.
func (s *Security) WriteText(w io.Writer) {
	fmt.Fprintf(w, "%s: %d globals referenced (nothing was executed)\n", s.File, len(s.Globals))
	for _, g := range s.Globals {
		mark := "allowed"
		if !g.Allowed {
			mark = "REFUSED"
		}
		fmt.Fprintf(w, "  %-8s %s\n", mark, g.Name)
	}
	fmt.Fprintf(w, "verdict: %s\n", s.Verdict)
}
