"""Checkpoint tensors of quantized projections into the internal formats (formats.py).

The model's slot map names each projection's dense `weight` (rows `start : start + rows` of a fused projection);
here each such slot is replaced by the slots of the checkpoint's format, every one converting its tensor on its
own into the same rows of the internal tensors:
- on_load: the dense weight, quantized round-to-nearest (quantize.py).
- compressed-tensors: weight (fp8, or int8 for naive/int-quantized), weight_packed (int32 words, pack-quantized),
  weight_scale, weight_zero_point (asymmetric), weight_shape (checked), input_scale (static fp8).
- awq: qweight [in, out // 8] and qzeros [groups, out // 8] in AWQ's nibble order, scales [groups, out].
- gptq: qweight [in * bits / 32, out], qzeros [groups, out * bits / 32] (minus one in GPTQ's original format),
  scales [groups, out], g_idx (checked: groups must follow the input columns).
- fp8: weight, weight_scale (per tensor), input_scale (static)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..network.llama import LlamaForCausalLM, WeightSlot
from ..network.model_config import ModelLoadError
from .formats import INT4_SYMMETRIC_ZERO, pack_int4
from .linear import QuantLinear
from .packing import unpack_awq, unpack_int32
from .settings import QuantSettings

Convert = Callable[[torch.Tensor], torch.Tensor]
# A dummy model's static FP8 activation scale: activations up to about 22 in magnitude stay unclipped.
DUMMY_INPUT_SCALE = 0.05
_INT8_ZERO = 128  # unsigned 8-bit storage of a symmetric int8 value


class ConvertSlot(WeightSlot):
    """A checkpoint tensor of `shape`, converted, into rows start : start + rows of an internal tensor."""

    def __init__(self, target: torch.Tensor, start: int, shape: tuple[int, ...], convert: Convert):
        super().__init__(target, start, shape)  # type: ignore[arg-type]  # a buffer, not a Parameter
        self.convert = convert

    def copy_(self, tensor: torch.Tensor) -> None:
        value = self.convert(tensor)
        with torch.no_grad():
            self.param.narrow(0, self.start, value.shape[0]).copy_(value)


class MaxSlot(WeightSlot):
    """A scalar (a static activation scale) kept as the largest over a fused projection's parts."""

    def copy_(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.param.copy_(torch.maximum(self.param, tensor.reshape(()).to(self.param.dtype)))


class QuantizeSlot(WeightSlot):
    """A dense checkpoint weight, quantized on load into the module's rows."""

    def __init__(self, module: QuantLinear, start: int, shape: tuple[int, ...]):
        super().__init__(module.weight_scale, start, shape)  # type: ignore[arg-type]
        self.module = module

    def copy_(self, tensor: torch.Tensor) -> None:
        self.module.store_rows(self.start, tensor)


class CheckSlot(WeightSlot):
    """A tensor that carries nothing to store, only something to check (weight_shape, g_idx, int8 zero points)."""

    def __init__(
        self, name: str, shape: tuple[int, ...], check: Callable[[torch.Tensor], Optional[str]], required=True
    ):
        super().__init__(torch.empty(0), 0, shape)  # type: ignore[arg-type]
        self.name, self.check, self.required = name, check, required

    def copy_(self, tensor: torch.Tensor) -> None:
        problem = self.check(tensor)
        if problem:
            raise ModelLoadError(f"tensor {self.name}: {problem}")


def quantized_slots(
    model: LlamaForCausalLM, slots: dict[str, WeightSlot], settings: QuantSettings
) -> dict[str, WeightSlot]:
    """`slots` with every dense weight slot of a QuantLinear replaced by its format's slots."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, QuantLinear)}
    result: dict[str, WeightSlot] = {}
    for name, slot in slots.items():
        module = owners.get(id(slot.param))
        if module is None or not name.endswith(".weight"):
            result[name] = slot
            continue
        base = name[: -len(".weight")]
        result.update(part_slots(base, module, slot.start, slot.shape[0], settings))
    return result


def part_slots(base: str, module: QuantLinear, start: int, rows: int, settings: QuantSettings) -> dict[str, WeightSlot]:
    """The slots of one checkpoint module `base` (rows start : start + rows of `module`)."""
    cols = module.in_features
    if settings.source == "on_load":
        return {base + ".weight": QuantizeSlot(module, start, (rows, cols))}
    builders = {"compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq, "fp8": _fp8}
    return builders[settings.source](base, module, start, rows, settings)


def _scale_slot(module: QuantLinear, start: int, rows: int, per_tensor: bool, transpose=False) -> ConvertSlot:
    groups = module.groups
    if per_tensor:
        shape: tuple[int, ...] = (1,)
        return ConvertSlot(module.weight_scale, start, shape, lambda t: t.reshape(1, -1).expand(rows, groups))
    shape = (groups, rows) if transpose else (rows, groups)
    return ConvertSlot(module.weight_scale, start, shape, (lambda t: t.t()) if transpose else (lambda t: t))


def _int4_values(values: torch.Tensor) -> torch.Tensor:
    return pack_int4(values.to(torch.uint8))


def _compressed_tensors(base, module: QuantLinear, start, rows, settings: QuantSettings) -> dict[str, WeightSlot]:
    cols = module.in_features
    if module.kind == "fp8":
        return _fp8_slots(base, module, start, rows, settings.per_tensor, (1,))
    slots: dict[str, WeightSlot] = {}
    int4 = module.kind == "int4"
    target = module.qweight if int4 else module.weight
    assert target is not None
    if settings.ct_format == "pack-quantized":
        bits = settings.bits

        def unpacked(t: torch.Tensor) -> torch.Tensor:
            values = unpack_int32(t, bits, dim=1)[:, :cols]  # stored unsigned: the signed value plus 2**(bits-1)
            return _int4_values(values) if int4 else (values - _INT8_ZERO).to(torch.int8)

        slots[base + ".weight_packed"] = ConvertSlot(target, start, (rows, math.ceil(cols * bits / 32)), unpacked)
        slots[base + ".weight_shape"] = CheckSlot(base + ".weight_shape", (2,), _shape_check(rows, cols))
    else:  # naive- / int-quantized: signed values in int8
        convert: Convert = (lambda t: _int4_values(t.to(torch.int16) + INT4_SYMMETRIC_ZERO)) if int4 else (lambda t: t)
        slots[base + ".weight"] = ConvertSlot(target, start, (rows, cols), convert)
    slots[base + ".weight_scale"] = _scale_slot(module, start, rows, per_tensor=settings.per_tensor)
    if int4 and not settings.symmetric:
        assert module.weight_zero is not None
        slots[base + ".weight_zero_point"] = _ct_zero_slot(module.weight_zero, start, rows, module.groups, settings)
    return slots


def _ct_zero_slot(target: torch.Tensor, start: int, rows: int, groups: int, settings: QuantSettings) -> ConvertSlot:
    """Signed zero points (the internal zero is that plus 8); pack-quantized packs them along the rows."""
    if settings.ct_format == "pack-quantized":
        shape = (math.ceil(rows * 4 / 32), groups)
        return ConvertSlot(target, start, shape, lambda t: unpack_int32(t, 4, dim=0)[:rows])
    return ConvertSlot(target, start, (rows, groups), lambda t: t.to(torch.int16) + INT4_SYMMETRIC_ZERO)


def _fp8_slots(
    base, module: QuantLinear, start, rows, per_tensor: bool, scalar: tuple[int, ...]
) -> dict[str, WeightSlot]:
    slots: dict[str, WeightSlot] = {
        base + ".weight": ConvertSlot(module.weight, start, (rows, module.in_features), lambda t: t),
        base + ".weight_scale": ConvertSlot(
            module.weight_scale,
            start,
            scalar if per_tensor else (rows, 1),
            (lambda t: t.reshape(1).expand(rows)) if per_tensor else (lambda t: t.reshape(-1)),
        ),
    }
    if module.input_scale is not None:
        slots[base + ".input_scale"] = MaxSlot(module.input_scale, 0, scalar)  # type: ignore[arg-type]
    return slots


def _fp8(base, module: QuantLinear, start, rows, settings: QuantSettings) -> dict[str, WeightSlot]:
    return _fp8_slots(base, module, start, rows, per_tensor=True, scalar=())


def _awq(base, module: QuantLinear, start, rows, settings: QuantSettings) -> dict[str, WeightSlot]:
    cols, groups = module.in_features, module.groups
    assert module.qweight is not None and module.weight_zero is not None
    return {
        base + ".qweight": ConvertSlot(
            module.qweight, start, (cols, rows // 8), lambda t: _int4_values(unpack_awq(t).t())
        ),
        base + ".qzeros": ConvertSlot(module.weight_zero, start, (groups, rows // 8), lambda t: unpack_awq(t).t()),
        base + ".scales": _scale_slot(module, start, rows, per_tensor=False, transpose=True),
    }


def _gptq(base, module: QuantLinear, start, rows, settings: QuantSettings) -> dict[str, WeightSlot]:
    cols, groups, bits = module.in_features, module.groups, settings.bits
    offset = settings.gptq_zero_offset

    def values(t: torch.Tensor) -> torch.Tensor:
        unpacked = unpack_int32(t, bits, dim=0).t()
        return _int4_values(unpacked) if bits == 4 else (unpacked - _INT8_ZERO).to(torch.int8)

    target = module.qweight if bits == 4 else module.weight
    assert target is not None
    slots: dict[str, WeightSlot] = {
        base + ".qweight": ConvertSlot(target, start, (cols * bits // 32, rows), values),
        base + ".scales": _scale_slot(module, start, rows, per_tensor=False, transpose=True),
        base + ".g_idx": CheckSlot(base + ".g_idx", (cols,), _g_idx_check(cols, module.group_size), required=False),
    }
    zeros_shape = (groups, rows * bits // 32)
    if bits == 4:
        assert module.weight_zero is not None
        zeros = lambda t: unpack_int32(t, 4, dim=1).t() + offset  # noqa: E731
        slots[base + ".qzeros"] = ConvertSlot(module.weight_zero, start, zeros_shape, zeros)
    else:
        slots[base + ".qzeros"] = CheckSlot(base + ".qzeros", zeros_shape, _int8_zero_check(offset))
    return slots


def _shape_check(rows: int, cols: int) -> Callable[[torch.Tensor], Optional[str]]:
    def check(t: torch.Tensor) -> Optional[str]:
        got = [int(v) for v in t.tolist()]
        return None if got == [rows, cols] else f"says the weight is {got}, the model's is {[rows, cols]}"

    return check


def _g_idx_check(cols: int, group_size: int) -> Callable[[torch.Tensor], Optional[str]]:
    def check(t: torch.Tensor) -> Optional[str]:
        expected = torch.arange(cols, device=t.device) // group_size
        if torch.equal(t.to(expected.dtype), expected):
            return None
        return "groups do not follow the input columns (act-order GPTQ, desc_act=true, is not supported)"

    return check


def _int8_zero_check(offset: int) -> Callable[[torch.Tensor], Optional[str]]:
    def check(t: torch.Tensor) -> Optional[str]:
        zeros = unpack_int32(t, 8, dim=1) + offset
        return None if bool((zeros == _INT8_ZERO).all()) else "8-bit GPTQ loads symmetric only (every zero 128)"

    return check


def fill_dummy(model: torch.nn.Module, generator: torch.Generator, std: float) -> None:
    """Random dense weights, quantized, in every QuantLinear (the dummy load_format of a quantized model)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            dense = torch.empty(module.out_features, module.in_features, device=module.weight_scale.device)
            module.store_rows(0, dense.normal_(0.0, std, generator=generator))
            if module.input_scale is not None:
                module.input_scale.fill_(DUMMY_INPUT_SCALE)
