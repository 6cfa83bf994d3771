package pth

import "strings"

// allowedExact is the allowlist of torch.load(weights_only=True) in torch
// 1.13 (torch/_weights_only_unpickler.py, _get_allowed_globals), plus what
// torch 2.x added that a state-dict checkpoint can contain: torch.device,
// bytes (_codecs.encode), the newer tensor rebuild functions and tensor
// subclass wrapping (_rebuild_from_type_v2), all dtypes, the quantization
// schemes. torch 2.x's collections.Counter and builtins.set, bytearray and
// complex are left out: no state dict holds them, and this package has no
// representation for them.
var allowedExact = map[string]bool{
	"collections.OrderedDict":         true,
	"torch.nn.parameter.Parameter":    true,
	"torch.serialization._get_layout": true,
	"torch.Size":                      true,
	"torch.Tensor":                    true,
	// torch 1.13 rebuild functions.
	"torch._utils._rebuild_parameter":                     true,
	"torch._utils._rebuild_tensor":                        true,
	"torch._utils._rebuild_tensor_v2":                     true,
	"torch._utils._rebuild_sparse_tensor":                 true,
	"torch._utils._rebuild_meta_tensor_no_storage":        true,
	"torch._utils._rebuild_sparse_csr_tensor":             true,
	"torch._utils._rebuild_parameter_with_state":          true,
	"torch._utils._rebuild_qtensor":                       true,
	"torch._utils._rebuild_tensor_v3":                     true,
	"torch._utils._rebuild_wrapper_subclass":              true,
	"torch._utils._rebuild_device_tensor_from_numpy":      true,
	"torch._utils._rebuild_device_tensor_from_cpu_tensor": true,
	"torch._tensor._rebuild_from_type_v2":                 true,
	"torch.device":                                        true,
	"_codecs.encode":                                      true,
	"torch.storage.TypedStorage":                          true,
	"torch.storage.UntypedStorage":                        true,
	"torch.per_tensor_affine":                             true,
	"torch.per_tensor_symmetric":                          true,
	"torch.per_channel_affine":                            true,
	"torch.per_channel_symmetric":                         true,
	"torch.per_channel_affine_float_qparams":              true,
}

var (
	// Scalar types of the tensor and storage classes.
	classScalars = []string{"Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool"}
	// Extra storage classes (CPU only for the quantized ones).
	extraStorages = []string{"ComplexFloat", "ComplexDouble"}
	quantStorages = []string{"QUInt8", "QInt8", "QInt32", "QUInt4x2", "QUInt2x4"}
	dtypeNames    = []string{
		"float16", "float32", "float64", "bfloat16", "complex32", "complex64", "complex128",
		"int8", "int16", "int32", "int64", "uint8", "bool",
		"qint8", "quint8", "qint32", "quint4x2", "quint2x4",
		"uint16", "uint32", "uint64", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
		"float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
		"uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
		"int1", "int2", "int3", "int4", "int5", "int6", "int7",
	}
)

func init() {
	for _, s := range classScalars {
		for _, mod := range []string{"torch.", "torch.cuda.", "torch.sparse.", "torch.cuda.sparse."} {
			allowedExact[mod+s+"Tensor"] = true
		}
		allowedExact["torch."+s+"Storage"] = true
		allowedExact["torch.cuda."+s+"Storage"] = true
	}
	for _, s := range extraStorages {
		allowedExact["torch."+s+"Storage"] = true
		allowedExact["torch.cuda."+s+"Storage"] = true
	}
	for _, s := range quantStorages {
		allowedExact["torch."+s+"Storage"] = true
	}
	for _, d := range dtypeNames {
		allowedExact["torch."+d] = true
	}
}

// allowedGlobal reports whether torch.load(weights_only=True) accepts a
// global (see allowedExact). The modules torch blocks outright are refused
// whatever the name.
func allowedGlobal(name string) bool {
	for _, blocked := range []string{"sys.", "os.", "posix.", "nt."} {
		if strings.HasPrefix(name, blocked) {
			return false
		}
	}
	return allowedExact[name]
}
