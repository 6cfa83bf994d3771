package onnx

import (
	"errors"
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/output"
)

// Sentinel errors, for errors.Is. Every error this package returns names
// the file and, where there is one, the node or initializer it concerns.
var (
	// ErrMalformed: the file is not a valid ONNX model (truncated, sizes
	// that do not match the data, references to nothing, external data
	// outside the model's directory).
	ErrMalformed = errors.New("malformed ONNX model")
	// ErrUnsupported: valid ONNX that this package does not handle (opset
	// outside 9-21, a data type it cannot decode, a rewrite it cannot
	// express in ONNX). It carries the class failure.Unsupported, so the
	// command line exits with its code.
	ErrUnsupported = failure.As(failure.Unsupported, errors.New("unsupported ONNX model"))
	// ErrEvalExport: torch exported the model in eval mode and folded every
	// BatchNormalization into the Conv before it, so there is nothing left
	// to convert. See EvalExportError.
	ErrEvalExport = errors.New("eval-mode ONNX export: BatchNormalization folded into Conv")
	// ErrNothingToConvert: the network has no BatchNorm that InPlace-ABN
	// could replace (LayerNorm, GroupNorm or no normalisation at all, or
	// only FrozenBatchNorm2d). See NoBatchNormError.
	ErrNothingToConvert = errors.New("nothing to convert")
	// ErrOutputExists: Write would overwrite an existing file without
	// WriteOptions.Force.
	ErrOutputExists = output.ErrExists
	// ErrSameFile: Write was asked to overwrite the model it was read from,
	// or an external data file it reads.
	ErrSameFile = output.ErrInput
)

// EvalExportError says that a model was exported with
// training=TrainingMode.EVAL (torch's default), and how to re-export it.
type EvalExportError struct {
	Path string
	// Convs and BiasedConvs count Conv nodes, and those with a bias input.
	Convs, BiasedConvs int
	// BatchNorms counts BatchNormalization nodes left (those torch could not
	// fold, e.g. after a pooling layer); none of them follows a Conv.
	BatchNorms int
	// Folded counts Conv parameters named by torch's constant folding
	// ("onnx::Conv_123") rather than by a module path.
	Folded int
}

func (e *EvalExportError) Error() string {
	what := "no BatchNormalization node is left"
	if e.BatchNorms > 0 {
		what = fmt.Sprintf("none of its %d BatchNormalization nodes follows a Conv", e.BatchNorms)
	}
	folded := ""
	if e.Folded > 0 {
		folded = fmt.Sprintf(", %d Conv parameters carry constant-folding names (onnx::Conv_*)", e.Folded)
	}
	return fmt.Sprintf("%s: looks like an eval-mode export: %s, %d of %d Conv nodes have a bias%s, so torch folded each BatchNorm into the Conv before it and there is nothing to convert. "+
		"Re-export from the PyTorch model with torch.onnx.export(model, x, %q, training=torch.onnx.TrainingMode.PRESERVE) "+
		"(model in eval mode; BatchNormalization nodes are kept), or with do_constant_folding=False",
		e.Path, what, e.BiasedConvs, e.Convs, folded, e.Path)
}

func (e *EvalExportError) Unwrap() error { return ErrEvalExport }

// NoBatchNormError says that a network has no BatchNorm to convert: not
// an eval-mode export (its Conv parameters keep their module names, which
// torch's BatchNorm folding replaces by onnx::Conv_*), but a network
// normalised otherwise (ConvNeXt's LayerNorm, GroupNorm, NF-ResNet's
// weight standardisation, ViT) or by FrozenBatchNorm2d, whose fixed
// scale and shift torch exports as arithmetic on its buffers.
type NoBatchNormError struct {
	Path string
	// Norms counts the other normalisation nodes ("InstanceNormalization
	// x2"); Frozen lists the FrozenBatchNorm2d layers by module path.
	Norms  []string
	Frozen []string
	// Convs counts Conv nodes (none: no eval export could be the cause).
	Convs int
}

func (e *NoBatchNormError) Error() string {
	what := "it has no BatchNormalization node, and its Conv parameters keep their module names, so it is not an eval-mode export (which renames them onnx::Conv_*)"
	if e.Convs == 0 {
		what = "it has neither BatchNormalization nor Conv nodes"
	}
	if len(e.Norms) > 0 {
		what += "; its normalisation: " + strings.Join(e.Norms, ", ")
	}
	if len(e.Frozen) > 0 {
		what = fmt.Sprintf("its %d BatchNorm layer(s) are FrozenBatchNorm2d (frozen: nothing to convert; fixed statistics, exported as arithmetic on their buffers): %s", len(e.Frozen), strings.Join(e.Frozen, ", "))
	}
	return fmt.Sprintf("%s: nothing to convert: no BatchNorm for InPlace-ABN to replace: %s. Use the network as it is (InPlace-ABN only replaces BatchNorm + activation)", e.Path, what)
}

func (e *NoBatchNormError) Unwrap() error { return ErrNothingToConvert }
