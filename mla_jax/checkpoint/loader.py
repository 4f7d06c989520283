"""Hugging Face safetensors checkpoints <-> DeepseekModel.

Parameter paths map to HF tensor names mechanically. The decoder layers' parameters are
stacked, so ``layers.self_attn.q_b_proj.kernel [L, in, out]`` holds one tensor per layer:
its row ``i`` is ``model.layers.{i}.self_attn.q_b_proj.weight`` transposed (HF stores
``[out, in]``); a kept FP8 projection's ``weight [L, out, in]`` and ``weight_scale_inv``
hold HF's tensors as they are. ``embed_tokens.embedding`` is ``model.embed_tokens.weight``,
and ``lm_head`` has no ``model.`` prefix. A few parameters hold parts of HF tensors, or several
of them:
``W_UK`` / ``W_UV`` (``kv_b_proj``'s, ``attention.kv_b_part``), ``fused_qkv_a_proj``
(``q_a_proj`` and ``kv_a_proj_with_mqa`` side by side, ``attention.fused_qkv_a_part``) and
the routed experts' stacks (``moe.hf_expert_slice``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mla_jax.checkpoint.fp8_weights import (
    FP8,
    SCALE_SUFFIX,
    FP8BlockQuantization,
    dequantize,
    read_safetensors,
    scale_name,
)
from mla_jax.checkpoint.hf_config import config_to_dict, load_config
from mla_jax.model.attention import KV_B_PROJ, fused_qkv_a_part, kv_b_part
from mla_jax.model.config import ModelConfig
from mla_jax.model.deepseek import DeepseekModel, stacked_runs
from mla_jax.model.moe import hf_expert_names, hf_expert_slice

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# safetensors header dtypes that hold weights; integer (and FP8) tensors would be cast to
# floats silently, so they are refused by name instead.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# load_model's fp8_weights (generate.py's --fp8-weights).
FP8_WEIGHTS = ("auto", "keep", "dequantize")
# Those an fp8 weight's block scales may have (read_safetensors reads them).
_SCALE_DTYPES = ("F32", "BF16", "F16")


class WeightsError(ValueError):
    """A checkpoint's tensors do not match the model its config.json describes."""


class TensorSlot(NamedTuple):
    """Where HF tensor ``name`` goes: ``parameter[index] = tensor.transpose(axes)``, or with
    ``part = (shape, part_index)``, ``parameter[index] = tensor.reshape(shape)[part_index]
    .transpose(axes)`` (a parameter holding a part of the tensor, another the rest)."""

    name: str
    index: tuple  # into the (stacked) parameter: ints and slices
    axes: tuple[int, ...]  # the transpose taking HF's layout (or the part's) to the parameter's
    hf_shape: tuple[int, ...]  # the shape the HF tensor must have
    part: tuple[tuple[int, ...], tuple] | None = None

    def take(self, tensor: np.ndarray) -> np.ndarray:
        """What of HF ``tensor`` goes to ``parameter[index]``."""
        if self.part is not None:
            shape, part_index = self.part
            tensor = tensor.reshape(shape)[part_index]
        return tensor.transpose(self.axes)

    def put(self, tensors: dict[str, np.ndarray], value: np.ndarray) -> None:
        """``take``'s inverse: writes ``value`` (``parameter[index]``) into ``tensors[name]``;
        a part into its place in a tensor of ``part``'s shape (made when its first part
        comes; the caller reshapes it to ``hf_shape`` once every part is in)."""
        value = value.transpose(np.argsort(self.axes))
        if self.part is None:
            tensors[self.name] = np.ascontiguousarray(value)
            return
        shape, part_index = self.part
        tensors.setdefault(self.name, np.zeros(shape, value.dtype))[part_index] = value


def hf_tensors(
    path: tuple,
    shape: tuple[int, ...],
    cfg: ModelConfig,
    runs: Sequence[tuple[int, int, bool]],
    available: Container[str] = (),
    *,
    fp8: bool = False,
) -> list[TensorSlot]:
    """The HF tensors an nnx parameter holds. A decoder run's parameters (path ``layers``,
    run, ...; ``runs``: the model's, ``DeepseekModel.runs``) hold one tensor per layer of the
    run (their leading axis), and a run's routed experts one per layer and expert
    (``moe.hf_expert_slice``), or one per layer where ``available`` (a checkpoint's tensor
    names) has transformers' fused tensor of the layer's experts; the rest hold one. A kept
    FP8 weight's scales (``<name>_scale_inv``, its grid in the weight's layout) hold the
    ``weight_scale_inv`` tensors of its weight's tensors, each where its block grid lies.
    ``fp8``: the parameter is a kept FP8 weight (routed experts' stacks then hold HF's
    layout, ``moe.hf_expert_slice``)."""
    if str(path[-1]).endswith(SCALE_SUFFIX):
        return _scale_slots(path, shape, cfg, runs)
    parts = [str(p) for p in path]
    if parts[-1] in ("kernel", "embedding"):
        parts[-1] = "weight"
    if parts[0] != "layers":
        name = ".".join(parts)
        slot_name = name if parts[0] == "lm_head" else f"model.{name}"
        return [_plain_slot(slot_name, (), shape, transposed=_is_transposed(path))]
    first = runs[int(parts[1])][0]
    rest = ".".join(parts[2:])
    attention = parts[2] == "self_attn"
    kv_b = kv_b_part(parts[3], cfg.mla) if attention else None
    qkv_a = fused_qkv_a_part(parts[3], cfg.mla) if attention else []
    slots = []
    for i in range(shape[0]):
        prefix = f"model.layers.{first + i}"
        if kv_b is not None:
            part_shape, part_index, axes = kv_b
            name = f"{prefix}.self_attn.{KV_B_PROJ}.weight"
            hf_shape = (part_shape[0] * part_shape[1], part_shape[2])
            slots.append(TensorSlot(name, (i,), axes, hf_shape, (part_shape, part_index)))
        elif qkv_a:
            # The module's outputs: columns of a kernel [in, out], rows of an FP8 weight
            # [out, in] (HF's layout).
            transposed = _is_transposed(path)
            index, axes = ((slice(None),), (1, 0)) if transposed else ((), (0, 1))
            for module, columns in qkv_a:
                name = f"{prefix}.self_attn.{module}.weight"
                hf_shape = (columns.stop - columns.start, shape[1 if transposed else 2])
                slots.append(TensorSlot(name, (i, *index, columns), axes, hf_shape))
        elif parts[2:4] == ["mlp", "experts"]:
            fused = f"{prefix}.mlp.experts.{parts[4]}" in available
            for name in hf_expert_names(f"{prefix}.mlp", cfg.moe, fused=fused):
                where = hf_expert_slice(name, cfg.moe, fp8=fp8)
                if where.param == parts[4]:
                    slots.append(TensorSlot(name, (i, *where.index), where.axes, where.hf_shape))
        else:
            slots.append(
                _plain_slot(f"{prefix}.{rest}", (i,), shape, transposed=_is_transposed(path))
            )
    return slots


def _scale_slots(path: tuple, shape: tuple[int, ...], cfg: ModelConfig, runs) -> list[TensorSlot]:
    """The ``weight_scale_inv`` slots of the scale grid ``shape`` at ``path``: its weight's
    slots (``hf_tensors`` of the weight's shape, as the model builds it), each range of
    output rows (the slot index's last entry) mapped to its range of grid rows. A fused
    weight's grid is its parts' grids one after the other, each starting on a whole block: a
    routed experts' ``gate_up_proj``'s up half after the gate's ``cdiv(I, bo)`` rows,
    ``fused_qkv_a_proj``'s ``kv_a_proj_with_mqa`` after ``q_a_proj``'s ``Lq / bo``. Every
    kept FP8 weight is in HF's ``[out, in]`` layout, and so is its grid."""
    bo, bi = cfg.quantization.weight_block_size
    *lead, rows, cols = shape
    weight_path = (*path[:-1], str(path[-1])[: -len(SCALE_SUFFIX)])
    slots = []
    # The weight's slots for a weight of the grid's size in blocks (the fused weights' row
    # ranges come from the config; a plain weight's HF shape is the grid's, in blocks).
    for slot in hf_tensors(weight_path, (*lead, rows * bo, cols * bi), cfg, runs, fp8=True):
        *hf_lead, out, inp = slot.hf_shape
        index = slot.index
        outputs = index[-1] if index else None
        if isinstance(outputs, slice) and outputs.start is not None:
            first = math.ceil(outputs.start / bo)
            index = (*index[:-1], slice(first, first + math.ceil(out / bo)))
        hf_shape = (*hf_lead, math.ceil(out / bo), math.ceil(inp / bi))
        slots.append(TensorSlot(scale_name(slot.name), index, slot.axes, hf_shape))
    return slots


def _plain_slot(name: str, index: tuple, shape: tuple[int, ...], *, transposed: bool):
    own = tuple(shape[len(index) :])
    if transposed:
        return TensorSlot(name, index, (1, 0), own[::-1])
    return TensorSlot(name, index, tuple(range(len(own))), own)


def _is_transposed(path: tuple) -> bool:
    """A ``kernel [in, out]`` holds its HF ``weight [out, in]`` transposed; an FP8
    projection's ``weight`` (``layers.Linear``) and the rest hold theirs as they are."""
    return path[-1] == "kernel"


@contextlib.contextmanager
def _open(file: str) -> Iterator:
    """``safe_open`` whose errors (a truncated or corrupt file, on opening or on reading a
    tensor) name the file."""
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise WeightsError(f"{file} is not a readable safetensors file: {e}") from None


def _weight_map(index_path: str) -> dict[str, str]:
    """The index's tensor name -> shard file name."""
    with open(index_path) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise WeightsError(f"{index_path} is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) for file in weight_map.values()
    ):
        raise WeightsError(f"{index_path} has no 'weight_map' object of tensor -> file names")
    return weight_map


def _checkpoint_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it (sharded or single-file checkpoints)."""
    index_path = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index_path):
        weight_map = _weight_map(index_path)
        files = {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise WeightsError(f"{index_path} names the missing shard {os.path.basename(file)}")
        return files
    single = os.path.join(model_dir, _SINGLE)
    if not os.path.isfile(single):
        raise WeightsError(f"no {_SINGLE} or {_INDEX} in {model_dir}")
    with _open(single) as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that generation does not use: rotary buffers and the
    multi-token-prediction layers DeepSeek-V3 appends after the decoder."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    n_extra = cfg.num_nextn_predict_layers
    return bool(m) and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + n_extra


def _by_file(names: Iterable[str], files: dict[str, str]) -> list[tuple[str, list[str]]]:
    """``names`` grouped by the file holding them, files in name order."""
    grouped = defaultdict(list)
    for name in names:
        grouped[files[name]].append(name)
    return sorted(grouped.items())


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def keeps_fp8(cfg: ModelConfig, fp8_weights: str) -> bool:
    """Whether ``load_model`` keeps the FP8 weights of a checkpoint of ``cfg`` as they are:
    ``fp8_weights`` "keep", or "auto" on a GPU backend (where the Pallas kernels dequantize
    them tile by tile; elsewhere the references would dequantize a whole weight each call),
    for a checkpoint that has FP8 weights; "dequantize" never."""
    if fp8_weights not in FP8_WEIGHTS:
        raise ValueError(f"fp8_weights must be one of {FP8_WEIGHTS}, got {fp8_weights!r}")
    if cfg.quantization is None or fp8_weights == "dequantize":
        return False
    return fp8_weights == "keep" or jax.default_backend() == "gpu"


def load_model(
    model_dir: str | os.PathLike,
    *,
    dtype=jnp.float32,
    verbose: bool = False,
    placement: Callable[[tuple, int], jax.sharding.Sharding] | None = None,
    fp8_weights: str = "dequantize",
) -> tuple[ModelConfig, DeepseekModel]:
    """Builds the model ``config.json`` describes and fills it from the checkpoint's tensors,
    cast to ``dtype``. Raises WeightsError naming missing, unexpected or mis-shaped tensors.
    ``placement(path, ndim)``: where each parameter goes (e.g. ``sharding.placement``, which
    sends each device only its shards); default: the default device.

    ``fp8_weights`` (an FP8 checkpoint's; ignored for others): "keep" holds the decoder's
    projections and routed experts as float8_e4m3fn with their float32 block scales
    (``DeepseekModel``'s ``fp8_blocks``; ``kv_b_proj`` is dequantized), "dequantize" casts
    every weight to ``dtype`` (the default), "auto" keeps them on a GPU (``keeps_fp8``)."""
    model_dir = os.fspath(model_dir)
    cfg = load_config(model_dir)
    blocks = cfg.quantization.weight_block_size if keeps_fp8(cfg, fp8_weights) else None
    runs = stacked_runs(cfg, blocks, placement)  # kept FP8 stacks read in place on a device
    abstract = nnx.eval_shape(
        lambda: DeepseekModel(
            cfg, param_dtype=dtype, rngs=nnx.Rngs(0), fp8_blocks=blocks, runs=runs
        )
    )
    graphdef, state = nnx.split(abstract)
    files = _checkpoint_files(model_dir)
    params = defaultdict(list)  # HF name -> [(parameter path, its abstract variable, slot)]
    for path, var in nnx.to_flat_state(state):
        for slot in hf_tensors(path, var.shape, cfg, abstract.runs, files, fp8=var.dtype == FP8):
            params[slot.name].append((path, var, slot))

    missing = sorted(set(params) - set(files))
    if missing:
        raise WeightsError(f"checkpoint {model_dir} lacks tensors: {_listing(missing)}")
    quantization = cfg.quantization
    scales = set()  # the block scales of fp8 weights, read with their weights
    if quantization is not None:
        scales = {scale_name(n) for n in params if scale_name(n) in files}
    unexpected = sorted(n for n in set(files) - set(params) - scales if not _ignorable(n, cfg))
    if unexpected:
        raise WeightsError(f"checkpoint {model_dir} has unexpected tensors: {_listing(unexpected)}")

    # Headers first: a wrong dtype or shape in the last shard is refused before any data is read.
    headers = {}  # name -> (safetensors dtype, shape)
    for file, names in _by_file([*params, *scales], files):
        with _open(file) as f:
            for name in names:
                header = f.get_slice(name)
                headers[name] = (header.get_dtype(), tuple(header.get_shape()))
    for name, targets in params.items():
        (_, var, slot), *_ = targets  # a tensor's parts (kv_b_part) are alike in this
        fp8 = _check_header(*headers[name], name, slot, quantization)
        scale = scale_name(name)
        if fp8 and scale not in files:
            raise WeightsError(f"fp8 tensor {name} has no {scale} in {model_dir}")
        if scale in scales:
            _check_scale_header(*headers[scale], scale, name, headers[name], quantization)
        if var.dtype == FP8 and not fp8:
            raise WeightsError(
                f"tensor {name} is {headers[name][0]}, not fp8: kept FP8 weights need the "
                "checkpoint's projections in fp8 (load with fp8_weights='dequantize', "
                "--fp8-weights dequantize)"
            )
    shards = _by_file(params, files)
    # Host buffers in the model's dtype (kept FP8 weights and their scales: in theirs),
    # filled one tensor at a time as the shards stream by.
    buffers = {
        path: np.empty(var.shape, var.dtype if _kept(path, var) else jnp.dtype(dtype))
        for targets in params.values()
        for path, var, _ in targets
    }
    for i, (file, names) in enumerate(shards):
        if verbose:
            print(f"loading {os.path.basename(file)} ({i + 1}/{len(shards)})", file=sys.stderr)
        with _open(file) as f:
            for name in names:
                (path, var, _), *_ = params[name]
                if _kept(path, var):  # an FP8 weight or its scales, as stored
                    array = read_safetensors(file, name)
                    if str(path[-1]).endswith(SCALE_SUFFIX):
                        _check_scale_values(array, name)
                elif headers[name][0] == "F8_E4M3":
                    # Dequantized tensor by tensor: host memory holds one in float32 at a time.
                    scale = read_safetensors(files[scale_name(name)], scale_name(name))
                    _check_scale_values(scale, scale_name(name))
                    array = dequantize(read_safetensors(file, name), scale, quantization)
                else:
                    array = f.get_tensor(name)
                for path, _, slot in params[name]:
                    buffers[path][slot.index] = slot.take(array)
    variables = {path: var for targets in params.values() for path, var, _ in targets}

    def put(path: tuple, buffer: np.ndarray) -> jax.Array:
        if placement is None:
            return jnp.asarray(buffer)
        return jax.device_put(buffer, placement(path, buffer.ndim))

    loaded = [(path, variables[path].replace(put(path, b))) for path, b in buffers.items()]
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _kept(path: tuple, var) -> bool:
    """Whether the parameter is a kept FP8 weight or its block scales (loaded as stored)."""
    return var.dtype == FP8 or str(path[-1]).endswith(SCALE_SUFFIX)


def _check_header(
    dtype: str, shape: tuple[int, ...], name: str, slot: TensorSlot, quantization
) -> bool:
    """Dtype and shape of tensor ``name`` as its file's header records them (HF layout);
    True for an fp8 matrix (allowed when the config says the checkpoint is fp8)."""
    fp8 = dtype == "F8_E4M3" and quantization is not None
    if fp8 and len(slot.hf_shape) != 2:
        raise WeightsError(f"tensor {name} is fp8 but not a matrix {list(slot.hf_shape)}")
    if not fp8 and dtype not in _FLOAT_DTYPES:
        raise WeightsError(
            f"tensor {name} has dtype {dtype}; weights must be floating point "
            f"({', '.join(_FLOAT_DTYPES)})"
        )
    want = slot.hf_shape
    if shape != want:
        raise WeightsError(f"tensor {name} has shape {shape}, the config needs {want}")
    return fp8


def _check_scale_header(
    dtype: str,
    shape: tuple[int, ...],
    name: str,
    weight_name: str,
    weight_header: tuple[str, tuple[int, ...]],
    quantization: FP8BlockQuantization,
) -> None:
    """The block scales ``name`` of ``weight_name`` as the headers record them: the weight
    is fp8 (a scale beside a float weight would be ignored), the scales a float dtype and
    one per block of the weight."""
    weight_dtype, weight_shape = weight_header
    if weight_dtype != "F8_E4M3":
        raise WeightsError(
            f"tensor {name} scales {weight_name}, which is {weight_dtype}: only "
            "float8_e4m3fn (F8_E4M3) weights have block scales"
        )
    if dtype not in _SCALE_DTYPES:
        raise WeightsError(
            f"tensor {name} has dtype {dtype}; block scales must be floating point "
            f"({', '.join(_SCALE_DTYPES)})"
        )
    want = quantization.scale_shape(weight_shape)
    if shape != want:
        raise WeightsError(
            f"tensor {name} has shape {shape}; {weight_name} {list(weight_shape)} in blocks "
            f"{list(quantization.weight_block_size)} needs {want}"
        )


def _check_scale_values(scale: np.ndarray, name: str) -> None:
    """Block scales are finite and positive (a NaN one turns its block, and every logit it
    reaches, to NaN)."""
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        where = np.unravel_index(np.argmax(bad), scale.shape)
        raise WeightsError(
            f"tensor {name} holds {float(scale[where])} at block {[int(i) for i in where]}; "
            "block scales must be finite and > 0"
        )


def save_checkpoint(model: DeepseekModel, model_dir: str | os.PathLike) -> None:
    """Writes ``config.json`` and ``model.safetensors`` under HF names (``load_model``'s
    inverse)."""
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    tensors, parted = {}, {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = np.asarray(var[...])
        for slot in hf_tensors(path, array.shape, model.cfg, model.runs, fp8=array.dtype == FP8):
            slot.put(tensors, array[slot.index])
            if slot.part is not None:
                parted[slot.name] = slot
    for name, slot in parted.items():
        tensors[name] = tensors[name].reshape(slot.hf_shape)
    save_file(tensors, os.path.join(model_dir, _SINGLE), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(model.cfg), f, indent=2)
