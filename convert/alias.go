package convert

import (
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Aliased keys (issue 44: one tensor stored under two keys). A state dict
// may hold one storage under several keys (tied weights, sd["b"] =
// sd["a"], overlapping views). Package pth converts each key on its own
// (a change through one key reaches no other, and a changed key is
// written to a storage of its own); this file says so, per group, in the
// result, the report and inspect, naming what the conversion changes and
// why, since the output no longer ties the keys it changed.

// AliasGroup is one group of state-dict keys whose tensors share bytes of
// one storage in the input, and what the conversion does with it.
type AliasGroup struct {
	pth.Alias
	// Changed are the keys of the group the conversion changes, with why.
	Changed []AliasChange `json:"changed,omitempty"`
	// Written is "shared" where nothing in the group changes (written as
	// it was read, the keys still sharing their storage), "separate" where
	// some key changes (each changed key gets a storage of its own, the
	// others keep the input's), "copies" for a .safetensors output (a
	// tensor per key: the format shares nothing).
	// Empty where no conversion ran (inspect of a file it refuses).
	Written string `json:"written,omitempty"`
}

// AliasChange is a key of an alias group the conversion changes.
type AliasChange struct {
	Key string `json:"key"`
	Why string `json:"why"`
}

// aliasGroups is ck's alias groups with what rep changes in them; nil
// when there are none. copies: the output is .safetensors.
func aliasGroups(ck *pth.Checkpoint, rep *rewrite.Report, copies bool) []AliasGroup {
	if ck == nil {
		return nil
	}
	aliases := ck.Aliases()
	if len(aliases) == 0 {
		return nil
	}
	changed := map[string]bool{}
	if rep != nil {
		for _, k := range rep.Changed {
			changed[k] = true
		}
		for k, ch := range rep.Flips {
			changed[k] = changed[k] || len(ch) > 0
		}
	}
	var out []AliasGroup
	for _, a := range aliases {
		g := AliasGroup{Alias: a, Written: "shared"}
		for _, k := range a.Keys {
			if changed[k] {
				g.Changed = append(g.Changed, AliasChange{Key: k, Why: changeWhy(k, rep)})
			}
		}
		switch {
		case rep == nil: // no conversion to say what it changes
			g.Written = ""
		case copies:
			g.Written = "copies"
		case len(g.Changed) > 0:
			g.Written = "separate"
		}
		out = append(out, g)
	}
	return out
}

// changeWhy says why the conversion changes key: the signs it takes from
// a BatchNorm's negative gammas, or the BatchNorm vector it rewrites.
func changeWhy(key string, rep *rewrite.Report) string {
	module := key
	if i := strings.LastIndexByte(key, '.'); i >= 0 {
		module = key[:i]
	}
	if ch := rep.Flips[key]; len(ch) > 0 {
		chans, verb, gammas := channelList(ch), "take", "gammas"
		if len(ch) == 1 {
			verb, gammas = "takes", "gamma"
		}
		for _, s := range rep.Sites {
			for _, p := range s.FoldedInto {
				if p == module {
					return fmt.Sprintf("its output %s %s the sign of %s's negative %s", chans, verb, s.Node, gammas)
				}
			}
		}
		return fmt.Sprintf("its output %s %s a sign flip of the conversion", chans, verb)
	}
	for _, s := range rep.Sites {
		if s.Node == module {
			return fmt.Sprintf("a vector of %s, rewritten for %s", s.Node, s.Op)
		}
	}
	return "the conversion rewrites its values"
}

// channelList is "channel 3" or "channels 0, 5, 7" (the first eight).
func channelList(ch []int) string {
	c := append([]int(nil), ch...)
	sort.Ints(c)
	var s []string
	for i, x := range c {
		if i == 8 {
			s = append(s, fmt.Sprintf("and %d more", len(c)-8))
			break
		}
		s = append(s, fmt.Sprint(x))
	}
	if len(c) == 1 {
		return "channel " + s[0]
	}
	return "channels " + strings.Join(s, ", ")
}

// Text is the group's line for a person: which keys share a storage, what
// the conversion changes in it and how the output holds them.
func (g AliasGroup) Text(input string) string {
	how := "views of one storage"
	if g.SameObject {
		how = "one tensor object"
	}
	s := fmt.Sprintf("%s share storage %s of %s (%s)", strings.Join(g.Keys, ", "), g.Storage, input, how)
	var ch []string
	for _, c := range g.Changed {
		ch = append(ch, c.Key+": "+c.Why)
	}
	switch g.Written {
	case "":
		return s
	case "shared":
		return s + "; the conversion changes none of them: written sharing it, as read"
	case "copies":
		if len(ch) == 0 {
			return s + "; the conversion changes none of them: written as a tensor per key (safetensors shares nothing)"
		}
		return s + "; the conversion changes " + strings.Join(ch, "; ") + ": written as a tensor per key (safetensors shares nothing), each with its own converted values"
	}
	return s + "; the conversion changes " + strings.Join(ch, "; ") + ": each changed key is written to a storage of its own, with its own converted values (after loading, the keys no longer share storage: a network that ties them must tie them again)"
}

// writeAliases prints the groups, one line each.
func writeAliases(w io.Writer, input string, groups []AliasGroup) {
	for _, g := range groups {
		fmt.Fprintf(w, "aliased keys: %s\n", g.Text(input))
	}
}
