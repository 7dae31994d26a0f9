"""Normalisation layers (batch norm, its synchronised form, layer norm) keeping a compressed input."""
import torch


def batch_norm_train(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """Training-mode batch norm: (out, saved mean, saved inverse std, backend reserve or None).

    With an affine weight and running statistics (every ResNet's), PyTorch chooses the kernels as it does for
    ``nn.BatchNorm2d`` (``_batch_norm_with_update``: cuDNN on a GPU, the native kernels on a CPU); otherwise
    the native kernels. Calling the native kernels on a GPU too left DIVISION's batch norms 5-15x below the
    memory bandwidth (H200 profile, ResNet-50 batch 256: native batch-norm backward 18 % of the step)."""
    if weight is not None and running_mean is not None and running_var is not None:
        return torch.ops.aten._batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps)
    out, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                                         momentum, eps)
    return out, mean, invstd, None


def batch_norm_train_backward(grad, x, weight, running, save_mean, save_invstd, reserve, eps: float, mask):
    """The backward of :func:`batch_norm_train`, through the same backend (``running``: the running statistics
    the forward updated, which PyTorch's backend choice looks at)."""
    if reserve is not None:
        return torch.ops.aten.batch_norm_backward(grad, x, weight, running[0], running[1], save_mean, save_invstd,
                                                  True, eps, mask, reserve)
    return torch.ops.aten.native_batch_norm_backward(grad, x, weight, None, None, save_mean, save_invstd, True,
                                                     eps, mask)


class _BatchNorm2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, policy, layer):
        out, save_mean, save_invstd, reserve = batch_norm_train(x, weight, bias, running_mean, running_var,
                                                                momentum, eps)
        ctx.saved = policy.save_bn_input(x, layer)
        ctx.eps = eps
        ctx.x_dtype = x.dtype
        ctx.running = (running_mean, running_var)  # module buffers: held anyway, not saved tensors
        # cuDNN picks its mode (and the reserve's meaning) from the input's layout: backward must see the same
        ctx.layout = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last) else torch.contiguous_format
        ctx.save_for_backward(weight, bias, save_mean, save_invstd, *([reserve] if reserve is not None else []))
        policy.note_bn_output(out, ctx.saved, weight, bias, save_mean, save_invstd, layer)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, bias, save_mean, save_invstd, *reserve = ctx.saved_tensors
        x = ctx.saved.decode().to(ctx.x_dtype).contiguous(memory_format=ctx.layout)
        ctx.saved = None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        grad = grad.to(ctx.x_dtype).contiguous(memory_format=ctx.layout)
        gx, gw, gb = batch_norm_train_backward(grad, x, weight, ctx.running, save_mean,
                                               save_invstd, reserve[0] if reserve else None, ctx.eps, mask)
        return gx, gw, gb, None, None, None, None, None, None


class _SyncBatchNorm2dFn(torch.autograd.Function):
    """Batch norm over the union of all ranks' batches, keeping a compressed input.

    Forward gathers each rank's (count, mean, M2) in one collective and merges them with Chan's formula
    (exact, no sum-of-squares cancellation); backward all-reduces the two per-channel sums the input
    gradient needs. Weight and bias gradients stay local: DDP averages them, as it does for
    ``nn.SyncBatchNorm``. Works on any backend (gloo on CPU included), unlike PyTorch's own.
    """
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group, policy, layer):
        dims = (0, 2, 3)
        xf = x.float()
        count = x.numel() // x.shape[1]
        local_mean = xf.mean(dims)
        local_m2 = ((xf - local_mean[None, :, None, None]) ** 2).sum(dims)
        mine = torch.cat([local_mean.new_tensor([count]), local_mean, local_m2])
        world = torch.distributed.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine, group=group)
        stats = torch.stack(gathered)
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + x.shape[1]], stats[:, 1 + x.shape[1]:]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_((m2 / (total - 1).clamp(min=1)).to(running_var.dtype), momentum)
        scale = invstd if weight is None else invstd * weight.float()
        shift = -mean * scale if bias is None else bias.float() - mean * scale
        out = (xf * scale[None, :, None, None] + shift[None, :, None, None]).to(x.dtype)
        ctx.saved = policy.save(x, "bn", layer)
        param_dtype = next((p.dtype for p in (weight, bias) if p is not None), x.dtype)
        ctx.conf = (x.dtype, param_dtype, group, float(total), weight is not None, bias is not None)
        ctx.save_for_backward(weight, mean, invstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd = ctx.saved_tensors
        dtype, param_dtype, group, total, has_weight, has_bias = ctx.conf
        x = ctx.saved.decode().float()
        ctx.saved = None
        g = grad.float()
        xhat = (x - mean[None, :, None, None]) * invstd[None, :, None, None]
        del x
        local = torch.cat([g.sum((0, 2, 3)), (g * xhat).sum((0, 2, 3))])
        gw = local[mean.numel():].to(param_dtype) if has_weight and ctx.needs_input_grad[1] else None
        gb = local[:mean.numel()].to(param_dtype) if has_bias and ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            both = local.clone()  # gw and gb are views of ``local`` and must stay this rank's own
            torch.distributed.all_reduce(both, group=group)
            mean_g, mean_gxhat = (both / total).split(mean.numel())
            scale = invstd if weight is None else invstd * weight.float()
            gx = ((g - mean_g[None, :, None, None] - xhat * mean_gxhat[None, :, None, None])
                  * scale[None, :, None, None]).to(dtype)
        return gx, gw, gb, None, None, None, None, None, None, None


class _LayerNormFn(torch.autograd.Function):
    """Layer norm keeping its normalised input x_hat = (x - mean) * rstd, compressed, instead of x: every token
    is then at unit scale, so a codec whose ranges span several tokens (ActNN's groups) cannot swamp a quiet
    token, whose error backward would multiply by 1 / std (at initialisation a ViT's class token has std
    ~0.02). Backward is layer norm's own with mean 0 and rstd 1, then scaled by the true rstd."""

    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps, policy, layer):
        if torch.is_autocast_enabled(x.device.type):
            x = x.float()  # autocast runs layer norm in fp32
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.saved = policy.save((x - mean) * rstd, "ln", layer)
        ctx.shape = shape
        ctx.save_for_backward(weight, bias, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, bias, rstd = ctx.saved_tensors
        xhat = ctx.saved.decode()
        ctx.saved = None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad.to(xhat.dtype), xhat, ctx.shape, torch.zeros_like(rstd), torch.ones_like(rstd), weight, bias, mask)
        return None if gx is None else gx * rstd, None, gw, gb, None, None, None
