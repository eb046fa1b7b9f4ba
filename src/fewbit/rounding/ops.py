"""``fewbit::round`` and ``fewbit::round_into``: rounding as ``torch.library`` operators.

A user's ``torch.compile``, ``torch.export`` and autograd see one opaque op per call,
with a fake implementation giving the output's shape and dtype; behind it run
fewbit's own kernels (``compiled`` where the config allows, else eager in chunks).
The format and the mode (argument ``rounding``: ``mode`` is a name torch's functionalization
of mutable ops takes for itself) travel as names, the random key as an int64 tensor ``(k0, k1)``
(``fewbit.random.key_of``), so a new seed or step is new data, not a new graph.

Gradient: straight-through. ``d round(x) / dx`` is taken as the identity, as
``torch.fake_quantize_per_tensor_affine`` and quantisation-aware training do inside
the range. Rounding to a float format changes a value by at most half an ulp
(relative error below ``2^-P``) and SR is unbiased, so the identity is the expected
derivative; a zero gradient would stop every weight that training must move by less
than an ulp. Overflow is not special-cased: float formats saturate rarely, and a zero
gradient there would pin a value at the format's maximum.
"""

from __future__ import annotations

import dataclasses
import functools
from operator import index

import torch

from ..config import current
from ..formats import FloatFormat, format, from_repr
from ..operators import has_tangent, operator
from ..random import Key, as_key, host_key, key_of
from . import gpu, native
from .checks import (
    RoundSpec,
    check_random_bits,
    check_tensor,
    lazily_valued,
    make_spec,
    no_result,
    scalar_args,
)
from .compiled import compiled_round, range_bits, round_body, stream_words, use_compiled
from .modes import mode_name, parse_mode

__all__ = [
    "batch_bits", "by_fields", "check_key", "check_out_matches", "check_writable", "checked_spec",
    "fake_checks", "format_name", "lookup_format", "name_for_op", "op_args", "round_into", "storages_overlap",
]  # fmt: skip

#: Formats made by hand (not in the registry) that went through an op, by name: a name is one format.
_UNREGISTERED: dict[str, FloatFormat] = {}


def name_for_op(fmt, kind: type, registry, unregistered: dict, what: str = "format") -> str:
    """The name an op takes for ``fmt`` (a name, or an object of ``kind``): a registered
    format's name, or for one outside ``registry`` (the lookup by name) its repr, which
    states every field: the op reads the format back from that alone (:func:`lookup_format`),
    in a compiled graph or an exported program as eagerly. One made by hand is kept in
    ``unregistered`` under its name, and a different one of its name is refused, as is one
    that takes a registered name."""
    if isinstance(fmt, str):
        return fmt
    if not isinstance(fmt, kind):
        raise TypeError(f"a {what} is a name or a {kind.__name__}, not {type(fmt).__name__}")
    made = unregistered.get(fmt.name)
    if made is None:
        try:
            if registry(fmt.name) == fmt:
                return fmt.name
        except ValueError:  # a name of its own
            made = unregistered[fmt.name] = fmt
    if made != fmt:  # (None: the registered format of that name is another)
        raise ValueError(f"two {what}s are named {fmt.name!r}: rename the one made by hand")
    return repr(fmt)


def by_fields(name_of, kind: type):
    """``name_of`` (a ``torch.compiler.assume_constant_result`` function: Dynamo runs it at
    trace time) taking a format of ``kind`` by its fields' values where Dynamo traces. Dynamo
    guards an object handed to such a function by its id: every equal copy of a format (each
    block of a model cloned with ``copy.deepcopy``, a format made by hand per layer) made a
    graph of its own, and fullgraph=True failed at Dynamo's recompile limit. Its fields (a
    format among them as its own fields) are guarded by value: equal formats share a graph,
    formats that differ in any field do not."""

    @torch.compiler.assume_constant_result
    def name_of_fields(values: tuple) -> str:
        return name_of(kind(*(FloatFormat(*v) if isinstance(v, tuple) else v for v in values)))

    def named(fmt) -> str:
        if isinstance(fmt, kind) and torch.compiler.is_dynamo_compiling():
            return name_of_fields(field_values(fmt))
        return name_of(fmt)

    return named


def field_values(fmt) -> tuple:
    """A format's fields in their order, a FloatFormat among them as its own tuple, ints made
    static (an int Dynamo made symbolic, once another format's differed, is specialised)."""
    values = []
    for field in dataclasses.fields(fmt):
        value = getattr(fmt, field.name)
        if isinstance(value, FloatFormat):
            value = field_values(value)
        elif type(value) is int:
            value = index(value)
        values.append(value)
    return tuple(values)


@torch.compiler.assume_constant_result
def _format_name(fmt: FloatFormat | str) -> str:
    """The name an op takes for ``fmt`` (:func:`name_for_op`). Under torch.compile it runs as
    eagerly, at trace time, and its name is a constant of the graph: Dynamo cannot trace the
    registry's search for close names, and would put off keeping a new format past the graph."""
    return name_for_op(fmt, FloatFormat, format, _UNREGISTERED)


#: The name an op takes for a format or a name (:func:`_format_name`; a format by its fields, compiled).
format_name = by_fields(_format_name, FloatFormat)


def lookup_format(name: str) -> FloatFormat:
    """The format an op names: a registered one, or one made by hand by its repr
    (:func:`name_for_op`)."""
    return from_repr(name) if "(" in name else format(name)


def op_args(x, fmt, mode, sat, bits, fraction, seed, random_bits, name_of=None) -> tuple:
    """The op's arguments: names for the format and mode (the mode's lower-case name, as
    every op takes it), Python scalars, a key tensor. ``name_of``: the format's name for
    the op (default :func:`format_name`; ``fewbit.block`` passes its own)."""
    x = check_tensor(x)
    mode = mode_name(mode)
    sat, bits, fraction = scalar_args(sat, bits, fraction)
    if bits is not None:
        # bits picks the kernel's constants: an int that Dynamo made symbolic (after a second
        # value; it looks like an int) is specialised, a graph for each value as for fraction.
        bits = index(bits)
    if name_of is not None:
        name = name_of(fmt)
    else:  # (most calls give a name: two frames less)
        name = fmt if isinstance(fmt, str) else format_name(fmt)
    return x, name, mode, sat, bits, fraction, op_key(seed, x), random_bits


def op_key(seed, x: torch.Tensor) -> Key | torch.Tensor | None:
    """The key an op takes for a seed. An int seed's (or a Key's) stays a :class:`Key` in
    host memory: the kernels take its words as Python ints, a GPU kernel with its launch,
    and an :class:`~fewbit.operators.Operator` makes it a tensor in host memory only for
    a call through the dispatcher. A key or seed tensor in host memory stays there, eager
    (a GPU kernel takes its words with the launch; a copy to the device would wait for the
    device's queued work). Traced, it is made on x's device."""
    if seed is None:
        return None
    if not torch.compiler.is_compiling():
        if isinstance(seed, (int, Key)):
            return _seed_key(seed) if type(seed) is int else as_key(seed)  # (a bool is refused there)
        host = isinstance(seed, torch.Tensor) and seed.device.type == "cpu"
        return key_of(seed, _HOST if host else x.device)
    return key_of(seed, x.device)


@functools.lru_cache(maxsize=256)
def _seed_key(seed: int) -> Key:
    """An int seed's Key, kept for the seeds used last: a step's calls share one seed, and
    a key looked up takes a fifth of the 0.6 us one made takes (2-core VM). A Key is frozen,
    so the one kept is the one that would be made. Eager only: Dynamo, tracing through a
    cache, warns."""
    return as_key(seed)


@functools.lru_cache(maxsize=1024)
def _named_spec(dtype: torch.dtype, fmt: str, rounding: str, sat: bool, bits: int | None,
                fraction: float | None) -> RoundSpec:  # fmt: skip
    # Keyed by the op's arguments as they come (strings hash once): a name always means one
    # format (lookup_format), and every call looks its spec up.
    return make_spec(dtype, lookup_format(fmt), parse_mode(rounding), sat, bits, fraction)


_HOST = torch.device("cpu")


def check_key(spec: RoundSpec, x: torch.Tensor, key: Key | torch.Tensor | None, random_bits) -> None:
    """A seed's key against the spec and x (and never with random_bits). A key is a Key
    (called without the dispatcher), or a tensor on x's device or in host memory: a GPU
    kernel then takes its words with the launch (an int seed's key comes so, without a
    copy to the device of its own); under a CUDA graph, with the value it had at the
    capture."""
    if key is None:
        return
    if random_bits is not None:
        raise ValueError("give either seed (fewbit draws the bits) or random_bits, not both")
    if spec.bits is None:
        raise ValueError(f"mode {spec.mode.value!r} is deterministic and takes no seed")
    if isinstance(key, Key):
        return
    if key.dtype != torch.int64 or key.shape != (2,) or key.device not in (x.device, _HOST):
        raise ValueError(f"a key is an int64 tensor of shape (2,) on {x.device} or the CPU; got {key.dtype} "
                         f"{tuple(key.shape)} on {key.device} (fewbit.random.key_of makes one)")


def round_into(x, spec: RoundSpec, key, random_bits, out: torch.Tensor) -> None:
    """Round x into out (x's shape and dtype). Nothing is written on an error."""
    rand = check_random_bits(x, spec, random_bits) if key is None else None
    # The kernels write contiguous memory. out is that unless it is strided, or overlaps x
    # or the random bits, or a format without NaN may still refuse the call once rounded:
    # then a temporary takes the result first. An in-place call (out is x's own memory,
    # element for element) is direct on the native kernel, which reads each element before
    # it writes that element's result and no other's: fewbit.round_ costs no copy of x.
    direct = out.is_contiguous() and not spec.may_refuse and (
        not storages_overlap(out, x, rand) or (_in_place(x, out) and native.applies(spec, x, rand)
                                               and not storages_overlap(out, rand)))
    result = out if direct else torch.empty_like(x, memory_format=torch.contiguous_format)
    ints = host_key(key)
    if gpu.applies(spec, x, rand) and gpu.round_into(x, spec, ints, rand, result):  # as native, on a GPU
        invalid = spec.may_refuse
    elif native.applies(spec, x, rand):  # it reads x in memory order, any shape
        words = None if ints is None else stream_words(spec, ints)
        invalid = native.round_into(x, spec, words, rand, result) >= 0
    else:
        flat, flat_result = x.reshape(-1), result.view(-1)
        flat_rand = None if rand is None else rand.reshape(-1)
        if not (use_compiled(flat.numel()) and compiled_round(flat, spec, key, flat_rand, flat_result)):
            _in_chunks(flat, spec, ints, flat_rand, flat_result)
        invalid = spec.may_refuse  # found out by the check below
    if invalid:
        _raise_on_invalid(x, result, spec)
    if not direct:
        out.copy_(result)


def _in_place(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` is ``x``'s memory element for element (``fewbit.round_``)."""
    return out.data_ptr() == x.data_ptr() and out.stride() == x.stride()


def spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a``'s elements lie in meet those of ``b``'s (each from its first
    element to its last; views of one buffer cut apart do not meet)."""
    if not a.numel() or not b.numel():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def storages_overlap(a: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ``a``'s storage shares memory with any of ``others``' (by their bytes: two
    storages may lie over one buffer, as tensors made from one numpy array do)."""
    storage = a.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    for b in others:
        if b is not None:
            other = b.untyped_storage()
            if other.data_ptr() < end and start < other.data_ptr() + other.nbytes():
                return True
    return False


def _in_chunks(
    flat: torch.Tensor, spec: RoundSpec, key: Key | torch.Tensor | None, rand, out: torch.Tensor
) -> None:
    """Eager rounding. On a CPU in chunks of ``config.eager_chunk`` elements: eager torch
    makes one pass over the tensor per op, and chunks keep the intermediates in cache."""
    n = flat.numel()
    chunk = current().eager_chunk if flat.device.type == "cpu" else max(n, 1)
    words = None if key is None else stream_words(spec, key)
    for start in range(0, n, chunk):
        part = flat[start : start + chunk]
        if key is None:
            bits = None if rand is None else rand[start : start + chunk]
        else:
            bits = range_bits(spec, words, start, part.numel(), part.device)
        round_body(part, spec, bits, out[start : start + chunk])


def _raise_on_invalid(work: torch.Tensor, out: torch.Tensor, spec: RoundSpec) -> None:
    # In a format without NaN, a NaN result marks an element with no valid value. This
    # one reduction (a host sync on a GPU) is the only check of data after rounding.
    if bool(torch.isnan(out).any()):
        raise no_result(spec.fmt, nan_input=bool(torch.isnan(work).any()))


def checked_spec(x, fmt, rounding, sat, bits, fraction, key, random_bits) -> RoundSpec:
    """The validated spec of an op call on tensor x (cached by its arguments), once the key
    is checked."""
    spec = _named_spec(x.dtype, fmt, rounding, sat, bits, fraction)
    check_key(spec, x, key, random_bits)
    return spec


def fake_checks(x, fmt, rounding, sat, bits, fraction, key, random_bits) -> None:
    """What can be checked while tracing: everything but the values of random_bits."""
    spec = checked_spec(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    if key is None:
        check_random_bits(x, spec, random_bits, values=False)


@operator("fewbit::round", straight_through=True)
def round_op(
    x: torch.Tensor, fmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None,
) -> torch.Tensor:
    """``fewbit.round`` as an operator (see there)."""
    spec = checked_spec(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    round_into(x, spec, key, random_bits, out)
    return out


def batch_bits(x: torch.Tensor, key, random_bits: torch.Tensor | None) -> tuple[torch.Tensor | None] | None:
    """For an op's vmap rule (x with its batch first): in a 1-tuple, the random_bits of one
    call on the whole batch (bits every sample shares, expanded over the batch; None where
    none are given); or None where each sample takes a call of its own: a key draws each
    sample's own bits, and bits not shaped as a sample are refused by that call, as a call
    on the sample alone refuses them (one call would broadcast them)."""
    if key is not None or (random_bits is not None and random_bits.shape != x.shape[1:]):
        return None
    return (None if random_bits is None else random_bits.expand(x.shape),)


@round_op.register_vmap
def _(x, fmt, rounding, sat, bits, fraction, key, random_bits):
    """One call for a batch rounded deterministically, or with bits given the same for
    every sample (:func:`batch_bits`)."""
    given = batch_bits(x, key, random_bits)
    return None if given is None else (x, fmt, rounding, sat, bits, fraction, key, *given)


@round_op.register_fake
def _(x, fmt, rounding, sat, bits, fraction, key, random_bits):
    fake_checks(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@operator("fewbit::round_into", mutates_args=("out",))
def round_into_op(
    x: torch.Tensor, fmt: str, rounding: str, sat: bool, bits: int | None, fraction: float | None,
    key: torch.Tensor | None, random_bits: torch.Tensor | None, out: torch.Tensor,
) -> None:
    """``fewbit.round(..., out=out)`` and ``fewbit.round_`` as an operator."""
    spec = checked_spec(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    check_out_matches(x, out)
    round_into(x, spec, key, random_bits, out)


@round_into_op.register_fake
def _(x, fmt, rounding, sat, bits, fraction, key, random_bits, out):
    fake_checks(x, fmt, rounding, sat, bits, fraction, key, random_bits)
    check_out_matches(x, out)


def call_with_out(functional, into, args: tuple, x: torch.Tensor, out: torch.Tensor | None,
                  name: str) -> torch.Tensor:  # fmt: skip
    """``functional(*args)``, or with ``out`` the writing op ``into(*args, out)``, returning
    out; refused where autograd would be asked to go through it, as torch's ``out=`` is, and
    for an inference tensor outside inference mode, before anything is written."""
    if out is None:
        return functional(*args)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: out must be a tensor, not {type(out).__name__}")
    backward = torch.is_grad_enabled() and (x.requires_grad or out.requires_grad)
    if backward or has_tangent(x) or has_tangent(out):  # (torch's out= refuses a tangent; this gave 0)
        call, instead = ((f"{name}_ (in place)", f"call {name}(x), which returns a new tensor") if out is x
                         else (f"{name}(..., out=...)", "call it without out="))  # fmt: skip
        why = "an argument requires grad" if backward else "an argument carries a forward-mode tangent"
        raise RuntimeError(f"{call} does not support automatic differentiation, and {why}; {instead}")
    check_writable(name, out)
    into(*args, out)
    return out


def check_writable(name: str, *outs: torch.Tensor) -> None:
    """Refuse, before anything is written, outputs whose memory is not their values
    (:func:`lazily_valued`), elements that share memory (an expanded tensor), and inference
    tensors outside inference mode: torch refuses them once written, which for a call with
    several outputs is after the first is (eager: Dynamo cannot trace these queries)."""
    if torch.compiler.is_compiling():
        return
    inference = torch.is_inference_mode_enabled()
    for out in outs:  # (a loop: round(out=) calls this per tensor, and any() of a generator costs more)
        if lazy := lazily_valued(out, "out"):
            raise TypeError(f"{name}: out is {lazy}")
        if not out.is_contiguous() and _overlaps_itself(out):
            raise RuntimeError(f"{name}: out's elements may share memory (an expanded tensor, say: "
                               f"shape {tuple(out.shape)}, strides {out.stride()}); give a contiguous one")
        if not inference and out.is_inference():
            raise RuntimeError(f"{name}: out is an inference tensor (made under torch.inference_mode), "
                               "which cannot be written outside inference mode")  # fmt: skip


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory: unless each dimension (by stride)
    steps past all that the smaller ones reach. (torch refuses only stride 0; a rarer
    layout that passes between its elements is refused too.)"""
    reach = 0  # the largest offset the dimensions so far reach
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_out_matches(x: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ValueError unless ``out`` has x's shape, dtype and device."""
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must match x: x is {x.dtype} {tuple(x.shape)} on {x.device}, "
                         f"out is {out.dtype} {tuple(out.shape)} on {out.device}")
