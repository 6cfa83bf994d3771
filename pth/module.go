package pth

import (
	"archive/zip"
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"os"
	"sort"
	"strings"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
)

// Whole pickled modules (torch.save(model)) are read without executing
// anything: the pickle may reference, besides what torch.load(weights_only
// =True) accepts, only the module classes below and builtins.set (a
// module's set of non-persistent buffer names). An instance of an
// allowlisted class is rebuilt as data, a *Module holding the attributes,
// parameters, buffers and children the pickle sets on it; no class is
// imported and no __setstate__ runs.

// ModuleClasses lists the module classes a whole pickled module may use:
// torch.nn layers and torchvision model classes. Listing a class only lets
// its instances be read as data; package arch decides which of them it can
// turn into a graph, and refuses the others by name.
var ModuleClasses = []string{
	"torch.nn.modules.container.Sequential",
	"torch.nn.modules.conv.Conv2d",
	"torch.nn.modules.batchnorm.BatchNorm2d",
	"torch.nn.modules.activation.ReLU",
	"torch.nn.modules.activation.LeakyReLU",
	"torch.nn.modules.activation.ELU",
	"torch.nn.modules.pooling.MaxPool2d",
	"torch.nn.modules.pooling.AvgPool2d",
	"torch.nn.modules.pooling.AdaptiveAvgPool2d",
	"torch.nn.modules.flatten.Flatten",
	"torch.nn.modules.linear.Linear",
	"torch.nn.modules.linear.Identity",
	"torch.nn.modules.dropout.Dropout",
	"torch.nn.modules.container.ModuleList",
	"torch.nn.modules.activation.ReLU6",
	"torch.nn.modules.activation.Hardswish",
	"torch.nn.modules.activation.Hardsigmoid",
	"torch.nn.modules.activation.Sigmoid",
	"torch.nn.modules.activation.SiLU",
	"torch.nn.modules.activation.Tanh",
	"torch.nn.modules.activation.SELU",
	"torch.nn.modules.activation.CELU",
	"torch.nn.modules.activation.Softplus",
	"torch.nn.modules.activation.Mish",
	"torch.nn.modules.upsampling.Upsample",
	"torch.nn.modules.upsampling.UpsamplingNearest2d",
	"torch.nn.modules.upsampling.UpsamplingBilinear2d",
	"torchvision.models.resnet.ResNet",
	"torchvision.models.resnet.BasicBlock",
	"torchvision.models.resnet.Bottleneck",
	"torchvision.models.densenet.DenseNet",
	"torchvision.models.densenet._DenseBlock",
	"torchvision.models.densenet._DenseLayer",
	"torchvision.models.densenet._Transition",
	"torchvision.models.vgg.VGG",
	// Segmentation models: their backbones (ResNet, MobileNetV3 features)
	// wrapped in IntermediateLayerGetter, and their heads.
	"torchvision.models._utils.IntermediateLayerGetter",
	"torchvision.models.segmentation.fcn.FCN",
	"torchvision.models.segmentation.fcn.FCNHead",
	"torchvision.models.segmentation.deeplabv3.DeepLabV3",
	"torchvision.models.segmentation.deeplabv3.DeepLabHead",
	"torchvision.models.segmentation.deeplabv3.ASPP",
	"torchvision.models.segmentation.deeplabv3.ASPPConv",
	"torchvision.models.segmentation.deeplabv3.ASPPPooling",
	"torchvision.models.segmentation.lraspp.LRASPP",
	"torchvision.models.segmentation.lraspp.LRASPPHead",
	"torchvision.models.mobilenetv3.MobileNetV3",
	"torchvision.models.mobilenetv3.InvertedResidual",
	"torchvision.ops.misc.Conv2dNormActivation",
	"torchvision.ops.misc.SqueezeExcitation",
	// The other BatchNorm classification networks of torchvision 0.14.
	"torchvision.models.mobilenetv2.MobileNetV2",
	"torchvision.models.mobilenetv2.InvertedResidual",
	"torchvision.models.efficientnet.EfficientNet",
	"torchvision.models.efficientnet.MBConv",
	"torchvision.models.efficientnet.FusedMBConv",
	"torchvision.ops.stochastic_depth.StochasticDepth",
	"torchvision.models.regnet.RegNet",
	"torchvision.models.regnet.SimpleStemIN",
	"torchvision.models.regnet.AnyStage",
	"torchvision.models.regnet.ResBottleneckBlock",
	"torchvision.models.regnet.BottleneckTransform",
	"torchvision.models.shufflenetv2.ShuffleNetV2",
	"torchvision.models.shufflenetv2.InvertedResidual",
	"torchvision.models.mnasnet.MNASNet",
	"torchvision.models.mnasnet._InvertedResidual",
	"torchvision.models.googlenet.GoogLeNet",
	"torchvision.models.googlenet.BasicConv2d",
	"torchvision.models.googlenet.Inception",
	"torchvision.models.googlenet.InceptionAux",
	"torchvision.models.inception.Inception3",
	"torchvision.models.inception.BasicConv2d",
	"torchvision.models.inception.InceptionA",
	"torchvision.models.inception.InceptionB",
	"torchvision.models.inception.InceptionC",
	"torchvision.models.inception.InceptionD",
	"torchvision.models.inception.InceptionE",
	"torchvision.models.inception.InceptionAux",
}

var moduleClass = map[string]bool{}

func init() {
	for _, c := range ModuleClasses {
		moduleClass[c] = true
	}
}

const builtinSet = "builtins.set"

// allowedInModule reports whether a whole pickled module may reference a
// global.
func allowedInModule(name string) bool {
	return allowedGlobal(name) || moduleClass[name] || name == builtinSet
}

// LooksLikeModule reports whether a pickle's globals are those of a whole
// pickled module (it references torch.nn or torchvision module classes),
// which Open refuses and OpenModule reads.
func LooksLikeModule(globals []string) bool {
	for _, g := range globals {
		if strings.HasPrefix(g, "torch.nn.modules.") || strings.HasPrefix(g, "torchvision.models.") {
			return true
		}
	}
	return false
}

// ModuleRefusedError reports a whole pickled module that references
// globals outside ModuleClasses and the weights_only allowlist. Nothing of
// it was executed or decoded.
type ModuleRefusedError struct {
	File    string
	Refused []string
	Globals []string
}

func (e *ModuleRefusedError) Error() string {
	return fmt.Sprintf("%s: this whole pickled module references %s, which is neither an allowlisted torch.nn or torchvision module class nor anything torch.load(weights_only=True) accepts; "+
		"abnconvert runs no code from a checkpoint, so it rebuilds only allowlisted classes: for a custom network, export it with torch.onnx.export(model, x, \"model.onnx\", training=torch.onnx.TrainingMode.PRESERVE), "+
		"save torch.save(model.state_dict(), \"model.pth\"), and convert that with --graph model.onnx",
		e.File, strings.Join(e.Refused, ", "))
}

// Module is one module of a whole pickled network, rebuilt as data.
type Module struct {
	// Class is the module's class, "torch.nn.modules.conv.Conv2d".
	Class string
	// Attrs holds the instance attributes that are plain data (numbers,
	// strings, booleans, None, tuples, lists and dicts of them), by name.
	Attrs map[string]Value
	// Opaque names, sorted, the other instance attributes (hook dicts,
	// class references such as ResNet's _norm_layer), which are not kept:
	// a reader that must understand every attribute that changes the
	// computation refuses a public one it does not know.
	Opaque []string
	// Params and Buffers are the module's own tensors in registration
	// order; None entries and non-persistent buffers are left out.
	Params  []NamedTensor
	Buffers []NamedTensor
	// Children are the submodules in registration order (None left out).
	Children []Child
}

// NamedTensor is a parameter or buffer of a Module.
type NamedTensor struct {
	Name   string
	Tensor *Tensor
}

// Child is a named submodule.
type Child struct {
	Name   string
	Module *Module
}

// Attr returns an attribute, nil when absent.
func (m *Module) Attr(name string) Value { return m.Attrs[name] }

// ShortClass is the class name without its module ("Conv2d").
func (m *Module) ShortClass() string { return m.Class[strings.LastIndexByte(m.Class, '.')+1:] }

// OpenModule reads a whole pickled module (torch.save(model), zip format).
// It returns the module tree and a *Checkpoint whose state dict is the one
// model.state_dict() would give (same keys, same order, the tensors'
// bytes still in the file), so that conversion and Write work on it as on
// any state-dict checkpoint; Write then writes that state dict alone.
func OpenModule(path string) (*Checkpoint, *Module, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	c := &Checkpoint{Path: path, f: f, stat: st, storages: map[string]*Storage{}}
	m, err := c.loadModule()
	if err != nil {
		f.Close()
		var re *ModuleRefusedError
		if errors.As(err, &re) {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, m, nil
}

func (c *Checkpoint) loadModule() (*Module, error) {
	format, err := c.detect()
	if err != nil {
		return nil, err
	}
	if format != FormatZip {
		// The legacy format pickles a module's source code alongside it
		// (persistent ids of kind "module"); there is nothing to gain from
		// reading that.
		return nil, errors.New("whole pickled modules are read from torch.save's zip format (torch >= 1.6) only; re-save the model, or its state_dict")
	}
	c.Format = format
	a, err := c.openZip()
	if err != nil {
		return nil, err
	}
	if a.record("version") == nil {
		return nil, fmt.Errorf("archive has no %sversion record", a.prefix)
	}
	res, err := a.readPickle(nil)
	c.Globals = res.globals
	if err != nil {
		return nil, err
	}
	var bad []string
	for _, g := range res.globals {
		if !allowedInModule(g) {
			bad = append(bad, g)
		}
	}
	if len(bad) > 0 {
		return nil, &ModuleRefusedError{File: c.Path, Refused: bad, Globals: res.globals}
	}
	if res.dupKey != nil {
		return nil, fmt.Errorf("%sdata.pkl: %w", a.prefix, res.dupKey)
	}
	u := &unpickler{storages: c.storages, resolve: c.zipStorage(a)}
	raw, err := u.runWith(res.data, func(module, name string) (any, error) {
		full := normalizeGlobal(module, name)
		switch {
		case moduleClass[full]:
			return &modClass{name: full}, nil
		case full == builtinSet:
			return setClass{}, nil
		}
		return u.findClass(module, name)
	})
	if err != nil {
		return nil, fmt.Errorf("%sdata.pkl: %w", a.prefix, err)
	}
	root, ok := raw.(*modObject)
	if !ok {
		return nil, fmt.Errorf("%sdata.pkl holds a %T, not a module", a.prefix, raw)
	}
	budget := maxModules
	m, err := buildModule(root, map[*modObject]bool{}, 0, &budget)
	if err != nil {
		return nil, err
	}
	sd := NewDict(true)
	if err := stateOf(m, "", sd, map[*Tensor]*Tensor{}); err != nil {
		return nil, err
	}
	c.Root = sd
	c.setState(sd, []string{})
	return m, nil
}

// zipStorage resolves a persistent id to its record in the archive, for
// Open (state dicts) and for whole pickled modules.
func (c *Checkpoint) zipStorage(a *archive) storageResolver {
	return func(key string, dtype DType, numel int, loc string, class *Global) (*Storage, error) {
		zf := a.record("data/" + key)
		if zf == nil {
			return nil, fmt.Errorf("storage %q has no record %sdata/%s", key, a.prefix, key)
		}
		st := &Storage{Key: key, DType: dtype, Numel: numel, Location: loc, Class: class}
		st.rec = record{name: zf.Name, size: int64(zf.UncompressedSize64), crc: zf.CRC32, hasCRC: true}
		if zf.Method == zip.Store {
			off, err := a.dataOffset(zf)
			if err != nil {
				return nil, fmt.Errorf("record %s: %w", zf.Name, err)
			}
			if zf.CompressedSize64 != zf.UncompressedSize64 || off < 0 || off+st.rec.size > c.stat.Size() {
				return nil, fmt.Errorf("record %s lies outside the file", zf.Name)
			}
			st.rec.offset = off
		} else {
			st.rec.zf = zf
		}
		if err := st.checkSize(); err != nil {
			return nil, err
		}
		return st, nil
	}
}

// runWith is run with another class resolver; gopickle panics on some
// malformed inputs, which recover turns into errors.
func (u *unpickler) runWith(data []byte, find func(module, name string) (any, error)) (raw any, err error) {
	defer func() {
		if r := recover(); r != nil {
			raw, err = nil, fmt.Errorf("malformed pickle: %v", r)
		}
	}()
	if u.storages == nil {
		u.storages = map[string]*Storage{}
	}
	p := pickle.NewUnpickler(bytes.NewReader(data))
	p.FindClass = find
	p.PersistentLoad = u.persistentLoad
	raw, err = p.Load()
	if err != nil {
		if err == u.contentErr {
			return nil, err
		}
		return nil, fmt.Errorf("malformed pickle: %w", err)
	}
	return raw, nil
}

// modClass is an allowlisted module class: NEWOBJ makes an empty instance,
// which BUILD fills.
type modClass struct{ name string }

func (c *modClass) PyNew(args ...any) (any, error) {
	if len(args) != 0 {
		return nil, fmt.Errorf("%s.__new__ with %d arguments", c.name, len(args))
	}
	return &modObject{class: c.name, dict: map[string]any{}}, nil
}

// modObject is an instance of an allowlisted module class.
type modObject struct {
	class string
	dict  map[string]any
}

func (o *modObject) PyDictSet(k, v any) error {
	name, ok := k.(string)
	if !ok {
		return fmt.Errorf("%s: attribute name %v is not a string", o.class, k)
	}
	if _, dup := o.dict[name]; dup {
		return fmt.Errorf("%s: attribute %q is set twice", o.class, name)
	}
	o.dict[name] = v
	return nil
}

// setClass is builtins.set: set(iterable) rebuilt as a pySet.
type setClass struct{}

type pySet struct{ items []any }

func (setClass) Call(args ...any) (any, error) {
	if len(args) > 1 {
		return nil, fmt.Errorf("set() with %d arguments", len(args))
	}
	s := &pySet{}
	if len(args) == 1 {
		l, ok := args[0].(*types.List)
		if !ok {
			return nil, fmt.Errorf("set() of %T, not a list", args[0])
		}
		s.items = append(s.items, *l...)
	}
	return s, nil
}

// maxModuleDepth bounds module nesting (a hostile pickle could nest
// without end). maxModules bounds the modules built in all: the pickle memo
// lets one module object appear under many names at every level, and the
// tree is built path by path, so without a bound a few hundred bytes could
// describe 30^12 modules. maxAttrItems does the same for the items of one
// attribute (tuples sharing tuples).
const (
	maxModuleDepth = 200
	maxModules     = 1 << 16
	maxAttrItems   = 1 << 12
)

func buildModule(o *modObject, busy map[*modObject]bool, depth int, budget *int) (*Module, error) {
	if depth > maxModuleDepth {
		return nil, fmt.Errorf("modules nested deeper than %d levels", maxModuleDepth)
	}
	if *budget--; *budget < 0 {
		return nil, fmt.Errorf("the module tree has more than %d modules", maxModules)
	}
	if busy[o] {
		return nil, fmt.Errorf("module %s contains itself", o.class)
	}
	busy[o] = true
	defer delete(busy, o)
	m := &Module{Class: o.class, Attrs: map[string]Value{}}
	nonPersistent := map[string]bool{}
	if s, ok := o.dict["_non_persistent_buffers_set"].(*pySet); ok {
		for _, it := range s.items {
			if n, ok := it.(string); ok {
				nonPersistent[n] = true
			}
		}
	}
	names := make([]string, 0, len(o.dict))
	for k := range o.dict {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := o.dict[k]
		switch k {
		case "_parameters", "_buffers", "_modules":
			entries, err := ordered(v)
			if err != nil {
				return nil, fmt.Errorf("%s.%s: %w", o.class, k, err)
			}
			for _, e := range entries {
				name, ok := e.Key.(string)
				if !ok || name == "" || strings.Contains(name, ".") {
					return nil, fmt.Errorf("%s.%s: entry name %v is not a plain attribute name", o.class, k, e.Key)
				}
				if e.Value == nil {
					continue
				}
				if k == "_modules" {
					child, ok := e.Value.(*modObject)
					if !ok {
						return nil, fmt.Errorf("%s: child %q is a %T, not a module", o.class, name, e.Value)
					}
					cm, err := buildModule(child, busy, depth+1, budget)
					if err != nil {
						return nil, fmt.Errorf("%s: %w", name, err)
					}
					m.Children = append(m.Children, Child{name, cm})
					continue
				}
				t, ok := e.Value.(*Tensor)
				if !ok {
					return nil, fmt.Errorf("%s: %s %q is a %T, not a tensor", o.class, k[1:len(k)-1], name, e.Value)
				}
				if k == "_parameters" {
					m.Params = append(m.Params, NamedTensor{name, t})
				} else if !nonPersistent[name] {
					m.Buffers = append(m.Buffers, NamedTensor{name, t})
				}
			}
		default:
			items := maxAttrItems
			if a, ok := plainAttr(v, 0, &items); ok {
				m.Attrs[k] = a
			} else {
				m.Opaque = append(m.Opaque, k)
			}
		}
	}
	return m, nil
}

// ordered lists a dict's entries in insertion order.
func ordered(v any) ([]types.DictEntry, error) {
	switch d := v.(type) {
	case *types.OrderedDict:
		var out []types.DictEntry
		for e := d.List.Front(); e != nil; e = e.Next() {
			entry := e.Value.(*types.OrderedDictEntry)
			out = append(out, types.DictEntry{Key: entry.Key, Value: entry.Value})
		}
		return out, nil
	case *types.Dict:
		return *d, nil
	}
	return nil, fmt.Errorf("a %T, not a dict", v)
}

// plainAttr converts an attribute that is plain data; ok is false for
// anything else (hook dicts, class references), which the IR never needs,
// and for attributes of more than budget items.
func plainAttr(v any, depth int, budget *int) (Value, bool) {
	if depth > 8 {
		return nil, false
	}
	if *budget--; *budget < 0 {
		return nil, false
	}
	switch v := v.(type) {
	case nil, bool, float64, string:
		return v, true
	case int:
		return int64(v), true
	case *big.Int:
		if v.IsInt64() {
			return v.Int64(), true
		}
		return nil, false
	case *types.Tuple:
		t := &Tuple{}
		for _, it := range *v {
			a, ok := plainAttr(it, depth+1, budget)
			if !ok {
				return nil, false
			}
			t.Items = append(t.Items, a)
		}
		return t, true
	case *types.List:
		l := &List{}
		for _, it := range *v {
			a, ok := plainAttr(it, depth+1, budget)
			if !ok {
				return nil, false
			}
			l.Items = append(l.Items, a)
		}
		return l, true
	case *types.Dict:
		// IntermediateLayerGetter.return_layers: {"layer4": "out", ...}.
		d := NewDict(false)
		for _, e := range *v {
			k, ok1 := plainAttr(e.Key, depth+1, budget)
			a, ok2 := plainAttr(e.Value, depth+1, budget)
			if !ok1 || !ok2 || d.Set(k, a) != nil {
				return nil, false
			}
		}
		return d, true
	}
	return nil, false
}

// stateOf adds m's tensors to sd under prefix, in the order
// model.state_dict() gives them: the module's parameters, its persistent
// buffers, then each child's. The tensors are plain tensors, as
// state_dict() returns them (parameters detached).
func stateOf(m *Module, prefix string, sd *Dict, copies map[*Tensor]*Tensor) error {
	add := func(nt NamedTensor) error {
		key := prefix + nt.Name
		if _, dup := sd.Get(key); dup {
			return fmt.Errorf("state dict key %q is produced twice", key)
		}
		t := copies[nt.Tensor]
		if t == nil {
			c := *nt.Tensor
			c.Param, c.ParamRequiresGrad, c.RequiresGrad = false, false, false
			t = &c
			copies[nt.Tensor] = t
		}
		return sd.Set(key, t)
	}
	for _, p := range m.Params {
		if err := add(p); err != nil {
			return err
		}
	}
	for _, b := range m.Buffers {
		if err := add(b); err != nil {
			return err
		}
	}
	for _, ch := range m.Children {
		if err := stateOf(ch.Module, prefix+ch.Name+".", sd, copies); err != nil {
			return err
		}
	}
	return nil
}
