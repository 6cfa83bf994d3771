package rewrite

import (
	"bufio"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/abnconvert/abnconvert/graph"
)

// Outcome says how exact a converted site is.
type Outcome string

const (
	// OutcomeExact: same outputs, no sign handling needed.
	OutcomeExact Outcome = "exact"
	// OutcomeSignFolded: exact; negative gammas were folded into producers.
	OutcomeSignFolded Outcome = "sign-folded"
	// OutcomeSignFlipped: exact; some channels are flipped in place
	// (Node.Sign) before the layer.
	OutcomeSignFlipped Outcome = "sign-flipped"
	// OutcomeFallbackABN: exact, but ABN, not in place.
	OutcomeFallbackABN Outcome = "fallback-abn"
	// OutcomeApproximated: the activation changed (ReLU -> leaky_relu), or
	// channels with |gamma| < eps were given scale eps (--tiny-gamma
	// approx), so the outputs change.
	OutcomeApproximated Outcome = "approximated"
)

// Report says what the conversion did. It is meant to be written as JSON
// and read by people as a table (WriteTable).
type Report struct {
	Arch       string  `json:"arch"`
	ReLUPolicy string  `json:"relu_policy"`
	Slope      float64 `json:"slope"`
	// TinyGammaPolicy is --tiny-gamma: exact (ABN where |gamma| < eps)
	// or approx (scale eps there, in place).
	TinyGammaPolicy string           `json:"tiny_gamma_policy"`
	Sync            bool             `json:"sync"`
	Summary         Summary          `json:"summary"`
	Channels        Channels         `json:"channels"`
	Sites           []Site           `json:"sites"`
	DenseLayers     []string         `json:"dense_layers"`
	Flips           map[string][]int `json:"flips"`
	Changed         []string         `json:"changed"`
	Warnings        []string         `json:"warnings"`
}

// Summary counts sites by outcome, one outcome a site (approximated wins
// over sign-flipped, which wins over sign-folded, so a site made leaky that
// also folds signs counts as approximated only). TinyGamma counts sites
// with channels whose |gamma| < eps, whatever their outcome;
// TinyGammaFallback those of them kept out of place as ABN for it
// (--tiny-gamma exact), each an in-place saving lost (also counted in
// FallbackABN). Report.Channels counts channels, as the table's columns do.
type Summary struct {
	Sites             int `json:"sites"`
	Exact             int `json:"exact"`
	SignFolded        int `json:"sign_folded"`
	SignFlipped       int `json:"sign_flipped"`
	FallbackABN       int `json:"fallback_abn"`
	Approximated      int `json:"approximated"`
	TinyGamma         int `json:"tiny_gamma"`
	TinyGammaFallback int `json:"tiny_gamma_fallback"`
	DenseLayersMarked int `json:"dense_layers_marked"`
	// ResidualsFused counts the sites that add their block's residual in
	// place (Site.Residual).
	ResidualsFused int `json:"residuals_fused"`
}

// Channels counts channels, as the table's NEG, FOLDED, FLIPPED and TINY
// columns do, over every site whatever its outcome, and SitesFolding and
// SitesFlipping the sites with any: beside Summary's one outcome a site,
// the summary line and the table then agree (a DenseNet under --relu leaky
// read "0 sign-folded" above FOLDED columns full of channels).
type Channels struct {
	Negative      int `json:"negative"`
	Folded        int `json:"sign_folded"`
	Flipped       int `json:"sign_flipped"`
	TinyGamma     int `json:"tiny_gamma"`
	SitesFolding  int `json:"sites_folding"`
	SitesFlipping int `json:"sites_flipping"`
}

// Site is one converted BatchNorm2d.
type Site struct {
	// Node is the BN's module path, also the converted node's name.
	Node string `json:"node"`
	// Activation is what followed the BN in the source network: relu,
	// leaky_relu, elu or identity (nothing fusable, KeptActivation
	// included). A LeakyReLU or ELU with parameter 0 reads relu (Note).
	Activation string `json:"activation"`
	// ActivationNode is the activation node fused away, if any.
	ActivationNode string `json:"activation_node,omitempty"`
	// KeptActivation is the activation node that follows the BN and stays
	// after it, out of place, because neither InPlace-ABN nor ABN can take
	// its parameter (a negative leaky-ReLU slope or ELU alpha); Match says
	// why.
	KeptActivation string `json:"kept_activation,omitempty"`
	// Op is the resulting op; OpActivation and OpActivationParam are the
	// activation it runs.
	Op                graph.Op `json:"op"`
	OpActivation      string   `json:"op_activation"`
	OpActivationParam float64  `json:"op_activation_param,omitempty"`
	Outcome           Outcome  `json:"outcome"`
	// Reason explains a fallback or an approximation.
	Reason string `json:"reason,omitempty"`
	// Match explains why no activation was fused (identity sites).
	Match string `json:"match,omitempty"`
	// Note adds detail, such as why flipped channels could not be folded.
	Note string `json:"note,omitempty"`
	// NegativeChannels had gamma < 0 in the source checkpoint.
	NegativeChannels []int `json:"negative_channels,omitempty"`
	// FoldedChannels had their sign folded into a producer; FoldedInto
	// names the producers.
	FoldedChannels []int    `json:"folded_channels,omitempty"`
	FoldedInto     []string `json:"folded_into,omitempty"`
	// FlippedChannels are flipped in place before the layer (Node.Sign).
	FlippedChannels []int `json:"flipped_channels,omitempty"`
	// TinyGammaChannels had |gamma| < eps and now have scale eps
	// (--tiny-gamma approx, an in-place site): approximated;
	// TinyGammaScaleError is the largest |gamma_eff - |gamma|| among them.
	TinyGammaChannels   []int   `json:"tiny_gamma_channels,omitempty"`
	TinyGammaScaleError float64 `json:"tiny_gamma_scale_error,omitempty"`
	// TinyGammaExactChannels had |gamma| < eps and made the site fall back
	// to ABN (--tiny-gamma exact), which holds them as stored: exact.
	TinyGammaExactChannels []int `json:"tiny_gamma_exact_channels,omitempty"`
	// Recompute is the DenseNet group the node belongs to, if marked.
	Recompute string `json:"recompute,omitempty"`
	// Residual is the value the node adds to its output in place, the Add
	// ResidualAdd fused away (add-residual): the block keeps the sum only.
	// ResidualNote says why an identity site read by an Add was not fused.
	Residual     string `json:"residual,omitempty"`
	ResidualAdd  string `json:"residual_add,omitempty"`
	ResidualNote string `json:"residual_note,omitempty"`
}

func (s *site) outcome() Outcome {
	switch {
	case s.forced:
		return OutcomeFallbackABN
	case s.approx || len(s.tiny) > 0:
		return OutcomeApproximated
	case len(s.flipped) > 0:
		return OutcomeSignFlipped
	case len(s.folded) > 0 && len(s.negative) > 0 && s.inPlace():
		return OutcomeSignFolded
	}
	return OutcomeExact
}

func (st *State) report() *Report {
	r := &Report{
		Arch: st.g.Arch, ReLUPolicy: st.opt.ReLU, Slope: st.opt.Slope, TinyGammaPolicy: st.opt.TinyGamma, Sync: st.opt.Sync,
		Sites: []Site{}, DenseLayers: append([]string{}, st.dense...),
		Flips: st.t.flipReport(), Changed: st.t.changedKeys(), Warnings: []string{},
	}
	approxReLU := 0
	for _, s := range st.sites {
		site := Site{
			Node: s.bn.Name, Activation: s.srcAct, Op: s.op, OpActivation: s.actName, OpActivationParam: s.actParam,
			Outcome: s.outcome(), Reason: s.reason, Match: s.match,
			NegativeChannels: s.negative, FoldedChannels: sortedInts(s.folded), FoldedInto: s.into,
			FlippedChannels: s.flipped, TinyGammaChannels: s.tiny, TinyGammaScaleError: s.tinyErr,
			TinyGammaExactChannels: s.tinyExact,
			Recompute:              s.bn.Recompute,
			Residual:               s.residual, ResidualAdd: s.residualAdd, ResidualNote: s.residualWhy,
		}
		if s.note != "" && (len(s.flipped) > 0 || s.forced) {
			site.Note = s.note
		}
		if s.actNote != "" {
			site.Note = strings.TrimSuffix(s.actNote+"; "+site.Note, "; ")
		}
		if s.act != nil {
			site.ActivationNode = s.act.Name
		}
		if s.kept != nil {
			site.KeptActivation = s.kept.Name
		}
		r.Sites = append(r.Sites, site)
		sum := &r.Summary
		sum.Sites++
		switch site.Outcome {
		case OutcomeExact:
			sum.Exact++
		case OutcomeSignFolded:
			sum.SignFolded++
		case OutcomeSignFlipped:
			sum.SignFlipped++
		case OutcomeFallbackABN:
			sum.FallbackABN++
		case OutcomeApproximated:
			sum.Approximated++
			if s.srcAct == graph.ActReLU {
				approxReLU++
			}
		}
		if len(s.tiny) > 0 || len(s.tinyExact) > 0 {
			sum.TinyGamma++
		}
		if len(s.tinyExact) > 0 {
			sum.TinyGammaFallback++
		}
		if s.residual != "" {
			sum.ResidualsFused++
		}
		ch := &r.Channels
		ch.Negative += len(site.NegativeChannels)
		ch.Folded += len(site.FoldedChannels)
		ch.Flipped += len(site.FlippedChannels)
		ch.TinyGamma += len(site.TinyGammaChannels) + len(site.TinyGammaExactChannels)
		if len(site.FoldedChannels) > 0 {
			ch.SitesFolding++
		}
		if len(site.FlippedChannels) > 0 {
			ch.SitesFlipping++
		}
	}
	r.Summary.DenseLayersMarked = len(r.DenseLayers)
	if approxReLU > 0 {
		r.Warnings = append(r.Warnings, reluWarning(approxReLU, st.opt.Slope))
	}
	if n := r.Summary.TinyGammaFallback; n > 0 {
		r.Warnings = append(r.Warnings, tinyGammaWarning(n))
	}
	if st.opt.Sync {
		notSynced := 0
		for _, s := range st.sites {
			if s.op == graph.OpABN {
				notSynced++
			}
		}
		if notSynced > 0 {
			r.Warnings = append(r.Warnings, syncWarning(notSynced, len(st.sites)))
		}
	}
	r.Warnings = append(r.Warnings, st.warn...)
	return r
}

// syncWarning: --sync makes the in-place sites InPlaceABNSync, but
// inplace_abn has no synchronised ABN, so the sites kept out of place (a
// ReLU under --relu abn, a tiny gamma, an input that may not be
// overwritten) normalise with their own rank's batch statistics. Said,
// since a user asking for --sync expects every layer synchronised.
func syncWarning(n, total int) string {
	return fmt.Sprintf("WARNING: --sync: %d of %d sites are ABN (not in place), which inplace_abn has no synchronised form of: they normalise with each rank's own batch statistics (--relu leaky makes the ReLU sites InPlaceABNSync, changing outputs); InPlaceABNSync runs on CUDA only (inplace_abn has no CPU kernel for its statistics reduction)", n, total)
}

// tinyGammaWarning is the one line for the sites kept out of place by
// --tiny-gamma exact: exact, so not in capitals, but each one is memory
// the user may have converted to save.
func tinyGammaWarning(n int) string {
	return fmt.Sprintf("%d site(s) with |gamma| < eps kept out of place as ABN to stay exact (their in-place saving is lost; the sites' reasons name the channels): --tiny-gamma %s keeps them in place with scale eps, which approximates (verify reports the drift, training step included)", n, TinyGammaApprox)
}

func reluWarning(n int, slope float64) string {
	return fmt.Sprintf("WARNING: %d BN+ReLU sites now use leaky_relu(%g): outputs change; use --relu %s for an exact (not in-place) conversion", n, slope, ReLUABN)
}

// WriteTable prints the report for people: the summary, then the ReLU
// approximation in capitals if there is one, then one row per site.
func (r *Report) WriteTable(w io.Writer) {
	// Buffered: the table writer writes each cell apart, 2,400 system
	// calls for densenet201's 201 sites, 10 ms on a VM measured
	// 2026-12-02 (w may be os.Stdout itself).
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	w = bw
	s := r.Summary
	fmt.Fprintf(w, "rewrite %s: %d sites by outcome: %d exact, %d sign-folded, %d sign-flipped, %d fallback-abn, %d approximated; %d with tiny gamma (%d kept out of place for it); %d dense layers marked; %d residual adds fused\n",
		r.Arch, s.Sites, s.Exact, s.SignFolded, s.SignFlipped, s.FallbackABN, s.Approximated, s.TinyGamma, s.TinyGammaFallback, s.DenseLayersMarked, s.ResidualsFused)
	// The outcome is one a site; the table's columns count channels, which
	// an approximated or fallback site may fold or flip too: say both.
	fmt.Fprintf(w, "channels (the table's NEG, FOLDED, FLIPPED, TINY columns), whatever the site's outcome: %d negative, %d sign-folded in %d sites, %d sign-flipped in %d sites, %d with tiny gamma\n",
		r.Channels.Negative, r.Channels.Folded, r.Channels.SitesFolding, r.Channels.Flipped, r.Channels.SitesFlipping, r.Channels.TinyGamma)
	fmt.Fprintf(w, "relu policy %s", r.ReLUPolicy)
	if r.ReLUPolicy == ReLULeaky {
		fmt.Fprintf(w, " (slope %g)", r.Slope)
	}
	if r.TinyGammaPolicy != "" {
		fmt.Fprintf(w, ", tiny gamma %s", r.TinyGammaPolicy)
	}
	if r.Sync {
		fmt.Fprint(w, ", sync")
	}
	fmt.Fprintln(w)
	for _, msg := range r.Warnings {
		if strings.HasPrefix(msg, "WARNING:") {
			bar := strings.Repeat("!", 78)
			fmt.Fprintf(w, "\n%s\n%s\n%s\n", bar, msg, bar)
		}
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tACTIVATION\tOP\tOUTCOME\tNEG\tFOLDED\tFLIPPED\tTINY\tRECOMPUTE\tREASON")
	for _, x := range r.Sites {
		op := fmt.Sprintf("%s(%s", x.Op, x.OpActivation)
		if x.OpActivation == graph.ActLeakyReLU || x.OpActivation == graph.ActELU {
			op += fmt.Sprintf(" %g", x.OpActivationParam)
		}
		op += ")"
		why := x.Reason
		switch {
		case x.Outcome == OutcomeApproximated:
			// The warnings say it at length.
			var parts []string
			if x.Activation != x.OpActivation {
				parts = append(parts, fmt.Sprintf("%s -> %s", x.Activation, x.OpActivation))
			}
			if n := len(x.TinyGammaChannels); n > 0 {
				parts = append(parts, fmt.Sprintf("%d |gamma| < eps at scale eps", n))
			}
			why = strings.Join(parts, "; ") + " (outputs change)"
		case why == "":
			why = x.Note
		case x.KeptActivation != "":
			why += "; " + x.Match
		}
		if x.Residual != "" {
			res := fmt.Sprintf("adds %s in place (%s fused): keeps the sum only, one tensor fewer", x.Residual, x.ResidualAdd)
			if why != "" {
				res = why + "; " + res
			}
			why = res
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", x.Node, x.Activation, op, x.Outcome,
			count(x.NegativeChannels), count(x.FoldedChannels), count(x.FlippedChannels), countN(len(x.TinyGammaChannels)+len(x.TinyGammaExactChannels)),
			dash(x.Recompute), dash(why))
	}
	tw.Flush()
	if len(r.DenseLayers) > 0 {
		fmt.Fprintf(w, "\ndense layers marked for recomputation (%d): %s\n", len(r.DenseLayers), strings.Join(r.DenseLayers, ", "))
	}
	fmt.Fprintf(w, "\n%d keys changed, %d keys with flipped signs\n", len(r.Changed), len(r.Flips))
	var rest []string
	for _, msg := range r.Warnings {
		if !strings.HasPrefix(msg, "WARNING:") {
			rest = append(rest, msg)
		}
	}
	if len(rest) > 0 {
		fmt.Fprintln(w, "warnings:")
		for _, msg := range rest {
			fmt.Fprintf(w, "  %s\n", msg)
		}
	}
}

func count(list []int) string { return countN(len(list)) }

func countN(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func sortedInts(list []int) []int {
	out := append([]int(nil), list...)
	sort.Ints(out)
	return out
}
