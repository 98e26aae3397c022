"""FP8 (E4M3) weights as a transform of a single-device model (gpt-fast's quantize.py idea): the
model code stays as it is; its projections' weights become fp8 with one scale per output channel,
and its op set passes each fp8 weight's scale to ``linear``/``norm_linear``, which quantize each
activation row over its own scale (dynamic, per token) and multiply in fp8 (``kernels.KernelOps``).

Per-channel weight scales keep fused projections exact: the rows of q, k and v (gate and up) each
keep their own scales, so a checkpoint's per-tensor scales load as rows of equal scales.
Norms and embeddings stay in the model's dtype, and so does the LM head unless
``quantize_lm_head`` quantizes it too (``--fp8-lm-head``: half the bytes of a decode step's
largest matrix, at some accuracy).

``quantize_fp8`` quantizes a loaded model's weights in place of the originals (bf16/fp32
checkpoints, GGUF, dummy weights); ``prepare_fp8`` makes an empty fp8 model that
``fp8_checkpoint_weights`` fills from a pre-quantized Hugging Face checkpoint
(``quantization_config.quant_method == "fp8"``: fp8 ``weight`` and fp32 ``weight_scale`` tensors).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engine.models.layers import CausalLM, Linear
from kernels import KernelOps

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max
QUANT_METHOD = "fp8"  # a Hugging Face quantization_config's quant_method


class Fp8Ops:
    """An op set whose ``linear``/``norm_linear`` pass an fp8 weight's ``weight_scale`` (set by the
    transform on the weight parameter itself) to the base op set; every other op is the base's."""

    def __init__(self, base: KernelOps) -> None:
        self.base = base

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.base.linear(x, weight, getattr(weight, "weight_scale", None))

    def norm_linear(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
        weight: torch.Tensor, gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.norm_linear(x, norm_weight, eps, residual, weight, gated,
                                     getattr(weight, "weight_scale", None))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` as fp8 over per-output-channel scales (row absolute maximum / 448; 1
    for an all-zero row): ``(weight_fp8, scale [out] fp32)``."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
    return (w / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), scale


def is_fp8(model: CausalLM) -> bool:
    return isinstance(model.ops, Fp8Ops)


def _set_fp8(module: Linear, weight: torch.Tensor, scale: torch.Tensor) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    module.weight.weight_scale = module.weight_scale  # what Fp8Ops passes along with the weight


@torch.no_grad()
def quantize_fp8(model: CausalLM) -> CausalLM:
    """Quantize ``model``'s loaded projections to fp8 in place (each original freed as it goes)."""
    for module in model.projections():
        _set_fp8(module, *quantize_weight(module.weight))
    model.use_ops(Fp8Ops(model.ops))
    return model


@torch.no_grad()
def quantize_lm_head(model: CausalLM) -> None:
    """The LM head of a ``quantize_fp8``/``prepare_fp8`` model in fp8 (per-output-channel scales);
    a tied head becomes a head of its own, the embedding's table kept for the lookups."""
    config = model.config
    if model.lm_head is None:
        model.lm_head = Linear(config.hidden_size, config.vocab_size, model.ops, {"device": "meta"})
        table = model.model.embed_tokens.weight
    else:
        table = model.lm_head.weight
    _set_fp8(model.lm_head, *quantize_weight(table))


def is_fp8_lm_head(model: CausalLM) -> bool:
    return model.lm_head is not None and model.lm_head.weight.dtype == FP8


def prepare_fp8(model: CausalLM) -> CausalLM:
    """Give ``model`` (weights not loaded yet) empty fp8 projections and scales to load into."""
    for module in model.projections():
        out_features, in_features = module.weight.shape
        device = module.weight.device
        _set_fp8(module, torch.empty(out_features, in_features, dtype=FP8, device=device),
                 torch.empty(out_features, dtype=torch.float32, device=device))
    model.use_ops(Fp8Ops(model.ops))
    return model


def fp8_checkpoint_weights(
    model: CausalLM, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A pre-quantized checkpoint's tensors as ``load_weights`` takes them for a ``prepare_fp8``
    model: each ``weight_scale`` (per tensor ``[]``/``[1]``, or per channel ``[out, 1]``) as one
    scale per output row; static ``input_scale``s dropped (activations are scaled per token).
    Raises ValueError on a projection weight that is not fp8 (a partly quantized checkpoint)."""
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(".weight_scale"):
            target, rows = layout.get(name, (None, None))
            if target is not None and tensor.numel() == 1:
                tensor = tensor.reshape(1).expand(params[target][rows].shape[0])
            tensor = tensor.reshape(-1).float()
        elif name in layout and params[layout[name][0]].dtype == FP8 and tensor.dtype != FP8:
            raise ValueError(f"weight {name!r} is {tensor.dtype}, expected float8_e4m3fn in an fp8 checkpoint")
        yield name, tensor
