"""Speed and memory wrappers a method's train() puts around a loss or the encoder, beneath run/__init__.py; the loss
itself stays the plain function its file shows. fused: --compile's torch.compile (with its backward one sweep per input
where torch's own would write a (a, b, V) gradient out), eager on a failed compile in one line; compiled_encoder: the
same for the encoder's forward; in_row_chunks: the same values computed a chunk of rows at a time under
checkpointing; pad_rows: a few fixed shapes for a varying count."""
import functools
import time

import torch

from run import ranks

_FUSED = {}   # loss function -> its compiled form (one per process: torch.compile's cache is per function object)


def fused(loss, c, eager=None, sweep_per_input=False):
    """`loss` as training runs it. With --compile: torch.compile(loss), one fused kernel per sweep over the vocabulary
    where eager makes a memory pass per operation (sweep_per_input: the backward too, one sweep per input); a failed
    compile says so in one line and stays eager. Without it: `eager` (the loss in less memory), or `loss`."""
    if not c.compile:
        return eager or loss
    if loss not in _FUSED:
        _FUSED[loss] = _compiled_or_eager(loss, eager or loss, compiled_per_input if sweep_per_input else torch.compile)
    return _FUSED[loss]


def compiled_per_input(loss):
    """torch.compile(loss), its backward one compiled sweep per input (torch.func.vjp in that input alone, eager if
    that fails). For a loss that broadcasts a (a, V) against b (b, V) (cpdae.js_similarity) torch.compile's own
    backward writes the (a, b, V) gradient out and reads it once per input (250 MB a step at CPDAE's default)."""
    forward = torch.compile(loss)

    @functools.cache
    def grad_of(i):
        def vjp(grad, inputs, kwargs):
            return torch.func.vjp(lambda x: loss(*inputs[:i], x, *inputs[i + 1:], **kwargs), inputs[i])[1](grad)[0]
        vjp.__name__ = f"{loss.__name__}'s backward in input {i}"
        return _compiled_or_eager(vjp, vjp, torch.compile)

    class SweepPerInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, kwargs, *inputs):
            ctx.kwargs = kwargs
            ctx.save_for_backward(*inputs)
            return forward(*inputs, **kwargs)

        @staticmethod
        def backward(ctx, grad):
            inputs, wanted = ctx.saved_tensors, ctx.needs_input_grad[1:]
            return None, *(grad_of(i)(grad, inputs, ctx.kwargs) if wanted[i] else None for i in range(len(inputs)))

    return lambda *inputs, **kwargs: SweepPerInput.apply(kwargs, *inputs)


def compiled_encoder(encoder, c):
    """encoder.forward as training runs it. With --compile: torch.compile(encoder.forward), each block's elementwise
    work (dropout, GELU, LayerNorm, the attention's mask and softmax) fused beside its matmuls, forward and backward.
    The module stays itself, only its forward is replaced, so its state_dict keys (checkpoints, resume, the Hugging
    Face folder) are eager's; a second batch length compiles once more, that length dynamic (dynamo's default), and
    none after; a failed compile: one line, eager. Without --compile: its own forward."""
    if not c.compile:
        return encoder.forward
    # fallback_random: dropout masks from torch's generator, as eager draws them (not inductor's in-kernel one), so
    # that a compiled step is eager's step and dropout stays a function of the step's seed (exact resume)
    compile = functools.partial(torch.compile, options={"fallback_random": True})
    return _compiled_or_eager(encoder.forward, encoder.forward, compile, name="the encoder")


def _compiled_or_eager(loss, eager, compile, name=None):
    """compile(loss), timing its first call (its compile; torch.compile's own backward compiles at the first
    backward); any error there (no C++ compiler, an unsupported platform) -> one line, and eager from then on."""
    compiled, state, name = compile(loss), {"first": True, "failed": False}, name or loss.__name__

    @functools.wraps(loss)
    def call(*args, **kwargs):
        if state["failed"]:
            return eager(*args, **kwargs)
        if not state["first"]:
            return compiled(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:   # noqa: BLE001 (any compiler failure: the run goes on eager)
            state["failed"] = True
            say = f"--compile: {name} not compiled ({type(e).__name__}: {str(e).splitlines()[0][:160]}); eager"
            ranks._rank() == 0 and print(say, flush=True)
            return eager(*args, **kwargs)
        state["first"] = False
        ranks._rank() == 0 and print(f"--compile: {name} compiled in {time.perf_counter() - t0:.1f} s "
                               f"(its first call; later shapes may compile once more)", flush=True)
        return out
    return call


def in_row_chunks(fn, chunk):
    """fn(x, *rest) computed `chunk` rows of x at a time, each under activation checkpointing, the outputs (or
    each of a tuple of them) concatenated: the same values for a fn whose rows are independent, the peak memory
    one chunk's. Eager mode's memory bound on the vocabulary terms."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def chunked(x, *rest, **kwargs):
        grad = torch.is_grad_enabled()
        parts = [checkpoint(fn, part, *rest, use_reentrant=False, **kwargs) if grad else fn(part, *rest, **kwargs)
                 for part in x.split(chunk)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column) for column in zip(*parts))
        return torch.cat(parts)
    return chunked


def pad_rows(rows, targets, bucket, ignore_index=-100):
    """rows (N, ...) and targets (N,) padded with zero rows and ignore_index targets to a multiple of `bucket`: a
    loss over a varying number of kept positions sees a few fixed shapes (no new kernel, no recompile, per count)
    and, ignoring ignore_index and dividing by the targets it keeps, is unchanged."""
    extra = -rows.shape[0] % bucket
    if not extra:
        return rows, targets
    return (torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])]),
            torch.cat([targets, targets.new_full((extra,), ignore_index)]))



def padded_rows(loss, bucket):
    """loss(rows, weight, targets) on rows and targets padded to a multiple of `bucket` (pad_rows): the same values
    for a loss that ignores -100 targets and averages over the rest, a few shapes for a compiled kernel."""
    @functools.wraps(loss)
    def padded(rows, weight, targets):
        rows, targets = pad_rows(rows, targets, bucket)
        return loss(rows, weight, targets)
    return padded
