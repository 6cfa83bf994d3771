// Package arch recognises torchvision networks (ResNet and its ResNeXt and
// wide variants, DenseNet, VGG with batch norm, and the FCN and DeepLabV3
// segmentation models over a ResNet backbone) from the keys and shapes of a
// state dict, or rebuilds them from a whole pickled module tree
// (FromModule), and builds the IR graph that mirrors torchvision 0.14's
// forward for them.
//
// From a state dict, structure is read from the keys, never assumed where
// they can say it: block counts from module indices, widths, groups and
// growth rates from weight shapes. A network laid out like a torchvision
// model but with other widths or depths is therefore accepted and
// described. What a state dict cannot hold (strides, paddings, dilations,
// BN eps and momentum, dropout rates, ASPP rates) is taken from
// torchvision's constructor defaults, and the match's notes say so: a
// dilated ResNet has the same keys as a plain one. From a module tree,
// every one of those attributes is read from the modules, and one that is
// not understood is an error.
//
// State dicts of the families rebuilt from module trees (MobileNetV2 and
// V3, MNASNet, RegNet, ShuffleNetV2, GoogLeNet, Inception3, EfficientNet V1
// and V2, and
// lraspp/deeplabv3_mobilenet_v3_large) are recognised by synthesising the
// tree torchvision's constructor would build for their keys and shapes
// (synth.go) and building it like a pickled module: both paths give the
// same graph, and the notes state what the constructor's table supplied.
package arch

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"

	"github.com/abnconvert/abnconvert/graph"
)

// Match says what Recognize found.
type Match struct {
	// Arch is the torchvision name when the state dict matches one of its
	// configurations exactly (num_classes aside), else a description such as
	// "resnet (BasicBlock [1 1 1 1], width 8)".
	Arch string
	// Family is FamilyResNet, FamilyDenseNet or FamilyVGG.
	Family string
	// Prefix is the common key prefix ("module."), kept in every node name and
	// parameter key.
	Prefix string
	Exact  bool
	// Notes record what was inferred or assumed: prefix, legacy key names,
	// missing num_batches_tracked, num_classes.
	Notes []string
	// Warnings are what the structure source may have lost (an eval-mode
	// export's Dropout), for the conversion's warnings.
	Warnings []string
	// FixedInput is the input shape an export without dynamic axes runs
	// at, and nothing else (its shapes are constants); nil otherwise.
	FixedInput []int
}

var (
	// ErrUnrecognised wraps every error about a state dict whose layout is
	// not one of the supported families.
	ErrUnrecognised = errors.New("unrecognised layout")
	// ErrMismatch wraps the error for a forced name the state dict does not
	// match.
	ErrMismatch = errors.New("architecture mismatch")
)

// Recognize finds the architecture of the state dict w and builds its graph.
// force is "auto" or "" to detect, or one of Names() to insist on that
// configuration (any num_classes), which is an error listing the first
// disagreements when the shapes say otherwise. Every key must be consumed by
// the graph and every parameter the graph needs must be present; the error
// lists the ones that are not.
//
// An unrecognised layout's error ends with StateDictNextSteps.
func Recognize(w graph.Weights, force string) (*graph.Graph, *Match, error) {
	g, m, err := recognize(w, force)
	if errors.Is(err, ErrUnrecognised) {
		return nil, nil, fmt.Errorf("%w; %s", err, StateDictNextSteps)
	}
	return g, m, err
}

// StateDictNextSteps is what to do with a state dict no recogniser knows:
// a state dict alone holds no structure, so give one, three ways.
const StateDictNextSteps = "a state dict holds no structure, so give it one of three ways: " +
	"(1) --graph net.onnx, the network's export (model.train(); torch.onnx.export(model, x, \"net.onnx\", opset_version=13, training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False, input_names=[\"x\"], dynamic_axes={\"x\": {0: \"n\", 2: \"h\", 3: \"w\"}}): the README's \"Exporting a network for --graph\"); " +
	"(2) the whole pickled module instead of its state dict (torch.save(model)), for torchvision's classes; " +
	"(3) python3 python/abnexport.py MODULE:FACTORY --shape 2,3,224,224 --out net, which writes net.pth, net.onnx and a probe recorded from your model, then abnconvert -i net.pth -o net_abn.pth --graph net.onnx --probe net.probe.pth"

// recognize is Recognize without the next steps (a whole module's
// fallback reads its error as a note).
func recognize(w graph.Weights, force string) (*graph.Graph, *Match, error) {
	keys := w.Keys()
	if len(keys) == 0 {
		return nil, nil, fmt.Errorf("%w: the state dict is empty", ErrUnrecognised)
	}
	for _, k := range keys {
		if _, ok := w.Shape(k); !ok {
			return nil, nil, fmt.Errorf("state dict lists %q but has no shape for it", k)
		}
	}
	force = strings.TrimSpace(force)
	if force == "" || force == "auto" {
		if g, m, ok, err := recognizeTree(w, keys); ok {
			return g, m, err
		}
		return detect(w, keys)
	}
	c, ok := lookup(force)
	if !ok && isTreeName(force) {
		return forceTree(w, keys, force)
	}
	if !ok {
		return nil, nil, fmt.Errorf("unknown architecture %q; supported: auto, %s, %s", force, strings.Join(Names(), ", "), strings.Join(TreeNames(), ", "))
	}
	prefix := ""
	if best, ok := bestCandidate(keys, c.family); ok {
		prefix = best.prefix
	}
	if d := diff(w, keys, prefix, c); len(d) > 0 {
		return nil, nil, fmt.Errorf("%w: the state dict is not %s (%d disagreements): %s", ErrMismatch, c.name, len(d), firstFew(d, 5))
	}
	g, m, err := build(w, keys, c.family, prefix)
	if err != nil {
		// diff found nothing, so the builder disagrees with the generator:
		// a bug, but still reported as an error rather than a panic.
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrMismatch, c.name, err)
	}
	m.Arch, m.Exact = c.name, true
	g.Arch = c.name
	return g, m, nil
}

// familyKeys matches, after the prefix, every key a family's modules can own.
// Counting matches ranks the families and prefixes worth trying and says how
// close an unrecognised state dict came. Compiled on first need, not at
// start: they were most of this package's 2-4 ms of init on a VM where the
// pages a program first touches cost 11 µs each (Warm).
var familyKeys = sync.OnceValue(func() map[string]*regexp.Regexp {
	return map[string]*regexp.Regexp{
		FamilyResNet: regexp.MustCompile(`^(?:` + resnetBodyKeys + `|fc\.(?:weight|bias))$`),
		// The heads' keys are left loose: the builder names what is wrong.
		FamilySegmentation: regexp.MustCompile(`^(?:backbone\.(?:` + resnetBodyKeys + `)|(?:aux_)?classifier\.\d+\.[\w.]+)$`),
		FamilyDenseNet: regexp.MustCompile(`^(?:features\.(?:conv0\.weight|norm0\.` + bnRoles +
			`|denseblock\d+\.denselayer\d+\.(?:norm\.?[12]\.` + bnRoles + `|conv\.?[12]\.(?:weight|bias))` +
			`|transition\d+\.(?:norm\.` + bnRoles + `|conv\.(?:weight|bias))|norm5\.` + bnRoles + `)|classifier\.(?:weight|bias))$`),
		FamilyVGG: regexp.MustCompile(`^(?:features\.\d+\.(?:weight|bias|running_mean|running_var|num_batches_tracked)|classifier\.[036]\.(?:weight|bias))$`),
	}
})

// Warm compiles what recognising a checkpoint needs, for a caller that
// has a core to spare before it recognises one (a conversion reading its
// input).
func Warm() {
	familyKeys()
	legacyDenseKey()
}

const bnRoles = `(?:weight|bias|running_mean|running_var|num_batches_tracked)`

// resnetBodyKeys matches the keys of a ResNet up to layer4.
const resnetBodyKeys = `conv1\.weight|bn1\.` + bnRoles + `|layer[1-4]\.\d+\.(?:conv[123]\.(?:weight|bias)|bn[123]\.` + bnRoles +
	`|downsample\.0\.(?:weight|bias)|downsample\.1\.` + bnRoles + `)`

// anchors are keys that every state dict of a family has; where one sits
// below a prefix ("module.conv1.weight"), that prefix is a candidate.
var anchors = map[string][]string{
	FamilyResNet:       {"conv1.weight", "fc.weight"},
	FamilyDenseNet:     {"features.conv0.weight", "features.norm5.weight", "classifier.weight"},
	FamilyVGG:          {"features.0.weight", "classifier.6.weight"},
	FamilySegmentation: {"backbone.conv1.weight", "backbone.0.0.weight"},
}

type candidate struct {
	family, prefix string
	score          int
}

// bestCandidate returns the best of the (family, prefix) pairs suggested
// by anchors: most keys matched first, then the shorter prefix, then the
// first suggested (families in order, keys in order). family "" means all
// families; ok is false where no anchor matches.
//
// Only a pair that could still win is scored, and the first no further
// than it must be to win: a prefix matches at most the keys that start
// with it (its bound, which a sorted copy of the keys counts in O(log n +
// count)), and once the pair of the highest bound (on a whole state dict,
// the family whose anchors sit at its root, prefix "") has matched one key
// more than the next bound, nothing else can win. The best's score is then
// a lower bound, enough to rank it. Why: scoring, a regular expression per
// key, was 40% of recognising densenet201: its own prefix key by key, and
// the 98 prefixes that ResNet's anchor "conv1.weight" suggests inside it
// ("...denselayerN.conv1.weight"), each against every key.
func bestCandidate(keys []string, family string) (best candidate, ok bool) {
	seen := map[candidate]bool{}
	type pending struct {
		c     candidate
		bound int // keys that start with c.prefix
		order int // place in suggestion order
	}
	var todo []pending
	var sorted []string
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
				if sorted == nil {
					sorted = slices.Clone(keys)
					slices.Sort(sorted)
				}
				todo = append(todo, pending{c, countPrefixed(sorted, p), len(todo)})
			}
		}
	}
	// Highest bound first (stable: suggestion order among equals), so that
	// scoring stops at the first bound below the best score found.
	slices.SortStableFunc(todo, func(a, b pending) int { return b.bound - a.bound })
	bestOrder := 0
	for i, t := range todo {
		if ok && t.bound < best.score {
			break
		}
		limit := len(keys) + 1 // more than any score
		if i == 0 {
			limit = 1
			if len(todo) > 1 {
				limit = todo[1].bound + 1
			}
		}
		if t.c.score = scoreUpTo(keys, t.c.family, t.c.prefix, limit); t.c.score >= limit {
			return t.c, true // the first, past every other bound
		}
		if !ok || better(t.c, best) || (!better(best, t.c) && t.order < bestOrder) {
			best, bestOrder, ok = t.c, t.order, true
		}
	}
	return best, ok
}

// countPrefixed counts the keys of sorted (ascending) that start with prefix.
func countPrefixed(sorted []string, prefix string) int {
	i, _ := slices.BinarySearch(sorted, prefix)
	n := 0
	for ; i+n < len(sorted) && strings.HasPrefix(sorted[i+n], prefix); n++ {
	}
	return n
}

func better(a, b candidate) bool {
	if a.score != b.score {
		return a.score > b.score
	}
	return len(a.prefix) < len(b.prefix)
}

func score(keys []string, family, prefix string) int {
	return scoreUpTo(keys, family, prefix, len(keys)+1)
}

// scoreUpTo is score, counted no further than limit.
func scoreUpTo(keys []string, family, prefix string, limit int) int {
	n := 0
	re := familyKeys()[family]
	for _, k := range keys {
		if rest, ok := strings.CutPrefix(k, prefix); ok && re.MatchString(rest) {
			if n++; n >= limit {
				break
			}
		}
	}
	return n
}

// detect tries the best-ranked candidate and names what it built.
func detect(w graph.Weights, keys []string) (*graph.Graph, *Match, error) {
	best, ok := bestCandidate(keys, "")
	if !ok {
		return nil, nil, fmt.Errorf("%w: no key looks like a supported family (%s): %s", ErrUnrecognised, strings.Join(families, ", "), firstFew(keys, 5))
	}
	g, m, err := build(w, keys, best.family, best.prefix)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: closest family %s (matched %d of %d keys); %w", ErrUnrecognised, best.family, score(keys, best.family, best.prefix), len(keys), err)
	}
	if name := exactName(w, keys, best.prefix, best.family); name != "" {
		m.Arch, m.Exact = name, true
		g.Arch = name
	}
	return g, m, nil
}

var familyTitle = map[string]string{FamilyResNet: "ResNet", FamilyDenseNet: "DenseNet", FamilyVGG: "VGG with batch norm",
	FamilySegmentation: "FCN or DeepLabV3 with a ResNet backbone"}

// assumedPrefix starts the note that says which structure a state dict was
// given: the constructor defaults, which its keys cannot contradict.
const assumedPrefix = "structure assumed"

// assumed says, per family, what a state dict cannot hold and the
// recogniser takes from torchvision's constructor.
var assumed = map[string]string{
	FamilyResNet:   "stride 2 in conv1, maxpool and the first block of layer2-4, no dilation (replace_stride_with_dilation=None), 3x3 paddings 1, BN eps 1e-5 and momentum 0.1",
	FamilyDenseNet: "conv0 7x7 stride 2, pool0 3x3 stride 2, transitions AvgPool2d(2, 2), drop_rate 0, BN eps 1e-5 and momentum 0.1",
	FamilyVGG:      "3x3 convolutions with padding 1, MaxPool2d(2, 2), Dropout(0.5) in the classifier, BN eps 1e-5 and momentum 0.1",
	FamilySegmentation: "the backbone built with replace_stride_with_dilation=[False, True, True] as fcn_resnet50/101 and deeplabv3_resnet50/101 build it, ASPP rates 12, 24, 36, " +
		"bilinear resizing with align_corners=False, Dropout 0.1 (FCNHead) and 0.5 (ASPP), BN eps 1e-5 and momentum 0.1",
}

func assumedNote(family string) string {
	otherwise := "a dilated backbone, other strides"
	if family == FamilySegmentation {
		otherwise = "other dilations or ASPP rates, other strides"
	}
	return fmt.Sprintf("%s from torchvision's constructor defaults: %s; a state dict holds no strides, paddings or dilations, so a network built otherwise "+
		"(%s) has the same keys and shapes and would be converted wrongly: for anything else give the structure with "+
		"--graph model.onnx (torch.onnx.export with training=torch.onnx.TrainingMode.PRESERVE) or convert the whole pickled module (torch.save(model))", assumedPrefix, assumed[family], otherwise)
}

// build reads the state dict as family below prefix. Match.Arch is the
// description; the caller replaces it with a torchvision name if one fits.
func build(w graph.Weights, keys []string, family, prefix string) (*graph.Graph, *Match, error) {
	return buildFrom(w, keys, family, prefix, false)
}

// buildFrom is build; fromModule says a module tree will supply what a
// state dict cannot (the segmentation heads' ASPP rates).
func buildFrom(w graph.Weights, keys []string, family, prefix string, fromModule bool) (*graph.Graph, *Match, error) {
	b := newBuilder(w, keys, prefix)
	b.g = graph.New(family, 3)
	var (
		desc  string
		exact bool
		notes []string
		err   error
	)
	switch family {
	case FamilySegmentation:
		var sh *segShape
		if sh, err = buildSegmentation(b, fromModule); err == nil {
			desc, exact = sh.describe()
		}
	case FamilyResNet:
		var sh *resnetShape
		if sh, err = buildResNet(b); err == nil {
			desc = sh.describe()
		}
	case FamilyDenseNet:
		var sh *densenetShape
		if sh, err = buildDenseNet(b); err == nil {
			desc = sh.describe()
		}
	default:
		var sh *vggShape
		if sh, notes, err = buildVGG(b); err == nil {
			desc = sh.describe()
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("not a torchvision %s: %w", familyTitle[family], err)
	}
	if len(b.missing) > 0 {
		return nil, nil, fmt.Errorf("%s layout lacks %d keys: %s", familyTitle[family], len(b.missing), firstFew(b.missing, 8))
	}
	if extra := b.unused(keys); len(extra) > 0 {
		return nil, nil, fmt.Errorf("%d keys are not part of the %s layout: %s", len(extra), familyTitle[family], firstFew(extra, 8))
	}
	if err := b.g.Validate(); err != nil {
		return nil, nil, fmt.Errorf("built %s graph is invalid: %w", family, err)
	}
	m := &Match{Arch: desc, Family: family, Prefix: prefix, Exact: exact, Notes: b.notes()}
	m.Notes = append(m.Notes, notes...)
	m.Notes = append(m.Notes, fmt.Sprintf("num_classes %d", b.g.Output.Channels), assumedNote(family))
	switch {
	case family == FamilySegmentation && len(b.g.Aux) > 0:
		m.Notes = append(m.Notes, "the graph's outputs are the model's \"out\" and \"aux\" tensors (aux_loss=True: torchvision returns {\"out\": ..., \"aux\": ...}, and the emitted module the same dict)")
	case family == FamilySegmentation:
		m.Notes = append(m.Notes, "the graph's output is the model's \"out\" tensor (torchvision returns {\"out\": ...})")
	}
	b.g.Arch = desc
	return b.g, m, nil
}
