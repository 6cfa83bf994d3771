package cuda

import (
	"fmt"
	"strconv"
	"strings"
)

// ptxModule is what the backend needs to know of a PTX file: its ISA
// version and target, and each kernel entry with its parameters' types.
type ptxModule struct {
	Version     string
	Target      string
	AddressSize int
	// Entries maps a kernel name to its parameter types (".u64", ".f32").
	Entries map[string][]string
}

// parsePTX reads the header directives and the .entry declarations of a
// PTX module. It does not check instructions: the driver's JIT does that
// when it loads the module.
func parsePTX(src string) (*ptxModule, error) {
	m := &ptxModule{Entries: map[string][]string{}}
	lines := strings.Split(src, "\n")
	for i := 0; i < len(lines); i++ {
		t := stripComment(lines[i])
		if t == "" {
			continue
		}
		f := strings.Fields(t)
		switch {
		case f[0] == ".version" && len(f) == 2:
			m.Version = f[1]
		case f[0] == ".target" && len(f) >= 2:
			m.Target = strings.TrimSuffix(f[1], ",")
		case f[0] == ".address_size" && len(f) == 2:
			n, err := strconv.Atoi(f[1])
			if err != nil {
				return nil, fmt.Errorf("ptx line %d: .address_size %q: %w", i+1, f[1], err)
			}
			m.AddressSize = n
		case f[0] == ".entry" || (len(f) > 1 && f[1] == ".entry"):
			// The declaration runs from ".entry name(" to the first ")".
			decl := t
			start := i
			for !strings.Contains(decl, ")") {
				i++
				if i == len(lines) {
					return nil, fmt.Errorf("ptx line %d: parameter list not closed", start+1)
				}
				decl += " " + stripComment(lines[i])
			}
			rest := decl[strings.Index(decl, ".entry")+len(".entry"):]
			open, end := strings.Index(rest, "("), strings.Index(rest, ")")
			if open < 0 || end < open {
				return nil, fmt.Errorf("ptx line %d: .entry without a parameter list", start+1)
			}
			name := strings.TrimSpace(rest[:open])
			if name == "" {
				return nil, fmt.Errorf("ptx line %d: .entry without a name", start+1)
			}
			if _, dup := m.Entries[name]; dup {
				return nil, fmt.Errorf("ptx line %d: entry %s declared twice", start+1, name)
			}
			params := []string{}
			if list := strings.TrimSpace(rest[open+1 : end]); list != "" {
				for _, p := range strings.Split(list, ",") {
					typ, err := paramType(strings.TrimSpace(p))
					if err != nil {
						return nil, fmt.Errorf("ptx line %d: entry %s: %w", start+1, name, err)
					}
					params = append(params, typ)
				}
			}
			m.Entries[name] = params
		}
	}
	if m.Version == "" || m.Target == "" {
		return nil, fmt.Errorf("ptx: no .version or .target directive")
	}
	return m, nil
}

func stripComment(s string) string {
	if i := strings.Index(s, "//"); i >= 0 {
		s = s[:i]
	}
	return strings.TrimSpace(s)
}

// paramType returns the type of one ".param [.align N] .type name" item.
func paramType(decl string) (string, error) {
	f := strings.Fields(decl)
	if len(f) < 3 || f[0] != ".param" {
		return "", fmt.Errorf("parameter %q: want .param .type name", decl)
	}
	i := 1
	if f[i] == ".align" {
		i += 2
	}
	if i >= len(f)-1 || !strings.HasPrefix(f[i], ".") {
		return "", fmt.Errorf("parameter %q: no type", decl)
	}
	if strings.Contains(f[len(f)-1], "[") {
		// A by-value struct (.b8 name[N]): the backend passes none.
		return f[i] + "[]", nil
	}
	return f[i], nil
}
