package runtime

// MemoryReport is what one forward pass (and the backward pass after it)
// allocated, measured by the backend's allocator. Parameters and running
// statistics are resident before and after the step; they are reported in
// ParamBytes and left out of every other figure, as PyTorch's saved-tensor
// hooks leave them out (the figures count from what the backend held when
// the forward pass started, so a backend may be shared by executors used one
// at a time). Scratch space a backend uses inside one op (the CPU backend's
// im2col and packing buffers) is not counted.
type MemoryReport struct {
	Backend    string `json:"backend"`
	Training   bool   `json:"training"`
	InputShape []int  `json:"input_shape"`
	// SavedBytes is what is allocated at the end of the forward pass: the
	// distinct tensors kept for backward (a storage shared by several
	// values, such as a convolution's input that is also the in-place
	// activation's result, counts once), and DenseNet shared buffers. 0 when
	// the forward kept nothing for backward.
	SavedBytes int64 `json:"saved_bytes"`
	// PeakBytes is the most allocated at once over the forward pass and,
	// when one ran, the backward pass, gradients of parameters included.
	PeakBytes  int64 `json:"peak_bytes"`
	ParamBytes int64 `json:"param_bytes"`
	// Layers lists the nodes in forward order.
	Layers []LayerMemory `json:"layers"`
}

// LayerMemory is one node's share.
type LayerMemory struct {
	Node string `json:"node"`
	Op   string `json:"op"`
	// SavedBytes are the bytes this node keeps for backward that no earlier
	// node keeps; they sum to the report's SavedBytes.
	SavedBytes int64 `json:"saved_bytes"`
	// LiveBytes is what is allocated after the node's forward step, and
	// BackwardLiveBytes after its backward step.
	LiveBytes         int64 `json:"live_bytes"`
	BackwardLiveBytes int64 `json:"backward_live_bytes,omitempty"`
}
