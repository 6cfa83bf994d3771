// Package pth reads and writes PyTorch checkpoints (.pth, .pt) without
// executing them.
//
// Open reads torch.save's zip format (torch >= 1.6) and the legacy pickle
// format. The pickle is first walked opcode by opcode, without executing
// anything, to collect every global it references; any global outside the
// allowlist of torch.load(weights_only=True) refuses the file
// (*RefusedError) before decoding. Then gopickle's unpickler builds the
// object tree with hooks that call nothing: tensors become *Tensor values
// pointing into storage records whose bytes stay in the file until Values
// asks for them.
//
// AuditFile walks the pickles the same way for a security view, and each
// Release (torch 1.13, 2.6: their own opcode and global lists, embedded
// from weightsonly/) says whether its torch.load(weights_only=True) would
// accept the file and, if not, the first thing it refuses.
//
// A *Checkpoint implements graph.Weights over the state dict it holds
// (found at the top level or nested under "state_dict", "model"...; an
// AveragedModel's n_averaged is carried, not a weight). Write
// produces a zip archive laid out as torch.save lays it out, copying
// unchanged storages byte for byte and re-encoding changed tensors in their
// own dtype; TransformOptimizer keeps a stored optimizer state valid after
// the conversion flips channel signs.
//
// A Checkpoint is not safe for concurrent use.
package pth
