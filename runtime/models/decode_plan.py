"""Few-row decode on the CPU straight through the C kernels, without the module tree.

At batch 1 the weights take about half of a step; most of the rest was Python: every layer
went through a dozen module calls, tensor checks, conversions and allocations around its
nine C kernel calls. A `DecodePlan` holds, per layer, the kernels' arguments (weight
pointers, shapes, the layer's rotary table and attention window) and runs a decode step as
those nine calls per layer on buffers allocated once per step; where every row wants its
logits, the same call ends with the final norm and a quantized output projection (`logits`,
whose buffers are kept from step to step). The calls and their inputs are the module path's,
so the results are identical.

It applies to the plain Llama-shaped decoder only (`DecoderLayer`, `Attention` with full
rotary, `MLP`, `RMSNorm`, quantized linear layers), in float32 on the CPU, with the native
backend's C decode attention, to all-decode batches (their linear layers through the kernel
`cpu_quant_ops.linear` picks for the row count), and when no
module has hooks (the step breakdown of `spruce bench offline` times the modules, so it
sees the module path). Anything else goes through the modules as before.

The layer loop itself runs in C (cpu_decode_step.c: one ctypes call a step instead of nine
a layer); rows of one request (speculative drafts) are served too, as the attention kernel
stores every row's K/V before any row attends.
"""

from __future__ import annotations

import ctypes
import operator
from typing import NamedTuple

import torch
from torch import nn

from spruce.runtime.executor.kernels import cpu_quant_ops
from spruce.runtime.executor.kernels.cpu_attention import scale_pointers
from spruce.runtime.executor.kernels.cpu_library import load_library


class PlainKinds(NamedTuple):
    """The module classes of the plain decoder (layers.py passes its own: no import back)."""

    layer: type
    attention: type
    rotary: type
    mlp: type
    norm: type
    linear: type


def build(model: nn.Module, kinds: PlainKinds) -> DecodePlan | None:
    """The plan for `model`, or None when its layers are not the plain kind."""
    if not model.layers:
        return None
    for layer in model.layers:
        # the kinds first, before reading their parts: other kinds lack them
        if type(layer) is not kinds.layer or type(layer.self_attn) is not kinds.attention:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (type(layer.input_layernorm), type(layer.post_attention_layernorm))
        if (type(attn.rotary), type(mlp), *norms) != (
            kinds.rotary,
            kinds.mlp,
            kinds.norm,
            kinds.norm,
        ):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (
            any(type(m) is not kinds.linear for m in linears)
            or attn.rotary.dim != model.config.head_dim
        ):
            return None
        bias = attn.qkv_proj.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        if any(m.bias is not None for m in linears[1:]) or attn.rotary.cos is None:
            return None
        if not (attn.rotary.cos.is_contiguous() and attn.rotary.sin.is_contiguous()):
            return None
    if load_library() is None:  # last: the kinds above rule out other models without building it
        return None
    return DecodePlan(model, kinds)


def _tensors(model: nn.Module):
    """Every tensor a plan points into, as (the dict its module holds it in, its name)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            yield norm._parameters, "weight"
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            yield m._buffers, "blocks"
        yield attn.rotary.__dict__, "cos"
        yield attn.rotary.__dict__, "sin"
        yield (
            attn.qkv_proj.__dict__
            if "bias" in attn.qkv_proj.__dict__
            else attn.qkv_proj._parameters,
            "bias",
        )


def _linear_args(m: nn.Module) -> tuple:
    """spruce_quant_linear's arguments before x: type, blocks, n, k."""
    return (
        cpu_quant_ops.QUANT_TYPES[m.qtype].ggml_id,
        m.blocks.data_ptr(),
        m.out_features,
        m.in_features,
    )


_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KERNEL_TYPES = 32  # the C side's table of kernels by ggml type id
KERNEL_CODES = {"integer": 0, "igemm": 1, "gemm": 2}
CACHE_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}


class StepLayer(ctypes.Structure):
    """cpu_decode_step.c's step_layer: one layer's weights (QKV, O, gate/up, down) and cache."""

    _fields_ = [
        ("norm", _P * 2), ("eps", _F32 * 2), ("type", _I64 * 4), ("weight", _P * 4),
        ("n", _I64 * 4), ("k", _I64 * 4), ("qkv_bias", _P), ("cos", _P), ("sin", _P),
        ("k_cache", _P), ("v_cache", _P), ("k_scale", _P), ("v_scale", _P), ("window", _I64),
    ]  # fmt: skip


class StepArgs(ctypes.Structure):
    """cpu_decode_step.c's step_args: the step's buffers, shapes and batch."""

    _fields_ = (
        [(name, _P) for name in ("residual", "h", "out", "qkv", "attn", "gate_up", "act")]
        + [(name, _I64) for name in ("rows", "hidden", "q_size", "kv_size", "heads")]
        + [(name, _I64) for name in ("kv_heads", "head_dim", "inter", "isa")]
        + [(name, _P) for name in ("positions", "slots", "table_rows", "seq_lens", "table")]
        + [("table_stride", _I64), ("scale", _F32), ("cache_kind", _I64)]
        + [("kernel", ctypes.c_int8 * KERNEL_TYPES)]
        + [("final_norm", _P), ("final_eps", _F32), ("head_type", _I64), ("vocab", _I64)]
        + [("head", _P), ("logits", _P)]
    )


def layout(struct: type[ctypes.Structure]) -> list[int]:
    """The struct's size, then its fields' offsets in order."""
    return [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]


def check_layout(lib: ctypes.CDLL) -> None:
    """Raises when StepLayer / StepArgs do not lie as cpu_decode_step.c's structs do (a field
    added to one side only); a plan checks before it runs any step."""
    expected = layout(StepLayer) + layout(StepArgs)
    out = (ctypes.c_int64 * (len(expected) + 8))()
    found = list(out[: lib.spruce_step_layout(out)])
    if found != expected:
        raise RuntimeError(
            f"cpu_decode_step.c's step structs {found} differ from decode_plan's {expected}"
        )


def _head(model: nn.Module, kinds: PlainKinds) -> tuple[nn.Module, nn.Module] | None:
    """(final norm, output projection) when the step can end with them in C: the plain
    norm and a quantized projection without bias (tied: the embedding table); else None."""
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    if type(model.norm) is not kinds.norm or not isinstance(head, kinds.linear):
        return None
    return None if head.bias is not None else (model.norm, head)


class DecodePlan:
    def __init__(self, model: nn.Module, kinds: PlainKinds) -> None:
        c = model.config
        self.config = c
        self.lib = load_library()
        check_layout(self.lib)
        self.qkv_width = c.q_size + 2 * c.kv_size
        self.inter = model.layers[0].mlp.down_proj.in_features
        self.head = _head(model, kinds)
        if self.head is not None:  # StepArgs' final_norm, final_eps, head_type, head, vocab
            norm, head = self.head
            self.head_args = (norm.weight.data_ptr(), norm.eps, *_linear_args(head)[:3])
        modules = [m for layer in model.layers for m in layer.modules()]
        modules += self.head or ()
        # a module keeps its hook dicts for life (register_forward_hook adds to them)
        self.hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.layers = []
        self.qtypes = {self.head[1].qtype} if self.head else set()  # the weight formats
        # what the pointers point into, and where the model holds them (checked each step)
        holders = list(_tensors(model))
        if self.head is not None:
            holders += [(self.head[0]._parameters, "weight"), (self.head[1]._buffers, "blocks")]
        self.holder_dicts, self.holder_names = zip(*holders)
        self.tensors = list(map(dict.get, self.holder_dicts, self.holder_names))
        self.parameters = [t for t in self.tensors if isinstance(t, nn.Parameter)]
        self.parameter_ptrs = [t.data_ptr() for t in self.parameters]
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self.qtypes.update(m.qtype for m in linears)
            bias = attn.qkv_proj.bias
            self.layers.append(
                (
                    [m.weight.data_ptr() for m in norms] + [m.eps for m in norms],
                    [_linear_args(m) for m in linears],
                    None if bias is None else bias.data_ptr(),
                    (attn.rotary.cos.data_ptr(), attn.rotary.sin.data_ptr()),
                    layer.self_attn.layer,
                )
            )
        self.step_layers = (StepLayer * len(self.layers))()
        for entry, (norm_args, linears, bias, (cos, sin), _) in zip(self.step_layers, self.layers):
            entry.norm[:], entry.eps[:] = norm_args[:2], norm_args[2:]
            for i, (qtype, blocks, n, k) in enumerate(linears):
                entry.type[i], entry.weight[i], entry.n[i], entry.k[i] = qtype, blocks, n, k
            entry.qkv_bias, entry.cos, entry.sin = bias, cos, sin
        self.cache_of = None  # the pool whose caches step_layers points into
        self.kernel_codes: dict[tuple, ctypes.Array] = {}  # by (row count, ISA)
        self.step_buffers: tuple = ()  # `logits`' buffers, for one row count at a time

    def applies(self, backend, ctx, x: torch.Tensor) -> bool:
        from spruce.runtime.executor.attention.native_backend import NativeAttentionBackend

        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
            return False
        if type(backend) is not NativeAttentionBackend:
            return False
        if backend.cpu_kernel is None or not ctx.backend_state.all_decode:
            return False
        return not (any(self.hook_dicts) or _global_hooks())

    def holds_weights_of(self, model: nn.Module) -> bool:
        """Whether the pointers are still the model's: loading weights replaces the tensors,
        and moving the model may swap a parameter's storage in place (`param.data = ...`).
        Checked through the dicts the modules hold them in, mapped in C: attribute access, or
        these checks as generator expressions, cost a noticeable share of a batch-1 step."""
        held = map(dict.get, self.holder_dicts, self.holder_names)
        if not all(map(operator.is_, held, self.tensors)):
            return False
        return list(map(torch.Tensor.data_ptr, self.parameters)) == self.parameter_ptrs

    def run(self, x: torch.Tensor, ctx, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on x [rows, hidden] (the embeddings): (last MLP output, residual)."""
        buffers = self._buffers(x)
        self._step(buffers, ctx, backend, None)
        residual, out = buffers[0], buffers[2]
        return out, residual

    def ends_with_head(self, ctx, logits_rows) -> bool:
        """Whether `logits` serves this step: a head the plan holds, every row's logits and
        no hidden states wanted."""
        return self.head is not None and logits_rows is None and ctx.hidden_rows is None

    def logits(self, x: torch.Tensor, ctx, backend) -> torch.Tensor:
        """`run`, then the final norm and the output projection in the same C call: the
        logits [rows, vocab]. Nothing but the logits leaves the step, so its buffers are
        kept for the next one with as many rows."""
        buffers = self._kept_buffers(x)
        out = torch.empty(x.shape[0], self.head[1].out_features)
        self._step(buffers, ctx, backend, out)
        return out

    def _kept_buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """_buffers(x), kept from the last step with as many rows (its residual set to x)."""
        buffers = self.step_buffers
        if buffers and buffers[0].shape[0] == x.shape[0]:
            buffers[0].copy_(x)
            return buffers
        self.step_buffers = self._buffers(x)
        return self.step_buffers

    def decode_steps(
        self, x: torch.Tensor, ctx, backend, slots: torch.Tensor, embedding: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding `slots.shape[1]` steps in one C call from x [rows, hidden] (the
        embeddings of each row's last token): step j puts its K/V into slots[:, j] (int64
        [rows, steps], already in the request-to-token table) and chooses each row's argmax,
        which `embedding` ((ggml type id, or -1 for float32 rows), table pointer) turns into
        the next step's input. Returns the chosen ids (int64) and their logits, both
        [steps, rows]; a logit that is not finite marks a row that could not be sampled."""
        rows, steps = slots.shape
        buffers = self._kept_buffers(x)
        logits = torch.empty(rows, self.head[1].out_features)
        ahead = torch.arange(steps, dtype=torch.int64)[:, None]
        group = ctx.backend_state.decode
        per_step = (  # [steps, rows], step j's row of each
            cpu_quant_ops.int64(ctx.positions)[None, :] + ahead,
            slots.t().contiguous(),
            cpu_quant_ops.int64(group.table_rows),
            cpu_quant_ops.int64(group.seq_lens)[None, :] + ahead,
        )
        args = self._args(buffers, backend, logits, per_step)
        ids, best = torch.empty(steps, rows, dtype=torch.int64), torch.empty(steps, rows)
        failed = self.lib.spruce_decode_steps(
            self.step_layers, len(self.step_layers), ctypes.byref(args), steps, *embedding,
            ids.data_ptr(), best.data_ptr(),
        )  # fmt: skip
        self._check_step(failed)
        return ids, best

    def _step(self, buffers: tuple, ctx, backend, logits: torch.Tensor | None) -> None:
        """One spruce_decode_layers call on `buffers` (_buffers' order); with `logits`, the
        head's too."""
        group = ctx.backend_state.decode
        per_row = (ctx.positions, ctx.out_slots, group.table_rows, group.seq_lens)
        per_row = tuple(map(cpu_quant_ops.int64, per_row))  # held until the call returns
        args = self._args(buffers, backend, logits, per_row)
        layers, count = self.step_layers, len(self.step_layers)
        self._check_step(self.lib.spruce_decode_layers(layers, count, ctypes.byref(args)))

    def _args(
        self, buffers: tuple, backend, logits: torch.Tensor | None, per_row: tuple
    ) -> StepArgs:
        """StepArgs for `buffers`, with the int64 positions, new slots, table rows and
        sequence lengths `per_row` (the caller holds them until the call returns)."""
        c, rows = self.config, buffers[0].shape[0]
        isa = cpu_quant_ops.best_isa()  # follows cpu_library.use_isa
        table = backend.req_to_token.table
        args = StepArgs(
            *(t.data_ptr() for t in buffers),
            rows, c.hidden_size, c.q_size, c.kv_size, c.num_heads, c.num_kv_heads, c.head_dim,
            self.inter, cpu_quant_ops.ISAS.index(isa),
            *(t.data_ptr() for t in per_row), table.data_ptr(), table.stride(0), backend.scale,
            CACHE_KINDS[backend.pool.k[0].dtype], self._kernel_codes(rows, isa),
        )  # fmt: skip
        if logits is not None:
            args.final_norm, args.final_eps, args.head_type, args.head, args.vocab = self.head_args
            args.logits = logits.data_ptr()
        self._point_at_caches(backend)
        return args

    def _check_step(self, failed: int) -> None:
        if failed == 2:
            raise _attention_refused(self.config)
        _check(failed)

    def _buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's buffers, in StepArgs' order: residual (x copied), h, out, qkv, attn,
        gate_up, act."""
        c, rows = self.config, x.shape[0]
        return (
            x.contiguous().clone(),
            torch.empty(rows, c.hidden_size),
            torch.empty(rows, c.hidden_size),
            torch.empty(rows, self.qkv_width),
            torch.empty(rows, c.q_size),
            torch.empty(rows, 2 * self.inter),
            torch.empty(rows, self.inter),
        )

    def _kernel_codes(self, rows: int, isa: str) -> ctypes.Array:
        """The C side's kernel table for `rows` on `isa`: cpu_quant_ops.kernel's choice per
        weight type."""
        codes = self.kernel_codes.get((rows, isa))
        if codes is None:
            codes = (ctypes.c_int8 * KERNEL_TYPES)()
            for q in self.qtypes:
                codes[cpu_quant_ops.QUANT_TYPES[q].ggml_id] = KERNEL_CODES[
                    cpu_quant_ops.kernel(q, rows, isa)
                ]
            self.kernel_codes[rows, isa] = codes
        return codes

    def _point_at_caches(self, backend) -> None:
        """Each layer's K/V cache (and int8 scales) and attention window, from `backend`'s
        pool (filled again when the backend or its pool is another)."""
        pool = backend.pool
        key = (id(backend), id(pool), pool.k[0].data_ptr(), pool.v[-1].data_ptr())
        if self.cache_of == key:
            return
        for entry, (*_, layer) in zip(self.step_layers, self.layers):
            entry.k_cache, entry.v_cache = pool.k[layer].data_ptr(), pool.v[layer].data_ptr()
            entry.k_scale, entry.v_scale = scale_pointers(pool.scales(layer))
            entry.window = backend.windows[layer] or 0
        self.cache_of = key


def _attention_refused(c) -> ValueError:
    return ValueError(
        f"CPU attention kernel: unsupported shape (heads {c.num_heads}, head_dim {c.head_dim})"
    )


def _check(failed: int) -> None:
    if failed:
        raise MemoryError("no memory for a quantized linear layer's activations")


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
