package emit

// inPlaceABNAdd is the Python helper that computes an InPlaceABN node with a
// residual (graph.Node.Residual): InPlaceABN(activation="identity") of x,
// plus the residual, as one autograd step written over x.
//
// Neither obvious spelling works. `y = iabn(x); y += r` overwrites the
// output InPlaceABN saved for its backward pass (autograd raises there), and
// `iabn(x) + r` keeps both y (saved by InPlaceABN) and the sum (saved by the
// next layer). The function below saves the sum instead of y and recovers y
// as sum - residual in backward; the residual is the block's input, which
// the block's first layer saves anyway.
//
// It is written in plain PyTorch so that it runs beside the real inplace_abn
// (v1.1.0) and the stand-in alike, and reproduces what v1.1.0's
// InPlaceABN.forward does with the module's state: num_batches_tracked
// counting and momentum=None's cumulative average, batch statistics in
// training (biased variance to normalise, unbiased for the running update),
// running statistics in eval, track_running_stats=False, affine=False, and
// the scale |weight| + eps.
const inPlaceABNAdd = `

def _inplace_abn_add(module, x, residual):
    """module(x) + residual, written over x and returned, for an
    inplace_abn.InPlaceABN module with activation "identity".

    Equal to inplace_abn's own forward followed by an out-of-place add, but
    kept for backward is the sum (with the residual and the per-channel
    statistics), not the normalised output: see _InPlaceABNAdd. x must be
    dead after the call (it is overwritten); residual is left as it is.
    """
    if module.activation != "identity":
        raise ValueError("_inplace_abn_add: activation %s cannot be recovered from the sum" % module.activation)
    # What InPlaceABN.forward does with the module's state, in its order:
    # count the batch, choose momentum (momentum=None: a cumulative average),
    # use batch statistics in training or when there are no running ones.
    momentum = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            momentum = 1.0 / float(module.num_batches_tracked)
    training = module.training or (module.running_mean is None and module.running_var is None)
    # In training without track_running_stats nothing is updated.
    keep = not module.training or module.track_running_stats
    running_mean = module.running_mean if keep else None
    running_var = module.running_var if keep else None
    if training and x.numel() // x.size(1) <= 1:
        raise ValueError("inplace_abn is trying to compute batch statistics, but the input "
                         "tensor only contains a single sample per channel")
    return _InPlaceABNAdd.apply(x, residual, module.weight, module.bias, running_mean, running_var,
                                training, momentum, module.eps)


class _InPlaceABNAdd(torch.autograd.Function):
    """z = (x - mean) / sqrt(var + eps) * (|weight| + eps) + bias + residual,
    written over x (N x C or N x C x ...); saves z, not the normalised output."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, running_mean, running_var, training, momentum, eps):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)  # a [C] vector broadcast over x
        count = x.numel() // x.size(1)
        if training:
            mean = x.mean(dims)
            var = (x - mean.view(shape)).pow(2).mean(dims)  # biased: normalises
            if running_mean is not None and running_var is not None:
                # Autograd is off in forward: these are plain buffer updates,
                # with the unbiased variance as inplace_abn keeps it.
                running_mean.mul_(1 - momentum).add_(momentum * mean)
                running_var.mul_(1 - momentum).add_(momentum * var * count / (count - 1))
        else:
            mean, var = running_mean, running_var
        invstd = torch.rsqrt(var + eps)
        gamma = x.new_ones(x.size(1)) if weight is None else weight.abs() + eps
        scale = gamma * invstd
        shift = -mean * scale if bias is None else bias - mean * scale
        x.mul_(scale.view(shape)).add_(shift.view(shape)).add_(residual)
        ctx.mark_dirty(x)
        # invstd, not var: in eval var is the running_var buffer, which a
        # later training step would update before this backward ran.
        ctx.save_for_backward(x, residual, weight, bias, invstd)
        ctx.training, ctx.eps, ctx.count = training, eps, count
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        z, residual, weight, bias, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, z.dim()))
        shape = [1, -1] + [1] * (z.dim() - 2)
        gamma = z.new_ones(z.size(1)) if weight is None else weight.abs() + ctx.eps
        # The layer's own output is the sum less the residual; then, as in
        # inplace_abn, the normalised input from it (identity: dy = dz).
        y = z - residual
        if bias is not None:
            y.sub_(bias.view(shape))
        xhat = y.div_(gamma.view(shape))
        sum_dy = dz.sum(dims)
        sum_xhat_dy = (xhat * dz).sum(dims)
        dx = dweight = dbias = None
        if ctx.needs_input_grad[0]:
            mult = (gamma * invstd).view(shape)
            if ctx.training:
                dx = (dz - (sum_dy / ctx.count).view(shape) - xhat * (sum_xhat_dy / ctx.count).view(shape)) * mult
            else:
                dx = dz * mult
        if weight is not None and ctx.needs_input_grad[2]:
            # d|w|/dw = sign(w), with w == 0 counted as positive.
            dweight = torch.where(weight < 0, -sum_xhat_dy, sum_xhat_dy)
        if bias is not None and ctx.needs_input_grad[3]:
            dbias = sum_dy
        dresidual = dz if ctx.needs_input_grad[1] else None
        return dx, dresidual, dweight, dbias, None, None, None, None, None
`
