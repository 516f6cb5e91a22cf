"""How a state dict is laid out in a checkpoint slot (pure, no I/O).

A state dict is a tree of dicts, lists and tuples whose leaves are tensors or
plain values (numbers, strings, bytes, None, numpy arrays, which become
tensors, and numpy scalars, which become their Python values). `plan()` splits it into

* a *skeleton*: the tree with every tensor replaced by a reference, encoded with
  msgpack (tensor references and tuples are msgpack extension types, so tuples
  stay tuples and random-generator states round-trip);
* a list of tensor entries (dtype, shape, byte offset, byte size), each at an
  offset aligned to `ALIGN` bytes in the data region.

`rebuild()` turns a skeleton and the tensors read back into the same tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are laid out or read back, not with this module: the
# agent reads slots' metadata (`decode_meta`) and persists their bytes without torch.

ALIGN = 64
_TENSOR = 1
_TUPLE = 2
_BIGINT = 3


class CheckpointLayoutError(ValueError):
    """A value in the state dict cannot be stored (its path says where)."""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Meta(msgspec.Struct, frozen=True, kw_only=True):
    """What a slot holds besides the tensor bytes."""

    step: int
    skeleton: bytes
    tensors: tuple[TensorEntry, ...]
    data_len: int


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    meta: Meta
    sources: tuple[Any, ...]  # the tensors, in the order of `meta.tensors`


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(Meta)


def encode_meta(meta: Meta) -> bytes:
    return _meta_encoder.encode(meta)


def decode_meta(data: bytes) -> Meta:
    return _meta_decoder.decode(data)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(step: int, state: Any) -> Plan:
    """The layout of `state`. Raises CheckpointLayoutError for unstorable values."""
    import torch

    sources: list[torch.Tensor] = []
    entries: list[TensorEntry] = []
    offset = 0

    def tensor_ref(t: torch.Tensor) -> msgspec.msgpack.Ext:
        nonlocal offset
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes)
        )
        sources.append(t)
        offset = aligned(offset + nbytes)
        return msgspec.msgpack.Ext(_TENSOR, (len(entries) - 1).to_bytes(4, "little"))

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if (unstorable := _not_dense(value)) is not None:
                raise CheckpointLayoutError(
                    f"cannot checkpoint a {unstorable[0]} tensor at {path or 'the root'}: a "
                    f"flash checkpoint holds dense tensors; save {unstorable[1]} instead"
                )
            return tensor_ref(value.detach())
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return msgspec.msgpack.Ext(_TUPLE, _skeleton_encoder.encode(items))
        if value is None or type(value) in (bool, float, str, bytes):
            return value
        if isinstance(value, int):  # (bool was above: no subclass of it can be made)
            # (an int subclass, IntEnum's, as an int; one past 64 bits, as a PCG64
            # generator's state holds, in an extension: msgpack's own ints stop there)
            number = int(value)
            if -(1 << 63) <= number < 1 << 64:
                return number
            size = (number.bit_length() + 8) // 8
            return msgspec.msgpack.Ext(_BIGINT, number.to_bytes(size, "little", signed=True))
        if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
            import numpy as np

            if isinstance(value, np.generic):  # a numpy scalar (float64: a float's
                return walk(value.item(), path)  # subclass msgpack refused): its value
            return tensor_ref(torch.from_numpy(np.ascontiguousarray(value)))
        # another subclass of a plain type, as its plain value (a str enum's text, not
        # what its str() says)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, float):
            return float(value)
        if isinstance(value, bytes):
            return bytes(value)
        raise CheckpointLayoutError(
            f"cannot checkpoint {type(value).__name__} at {path or 'the root'}: use tensors, "
            "numbers, strings, bytes, None, or dicts/lists/tuples of them"
        )

    skeleton = _skeleton_encoder.encode(walk(state, ""))
    meta = Meta(step=step, skeleton=skeleton, tensors=tuple(entries), data_len=offset)
    return Plan(meta=meta, sources=tuple(sources))


_skeleton_encoder = msgspec.msgpack.Encoder()


def _not_dense(t: torch.Tensor) -> tuple[str, str] | None:
    """(what kind of tensor, what to save instead) for a tensor whose bytes are not one
    dense block (its copy into the slot failed deep in torch: "copy_() between dense and
    sparse Tensors is not implemented"); None for a dense one."""
    import torch

    if t.is_nested:
        return "nested", "its unbind() list"
    if t.layout is not torch.strided:
        return str(t.layout).removeprefix("torch."), "its to_dense(), or its indices() and values()"
    if t.is_quantized:
        return "quantized", "its int_repr() with its q_scale() and q_zero_point()"
    if t.is_meta:
        return "meta (data-less)", "a tensor with data"
    return None


def rebuild(meta: Meta, tensor: Callable[[int, TensorEntry], torch.Tensor]) -> Any:
    """The state tree of `meta`, with `tensor(index, entry)` supplying each tensor."""

    def ext_hook(code: int, data: memoryview) -> Any:
        if code == _TENSOR:
            index = int.from_bytes(data, "little")
            return tensor(index, meta.tensors[index])
        if code == _TUPLE:
            return tuple(decoder.decode(data))
        if code == _BIGINT:
            return int.from_bytes(data, "little", signed=True)
        raise CheckpointLayoutError(f"unknown extension type {code} in a checkpoint")

    decoder = msgspec.msgpack.Decoder(ext_hook=ext_hook)
    return decoder.decode(meta.skeleton)


def dtype_of(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointLayoutError(f"unknown dtype {name} in a checkpoint")
    return dtype


def tensor_at(buffer: Any, entry: TensorEntry, *, copy: bool = True) -> torch.Tensor:
    """The tensor `entry` describes, read from `buffer` (the data region).

    `copy=False` returns a view into `buffer`, valid as long as the buffer is.
    """
    import torch

    dtype = dtype_of(entry.dtype)
    count = entry.nbytes // torch.empty((), dtype=dtype).element_size()
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    view = torch.frombuffer(buffer, dtype=dtype, count=count, offset=entry.offset)
    return view.view(entry.shape).clone() if copy else view.view(entry.shape)
