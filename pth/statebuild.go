package pth

import (
	"fmt"
	"io"
	"strconv"
)

// NewStateDict returns a checkpoint holding an empty state dict (an
// OrderedDict, as model.state_dict() returns), backed by no file: every
// tensor AddTensor adds is encoded when Write writes it. path names the
// checkpoint in messages. It is how a state dict read from another format
// (safetensors) is written as a .pth.
func NewStateDict(path string) *Checkpoint {
	c := &Checkpoint{Path: path, Format: FormatZip, storages: map[string]*Storage{}}
	d := NewDict(true)
	c.Root = d
	c.setState(d, []string{})
	return c
}

// AddTensor appends a contiguous tensor of the given dtype and shape with
// the given values, each in its own storage. Values the dtype cannot hold
// exactly are refused (see SetValues); so are keys already present.
func (c *Checkpoint) AddTensor(key string, dtype DType, shape []int, values []float64) error {
	if dtype == Complex64 || dtype == Complex128 {
		return fmt.Errorf("%s: tensor %q: dtype %q cannot be written from real numbers", c.Path, key, dtype)
	}
	t, err := c.newTensor(key, dtype, shape)
	if err != nil {
		return err
	}
	if err := c.SetTensorValues(t, values); err != nil {
		return fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	return c.addTensor(key, t)
}

// AddStreamedTensor appends a contiguous tensor whose bytes (row-major,
// little-endian, numel times the dtype's size) write streams into the
// output when the checkpoint is written: no tensor is held in memory (a
// .safetensors input written as .pth).
func (c *Checkpoint) AddStreamedTensor(key string, dtype DType, shape []int, write func(io.Writer) error) error {
	t, err := c.newTensor(key, dtype, shape)
	if err != nil {
		return err
	}
	t.stream = write
	return c.addTensor(key, t)
}

func (c *Checkpoint) newTensor(key string, dtype DType, shape []int) (*Tensor, error) {
	if c.state == nil || c.f != nil {
		return nil, fmt.Errorf("%s: adding tensors works on a checkpoint made by NewStateDict", c.Path)
	}
	if _, dup := c.state.Get(key); dup {
		return nil, fmt.Errorf("%s: tensor %q is added twice", c.Path, key)
	}
	if dtype.storageClass() == "" {
		return nil, fmt.Errorf("%s: tensor %q: dtype %q has no torch storage", c.Path, key, dtype)
	}
	for _, d := range shape {
		if d < 0 {
			return nil, fmt.Errorf("%s: tensor %q: shape %v has a negative dimension", c.Path, key, shape)
		}
	}
	sk := strconv.Itoa(len(c.storages))
	st := &Storage{Key: sk, DType: dtype, Numel: numelOf(shape), Location: "cpu", Class: &Global{Module: "torch", Name: dtype.storageClass()}}
	return &Tensor{Storage: st, Shape: append([]int{}, shape...), Stride: contiguousStride(shape)}, nil
}

func (c *Checkpoint) addTensor(key string, t *Tensor) error {
	c.storages[t.Storage.Key] = t.Storage
	if err := c.state.Set(key, t); err != nil {
		return err
	}
	c.keys = append(c.keys, key)
	return nil
}

func numelOf(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
