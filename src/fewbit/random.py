"""Stateless, counter-based random bits built from plain torch integer ops.

Stochastic rounding needs ``N`` random bits per element (``1 <= N <= 32``).
Here those bits are a pure function of ``(key, element index)``, so they are
identical on CPU and GPU, in eager mode and under ``torch.compile``, and for a
tensor processed whole or in chunks (pass the chunk's start as ``offset``).

The generator is Threefry-2x32 with 20 rounds (``threefry2x32_20`` from
Random123, Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011). It maps a 64-bit counter ``(c0, c1)`` and a 64-bit key ``(k0, k1)``
to 64 random bits ``(x0, x1)`` using only 32-bit add, xor and rotate, which
torch can express exactly; Philox would need a 32x32->64 multiply-high.

Layout of the stream for a key, in rows of ``LANES = 512``:

* block ``b`` (``b >= 0``) is Threefry applied to counter
  ``(b mod 2**32, b // 2**32)``; it gives two 32-bit words ``(x0, x1)``;
* words come in rows of ``LANES``: row ``p`` holds output ``p % 2`` of blocks
  ``(p // 2) * LANES + h`` for ``h = 0 .. LANES - 1`` (word ``w = p * LANES + h``);
* elements come in rows of ``LANES`` too. With ``bits`` bits per element,
  ``per_word = 32 // bits`` elements share a word: element ``i = r * LANES + h``
  takes bits ``[j * bits, (j + 1) * bits)`` (low bits first), ``j = r % per_word``,
  of word ``h`` of word row ``r // per_word``. When ``bits`` does not divide 32
  the top ``32 % bits`` bits of each word are unused.

Rows are what make the bits cheap inside a fused kernel: a row of elements
reads a row of words, so a kernel over ``(rows, LANES)`` loads its words as
contiguous vectors, with no division or gather per element. (With ``i //
per_word`` as the word index, Inductor's C++ kernel gathered every word with
two integer divisions, at a third of the speed.)

Representation: torch has weak ``uint32`` support, so Threefry runs on
``int32`` tensors, whose addition wraps mod ``2**32``; right shifts are
arithmetic, so the rotation masks the sign bits they smear in. Words and
counters given to or returned by the public functions are ``int64`` in
``[0, 2**32)``.

For fusing with rounding inside a ``torch.compile``'d function use the tensor
functions :func:`bits_rows` (whole rows, shaped ``(rows, LANES)``: what the
fused rounding kernel uses), :func:`bits_from_range` (a contiguous range of
elements: one Threefry block per ``2 * per_word`` elements) or
:func:`bits_from_index` (arbitrary indices: one block per element); pass keys as 0-d int64 tensors
(:meth:`Key.tensors`) to avoid recompiling for every new key. The eager path
runs in cache-sized chunks with in-place ops; the traced path is functional
(see :func:`_compile_fence` for what keeps Inductor's compile time linear).
"""

from __future__ import annotations

import array
import functools
import numbers
import operator
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "Key",
    "as_key",
    "fold_in",
    "host_key",
    "key_of",
    "key_tensor",
    "threefry2x32",
    "threefry2x32_int",
    "random_words",
    "random_bits",
    "bits_rows",
    "bits_from_range",
    "bits_from_index",
    "LANES",
    "MAX_BITS",
    "is_dtensor",
    "is_int",
]

MASK32 = 0xFFFFFFFF
#: The most random bits per element (N in 1..MAX_BITS): an element draws from one 32-bit word.
MAX_BITS = 32

# Rotation distances of Threefry-2x32 (Random123's R_32x2_{0..7}); round r
# rotates by ROTATIONS[r % 8]. Taken from the Skein/Threefish design.
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)

# Key-schedule parity constant (Skein's SKEIN_KS_PARITY32). The key schedule is
# (k0, k1, ks2) with ks2 = PARITY ^ k0 ^ k1; the constant keeps the schedule
# from being degenerate for simple keys (e.g. all-zero key -> all-zero schedule).
SKEIN_KS_PARITY32 = 0x1BD11BDA

# Random123's default round count for threefry2x32 ("threefry2x32_20"; 13 is
# the fewest that pass TestU01 BigCrush, 20 adds a safety margin).
DEFAULT_ROUNDS = 20

# A key is injected after every KEY_INJECTION_INTERVAL rounds.
KEY_INJECTION_INTERVAL = 4

_MAX_U32 = 2**32
_MAX_U64 = 2**64
# Largest element index we support: indices live in int64 tensors.
_MAX_INDEX = 2**63 - 1

KeyInt = int | torch.Tensor


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------


def is_int(x: object) -> bool:
    """True for Python/numpy integers, False for bool (a common mistake)."""
    # An int first: the abstract-class check costs a microsecond, and keys are made per call.
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _check_uint(x: object, limit: int, what: str) -> int:
    if type(x) is int and 0 <= x < limit:  # first: keys are made per call
        return x
    if not is_int(x):
        raise TypeError(f"{what} must be an int, got {type(x).__name__}: {x!r}")
    x = int(x)
    if not 0 <= x < limit:
        raise ValueError(f"{what} must be in [0, 2**{limit.bit_length() - 1}), got {x}")
    return x


def check_index(x: object, what: str) -> int:
    """``x``, a place that a key folds in (an int in ``[0, 2**32)``), or a TypeError or
    ValueError naming ``what``."""
    return _check_uint(x, _MAX_U32, what)


def _check_size(x: object, limit: int, what: str) -> int:
    """Like _check_uint for sizes and offsets, which may also be symbolic ints
    (``torch.SymInt``) when traced by ``torch.compile(dynamic=True)``."""
    if isinstance(x, torch.SymInt):
        torch._check(x >= 0, lambda: f"{what} must be non-negative")
        return x  # type: ignore[return-value]
    return _check_uint(x, limit, what)


def _check_bits(bits: object) -> int:
    if not is_int(bits):
        raise ValueError(f"bits must be an int in 1..{MAX_BITS}, got {type(bits).__name__}: {bits!r}")
    bits = int(bits)
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    return bits


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """A 64-bit Threefry key as two 32-bit unsigned ints ``(k0, k1)``."""

    k0: int
    k1: int

    def __post_init__(self) -> None:
        # Normalise numpy ints etc. to Python ints (frozen: use object.__setattr__).
        object.__setattr__(self, "k0", _check_uint(self.k0, _MAX_U32, "Key.k0"))
        object.__setattr__(self, "k1", _check_uint(self.k1, _MAX_U32, "Key.k1"))

    @classmethod
    def from_seed(cls, seed: int) -> Key:
        """Key from an int seed in ``[0, 2**64)``: ``k0`` = low 32 bits, ``k1`` = high."""
        if torch.compiler.is_compiling() and is_int(seed) and seed // 2**63:
            # A compiled graph takes an int that Dynamo made symbolic as an int64 input, with
            # no guard on its range (Dynamo sees an int, not a SymInt, here): one beyond
            # [0, 2**63) is made a constant of a graph of its own, split (or refused) as an int.
            seed = operator.index(seed)
        seed = _check_uint(seed, _MAX_U64, "seed")
        return cls._of_words(seed & MASK32, seed >> 32)

    @classmethod
    def _of_words(cls, k0: int, k1: int) -> Key:
        """The key of two Python ints known to lie in ``[0, 2**32)``, without the checks of
        ``__init__``: keys are made at every call with a seed, and those checks and the
        frozen class's setattr took over a microsecond of it."""
        key = object.__new__(cls)
        # Past the frozen setattr, as __post_init__ goes. (__dict__.update was 10 ns faster,
        # but Dynamo before torch 2.13 cannot trace it.)
        object.__setattr__(key, "k0", k0)
        object.__setattr__(key, "k1", k1)
        return key

    def tensors(
        self, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k0, k1)`` as 0-d int64 tensors (lets a compiled function take any key
        without recompiling)."""
        return key_tensor([self.k0, self.k1], device).unbind()


#: torch's private count of the dispatch modes active (fake tensors, make_fx, a user's),
#: which ``operators.unseen`` reads too; None where this torch lacks it (tests/test_random.py
#: fails first).
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def key_tensor(values: Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    """int64 tensor of ``values`` on ``device``, for keys that a kernel takes as data.
    To a GPU it travels from pinned memory without blocking: a copy from ordinary
    memory first waits for all queued work, which would put each call's host overhead
    after the previous call's kernel instead of beside it."""
    if torch.compiler.is_compiling() or _DISPATCH_MODES is None or _DISPATCH_MODES():
        # Made by torch ops, which the active mode sees (a fake tensor under FakeTensorMode, a
        # constant of make_fx's graph): frombuffer makes a real tensor that no mode sees.
        return torch.tensor(values, dtype=torch.int64, device=device)
    # Made per call with a seed: over an array, 1.5 us; torch.tensor of a list takes 5.
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


def as_key(seed_or_key: Key | int) -> Key:
    """``Key`` -> itself; int -> :meth:`Key.from_seed`; anything else -> TypeError."""
    if isinstance(seed_or_key, Key):
        return seed_or_key
    if is_int(seed_or_key):
        return Key.from_seed(seed_or_key)
    raise TypeError(
        "expected a fewbit.random.Key or an int seed, "
        f"got {type(seed_or_key).__name__}: {seed_or_key!r}"
    )


# A checkpoint holding a Key (a run's, a module's) loads with torch.load's default
# (weights_only=True): the type rebuilds from its two words alone.
torch.serialization.add_safe_globals([Key])


def fold_in(key: Key | int | torch.Tensor, *ints: int | torch.Tensor) -> Key | torch.Tensor:
    """Derive a new key from ``key`` and each int in turn (each in ``[0, 2**64)``).

    One step is ``Key(*threefry2x32_20(counter=(v mod 2**32, v // 2**32), key))``:
    JAX's construction, not its keys (JAX puts a 32-bit ``v`` in the other counter word).
    ``fold_in(k, a, b) == fold_in(fold_in(k, a), b)``; ``fold_in(k)`` is ``k``. The
    child key is block ``v`` of ``k``'s own stream: ``(k0, k1)`` are its words ``w`` and
    ``w + LANES``, where ``w = 2 * LANES * (v // LANES) + v % LANES`` (see
    :func:`random_words`). Derive children for separate uses rather than also drawing
    from the parent.

    With a key tensor (:func:`key_of`) or a value held in a 0-d integer tensor (a step
    counter, say; a negative one stands for ``v + 2**64``, as in :func:`key_of`), the
    same words come back as a key tensor, computed by torch ops: compiled code then folds
    in a new step without recompiling. Under ``torch.compile`` ints are folded in so
    too, and give a key tensor.
    """
    tensors = [t for t in (key, *ints) if isinstance(t, torch.Tensor)]
    if not tensors and not torch.compiler.is_compiling():
        key = as_key(key)
        for v in ints:
            v = _check_uint(v, _MAX_U64, "fold_in value")
            key = Key._of_words(*threefry2x32_int(v & MASK32, v >> 32, key.k0, key.k1))
        return key
    # Traced, ints come here too: Dynamo makes an int argument (a step) symbolic once it has
    # seen two values, and Threefry in Python ints on a symbolic one builds sympy expressions
    # that never finish simplifying; on tensors, one graph serves every step.
    device = tensors[0].device if tensors else None
    k = key_of(key, device)
    for v in ints:
        v = _traced_numpy(v)
        if not isinstance(v, torch.Tensor):
            v = _check_uint(v, _MAX_U64, "fold_in value")
        elif v.dim():  # key_of would take a (2,) tensor as a counter's words, unchecked
            raise ValueError(f"a fold_in value tensor is 0-d (one value), not of shape {tuple(v.shape)}; "
                             "fold in several values as separate arguments")  # fmt: skip
        c = key_of(v, device)  # the counter (v mod 2**32, v // 2**32): a seed's two words
        k = torch.stack(threefry2x32(c[0], c[1], k[0], k[1]))
    return k


def host_key(key: Key | torch.Tensor | None) -> Key | torch.Tensor | None:
    """A key in host memory as Python ints (a :class:`Key`), which the native kernel, the
    eager generator and the GPU kernel's launch take; a key on a device as it is."""
    if key is None or type(key) is Key:  # most calls: isinstance of a non-tensor takes 90 ns
        return key
    if isinstance(key, torch.Tensor) and key.is_cpu:
        k0, k1 = key.tolist()
        # The words mod 2**32, as Threefry reads a key tensor: int32 holds a word's bit pattern.
        return Key._of_words(k0 & MASK32, k1 & MASK32)
    return key


#: torch's own tensor classes, which no DTensor is.
_TORCH_OWN = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    if type(t) in _TORCH_OWN:  # most calls (a step asks of every weight): half the time of the rest
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def replicated_piece(t, what: str) -> torch.Tensor:
    """The piece of DTensor ``t`` that every rank holds whole (Replicate: a step counter or
    a count that ``distribute_module`` made a DTensor), else a ValueError naming ``what``."""
    if not all(p.is_replicate() for p in t.placements):
        raise ValueError(f"{what} must be Replicate, not {t.placements}")
    return t.to_local()


def _traced_numpy(v: object) -> object:
    """``v``, or, traced, a numpy integer (``np.int64(7)``, which eager code takes as an int)
    as the 0-d tensor it holds: Dynamo shows it as a 0-d ndarray, which no int check takes
    (the TypeError's repr of it failed ``fullgraph=True`` with Dynamo's "repr() on tensor").
    As a tensor it is data, as a seed tensor is: one graph for every seed."""
    if torch.compiler.is_compiling() and isinstance(v, np.ndarray):
        return torch.as_tensor(v)
    return v


def key_of(seed: Key | int | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A key as a tensor: int64 ``(k0, k1)`` of shape ``(2,)`` on ``device``, the form
    fewbit's operators take (a new key is new data, not a new graph).

    ``seed``: a :class:`Key`, an int seed (as :meth:`Key.from_seed`), an integer tensor of
    shape ``(2,)`` (a key tensor, passed through as int64; its words are read mod ``2**32``,
    so int32 may hold their bit patterns), or a 0-d integer tensor holding a seed
    (split as :meth:`Key.from_seed` splits an int; int64 holds ``[0, 2**63)``, and a
    negative value stands for its 64-bit pattern, ``v + 2**64``, as a uint64 would: no
    host sync checks it). Under ``torch.compile`` an int seed that Dynamo made symbolic
    is split alike, and a numpy integer is taken as the seed tensor it holds (a negative
    one standing for its 64-bit pattern, as there).
    """
    if is_dtensor(seed):  # (DTensor's >> gave its input: torch 2.13 made the seed 5 the key (5, 5))
        seed = replicated_piece(seed, "a seed tensor that is a DTensor")
    seed = _traced_numpy(seed)
    if isinstance(seed, torch.Tensor):
        if seed.dtype in (torch.bool,) or seed.is_floating_point() or seed.is_complex():
            raise TypeError(f"a seed tensor must have an integer dtype, not {seed.dtype}")
        target = torch.device(device) if device is not None else seed.device
        if seed.is_meta and target.type != "meta":  # (torch: "Cannot copy out of meta tensor")
            raise ValueError(f"a seed tensor on the meta device holds no seed for data on {target}: "
                             "give it on the CPU or the data's device")  # fmt: skip
        seed = seed.to(device=target, dtype=torch.int64)
        if seed.shape == (2,):
            return seed
        if seed.dim() != 0:
            raise ValueError(f"a seed tensor is 0-d (a seed) or of shape (2,) (a key), "
                             f"not {tuple(seed.shape)}")
        return torch.stack((seed & MASK32, (seed >> 32) & MASK32))
    if isinstance(seed, torch.SymInt):
        return key_of(torch.tensor(seed, dtype=torch.int64, device=device), device)
    key = as_key(seed)  # (a traced int seed beyond int64: see Key.from_seed)
    return key_tensor([key.k0, key.k1], device)


# --------------------------------------------------------------------------
# Threefry-2x32
# --------------------------------------------------------------------------


@functools.cache
def _schedule(rounds: int) -> tuple[tuple[int, int], ...]:
    """Each round's rotation, and the number i of the key injection after it (0: none)."""
    every = KEY_INJECTION_INTERVAL
    return tuple((ROTATIONS[r % 8], (r + 1) // every if r % every == every - 1 else 0) for r in range(rounds))


def threefry2x32_int(
    c0: int, c1: int, k0: int, k1: int, *, rounds: int = DEFAULT_ROUNDS
) -> tuple[int, int]:
    """Scalar pure-Python Threefry-2x32 (reference; used by :func:`fold_in`, once per key
    an optimizer step derives: the rounds' schedule is looked up, the rotation inlined)."""
    ks = (k0, k1, SKEIN_KS_PARITY32 ^ k0 ^ k1)
    x0 = (c0 + k0) & MASK32
    x1 = (c1 + k1) & MASK32
    for rotation, i in _schedule(rounds):
        x0 = (x0 + x1) & MASK32
        x1 = (((x1 << rotation) | (x1 >> (32 - rotation))) & MASK32) ^ x0
        if i:
            x0 = (x0 + ks[i % 3]) & MASK32
            x1 = (x1 + ks[(i + 1) % 3] + i) & MASK32
    return x0, x1


def _compile_fence(t: torch.Tensor) -> torch.Tensor:
    """Identity, but makes TorchInductor store ``t`` as a buffer.

    Inductor inlines pointwise producers into their consumers by re-evaluating
    them at every use. Threefry's state words are each used two or three times
    per round, so without a fence lowering expands a tree of ~3.4**rounds ops
    (minutes, or hangs, for 20 rounds). An identity ``as_strided`` forces
    realisation, yet the scheduler still fuses all rounds into one loop, so
    the generated kernel keeps everything in registers.
    """
    return t.as_strided(t.size(), t.stride())


def _signed32(v: int) -> int:
    """The int32 value with the bits of ``v mod 2**32``."""
    v &= MASK32
    return v - (1 << 32) if v >> 31 else v


def _to_int32(t: torch.Tensor) -> torch.Tensor:
    """int64 tensor of values in ``[0, 2**32)`` -> int32 tensor of the same bits
    (spelled out: a narrowing cast of values beyond int32 is not defined)."""
    return (t - ((t & 0x80000000) << 1)).to(torch.int32)


def _counter(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry's counter for int64 block indices: ``(b mod 2**32, b // 2**32)`` as int32."""
    return _to_int32(block & MASK32), (block >> 32).to(torch.int32)


def _key_schedule(k0: KeyInt, k1: KeyInt, rounds: int = DEFAULT_ROUNDS) -> list:
    """The values Threefry adds at injection ``i`` (the initial one is 0, then one
    every ``KEY_INJECTION_INTERVAL`` rounds): ``(a_i, b_i)`` with
    ``a_i = ks[i % 3]`` and ``b_i = ks[(i + 1) % 3] + i``, as int32 (Python ints
    or 0-d int32 tensors), where ``ks = (k0, k1, k0 ^ k1 ^ PARITY)``."""
    injections = rounds // KEY_INJECTION_INTERVAL + 1
    if isinstance(k0, torch.Tensor) or isinstance(k1, torch.Tensor):
        device = k0.device if isinstance(k0, torch.Tensor) else k1.device
        t0, t1 = (_to_int32(torch.as_tensor(k, dtype=torch.int64, device=device)) for k in (k0, k1))
        ks = (t0, t1, t0 ^ t1 ^ _signed32(SKEIN_KS_PARITY32))
        return [(ks[i % 3], ks[(i + 1) % 3] + i) for i in range(injections)]  # int32 wraps
    ks = (k0, k1, SKEIN_KS_PARITY32 ^ k0 ^ k1)
    return [(_signed32(ks[i % 3]), _signed32(ks[(i + 1) % 3] + i)) for i in range(injections)]


def _threefry32(
    c0: torch.Tensor, c1: torch.Tensor, schedule: list, rounds: int = DEFAULT_ROUNDS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 on int32 tensors, functional (eager or traced).

    int32 lanes: two's-complement addition is addition mod 2**32, and a
    vector holds twice as many of them as of int64. The right half of a
    rotation is an arithmetic shift, so its sign-extended bits are masked.
    """
    fence = torch.compiler.is_compiling()  # eager needs no fence
    x0 = c0 + schedule[0][0]
    x1 = c1 + schedule[0][1]
    for r in range(rounds):
        rot = ROTATIONS[r % 8]
        x0 = x0 + x1
        x1 = ((x1 << rot) | ((x1 >> (32 - rot)) & ((1 << rot) - 1))) ^ x0
        if r % KEY_INJECTION_INTERVAL == KEY_INJECTION_INTERVAL - 1:
            # Key injection i: the key schedule rotated by i, plus i into x1
            # (Skein's defence against slide attacks).
            a, b = schedule[(r + 1) // KEY_INJECTION_INTERVAL]
            x0 = x0 + a
            x1 = x1 + b
        if fence and r < rounds - 1:  # the last round fuses into the consumer
            x0, x1 = _compile_fence(x0), _compile_fence(x1)
    return x0, x1


def _threefry32_inplace(
    c0: torch.Tensor, c1: torch.Tensor, schedule: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager fast path of :func:`_threefry32` (20 rounds, int keys): the same
    arithmetic in place, so no allocation per op (3-4x faster on CPU when the
    block fits in cache). Consumes ``c0``, ``c1`` (overwritten)."""
    x0 = c0.add_(schedule[0][0])
    x1 = c1.add_(schedule[0][1])
    tmp = torch.empty_like(x1)
    for r in range(DEFAULT_ROUNDS):
        rot = ROTATIONS[r % 8]
        x0.add_(x1)
        torch.bitwise_left_shift(x1, rot, out=tmp)
        x1.bitwise_right_shift_(32 - rot).bitwise_and_((1 << rot) - 1).bitwise_or_(tmp).bitwise_xor_(x0)
        if r % KEY_INJECTION_INTERVAL == KEY_INJECTION_INTERVAL - 1:
            a, b = schedule[(r + 1) // KEY_INJECTION_INTERVAL]
            x0.add_(a)
            x1.add_(b)
    return x0, x1


def threefry2x32(
    c0: torch.Tensor,
    c1: torch.Tensor,
    k0: KeyInt,
    k1: KeyInt,
    *,
    rounds: int = DEFAULT_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 on int64 tensors of counters (values in ``[0, 2**32)``).

    ``k0``/``k1`` are Python ints or (0-d or broadcastable) int64 tensors in
    ``[0, 2**32)``. Returns ``(x0, x1)``, int64 tensors with values in
    ``[0, 2**32)``. Pure functional torch ops: works on any device and under
    ``torch.compile(fullgraph=True)``.
    """
    x0, x1 = _threefry32(_to_int32(c0), _to_int32(c1), _key_schedule(k0, k1, rounds), rounds)
    return x0.to(torch.int64) & MASK32, x1.to(torch.int64) & MASK32


# --------------------------------------------------------------------------
# Streams of words and bits
# --------------------------------------------------------------------------

#: Elements (and words) per row of the stream layout; see the module docstring.
LANES = 512

# Eager generation works on chunks of this many rows of blocks, so that the
# state (two int32 tensors + a temporary) stays in L2 cache across the ~130 ops
# of 20 rounds, and each op stays single-threaded (below torch's parallel grain
# size; threading such short ops costs more than it gains).
_EAGER_CHUNK_BLOCK_ROWS = 32


def _block_rows(first: int, n: int, k0: KeyInt, k1: KeyInt, device, *, inplace: bool) -> torch.Tensor:
    """Words of rows ``first .. first + n`` of blocks as int32 ``(n, 2, LANES)``:
    ``[g, s, h]`` is output ``s`` of block ``(first + g) * LANES + h``, i.e. word
    ``h`` of word row ``2 * (first + g) + s``. ``inplace``: the eager fast path
    (int keys only)."""
    block = torch.arange(first * LANES, (first + n) * LANES, dtype=torch.int64, device=device)
    x0, x1 = (_threefry32_inplace if inplace else _threefry32)(*_counter(block), _key_schedule(k0, k1))
    if torch.compiler.is_compiling():
        # Stored as float32 bits and read back as int32: Inductor's C++ backend loads an
        # int32 vector through a copy on the stack (a stalled store-to-load forward per
        # load), a float32 one directly. The last Threefry round, left unfenced, writes
        # straight into the stacked buffer.
        x0, x1 = x0.view(torch.float32), x1.view(torch.float32)
        return torch.stack((x0.view(n, LANES), x1.view(n, LANES)), dim=1).view(torch.int32)
    return torch.stack((x0.view(n, LANES), x1.view(n, LANES)), dim=1)


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``(n, 2, LANES)`` (see :func:`_block_rows`) -> their ``bits``-bit
    fields as rows ``(n * 2 * per_word, LANES)``: element row ``r`` takes field
    ``r % per_word`` (bits ``[j*bits, (j+1)*bits)``) of word row ``r // per_word``.
    int64 for ``bits == 32`` (values up to ``2**32 - 1``), else int32: the arithmetic
    shift only smears the sign into bits the mask removes."""
    if bits == 32:
        return (words.to(torch.int64) & MASK32).reshape(-1, LANES)
    per_word = 32 // bits
    if per_word > 1:
        # Traced, a tensor, not an arange: Inductor would fold an arange into an index
        # expression, which Triton types int64 when the row is symbolic, making the fields
        # int64. Eager, an arange: a tensor copied to a GPU waits for its queued work.
        span = range(0, per_word * bits, bits)
        shifts = (torch.tensor(span, dtype=torch.int32, device=words.device) if torch.compiler.is_compiling()
                  else torch.arange(span.start, span.stop, span.step, dtype=torch.int32, device=words.device))
        words = words[:, :, None, :] >> shifts[:, None]
    return (words & ((1 << bits) - 1)).reshape(-1, LANES)


def bits_rows(row0: int, n_rows: int, bits: int, k0: KeyInt, k1: KeyInt, *,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Values of elements ``[row0 * LANES, (row0 + n_rows) * LANES)`` as a
    ``(n_rows, LANES)`` tensor (int32, or int64 for ``bits == 32``).

    The form the fused kernel uses: row ``r`` of elements reads row
    ``r // per_word`` of words, so a kernel over ``(n_rows, LANES)`` loads its
    words as contiguous vectors. Keys as for :func:`bits_from_range`;
    ``row0``/``n_rows`` may be symbolic under ``torch.compile``. Arguments are
    not checked (internal fast path).
    """
    rows_per_block_row = 2 * (32 // bits)
    first = row0 // rows_per_block_row
    end = (row0 + n_rows - 1) // rows_per_block_row + 1
    inplace = not torch.compiler.is_compiling() and isinstance(k0, int) and isinstance(k1, int)
    values = _fields(_block_rows(first, end - first, k0, k1, device, inplace=inplace), bits)
    start = row0 - first * rows_per_block_row
    return values[start : start + n_rows]


def _key_words(key: Key | int | torch.Tensor, device) -> tuple[KeyInt, KeyInt]:
    """A key's two words: ints, or traced or given as a key tensor, 0-d tensors
    (:func:`key_of`, which also takes an int seed Dynamo made symbolic, and one beyond
    int64, as a graph input cannot be; traced, :func:`fold_in` gives a key tensor)."""
    if torch.compiler.is_compiling() or isinstance(key, torch.Tensor):
        return key_of(key, device).unbind()
    checked = as_key(key)
    return checked.k0, checked.k1


def _check_key_words(k0: object, k1: object) -> tuple[KeyInt, KeyInt]:
    """Key words given apart: ints in ``[0, 2**32)``, or 0-d integer tensors (their values
    are not read: that would wait for a GPU or break a compiled graph)."""
    words = []
    for k, what in ((k0, "k0"), (k1, "k1")):
        if isinstance(k, torch.Tensor):
            if k.dim() != 0 or k.dtype.is_floating_point or k.dtype.is_complex or k.dtype == torch.bool:
                raise TypeError(f"{what} must be an int or a 0-d integer tensor, got {k.dtype} of shape "
                                f"{tuple(k.shape)}")
            words.append(k)
        else:
            words.append(_check_size(k, 2**32, what))
    return words[0], words[1]


def _check_range(offset: object, n: int) -> int:
    offset = _check_size(offset, _MAX_INDEX + 1, "offset")
    symbolic = isinstance(offset, torch.SymInt) or isinstance(n, torch.SymInt)
    if not symbolic and offset + n > _MAX_INDEX + 1:
        raise ValueError(f"offset + size must be <= 2**63, got {offset} + {n}")
    return offset


def random_words(
    n_words: int,
    key: Key | int | torch.Tensor,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int64 tensor of the 32-bit words ``[offset, offset + n_words)`` of ``key``'s
    stream (values in ``[0, 2**32)``). Word ``w`` is output ``(w // LANES) % 2``
    of the Threefry-2x32-20 block ``b = (w // (2 * LANES)) * LANES + w % LANES``,
    whose counter is ``(b mod 2**32, b // 2**32)``."""
    k0, k1 = _key_words(key, device)
    n_words = _check_size(n_words, _MAX_INDEX + 1, "n_words")
    offset = _check_range(offset, n_words)
    # With 32 bits per element, element w takes the whole of word w.
    return _bits_range(offset, n_words, 32, k0, k1, device, torch.int64)


# Integer dtypes random_bits can return, with how many value bits they hold.
_DTYPE_VALUE_BITS = {
    torch.uint8: 8,
    torch.int8: 7,
    torch.int16: 15,
    torch.int32: 31,
    torch.int64: 63,
}


def _default_dtype(bits: int) -> torch.dtype:
    return torch.int32 if bits <= 31 else torch.int64


def _as_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if is_int(shape) or isinstance(shape, torch.SymInt):
        shape = (shape,)
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"shape must be an int or a sequence of ints, got {type(shape).__name__}"
        ) from None
    return tuple(_check_size(d, _MAX_INDEX + 1, "shape entry") for d in dims)


def _bits_range(
    offset: int, n: int, bits: int, k0: KeyInt, k1: KeyInt, device, dtype: torch.dtype
) -> torch.Tensor:
    """Flat ``dtype`` tensor of the ``bits``-bit values of elements
    ``[offset, offset + n)`` (arguments already validated). ``device`` None: a key tensor's
    device (a key on a GPU, or on the meta device, makes its bits there), else the CPU."""
    if device is None:  # (the CPU's arange beside a key on another device was torch's device error)
        device = next((k.device for k in (k0, k1) if isinstance(k, torch.Tensor)), None)
    first = offset // LANES  # rows of elements
    end = (offset + n + LANES - 1) // LANES
    skip = offset - first * LANES  # leading elements of the first row to drop

    if torch.compiler.is_compiling() or not (isinstance(k0, int) and isinstance(k1, int)):
        # One functional graph; under torch.compile the bits fuse with their consumer.
        if not isinstance(k0, torch.Tensor) and not isinstance(k1, torch.Tensor):
            # Key words as data: ints Dynamo made symbolic, mixed into int32 tensor arithmetic,
            # made a C++ kernel Inductor could not compile; as tensors one graph serves every key.
            k0, k1 = key_tensor([k0, k1], device).unbind()
        if isinstance(offset, torch.SymInt) or isinstance(n, torch.SymInt):
            # Symbolic sizes that Python sees (torch.export, make_fx; Dynamo shows them as ints):
            # bits_rows' row counts would be guarded on, and an export with a Dim refused.
            return _symbolic_range(offset, n, bits, k0, k1, device).to(dtype)
        values = bits_rows(first, end - first, bits, k0, k1, device=device).reshape(-1)
        return values[skip : skip + n].to(dtype)

    # Eager: generate cache-sized chunks of rows (whole rows of blocks, so no
    # block is computed twice) straight into the output. A GPU takes the range in one
    # chunk: it has no such cache to fit, and each chunk costs some 130 kernel launches.
    out = torch.empty(n, dtype=dtype, device=device)
    per_block_row = 2 * (32 // bits)  # element rows per row of blocks
    block_rows = _EAGER_CHUNK_BLOCK_ROWS if out.device.type == "cpu" else end // per_block_row + 1
    chunk = per_block_row * block_rows
    pos = 0  # elements written so far
    for aligned in range(first - first % per_block_row, end, chunk):
        row = max(aligned, first)
        values = bits_rows(row, min(aligned + chunk, end) - row, bits, k0, k1, device=device).reshape(-1)
        values = values[skip : skip + n] if pos == 0 else values[: n - pos]
        out[pos : pos + values.numel()] = values
        pos += values.numel()
    return out


def _symbolic_range(offset, n: int, bits: int, k0: torch.Tensor, k1: torch.Tensor, device) -> torch.Tensor:
    """:func:`_bits_range`'s values (int32, int64 for ``bits == 32``) where ``offset`` or ``n``
    is symbolic (traced with a dynamic shape). The rows of :func:`bits_rows` are shapes, on
    whose counts torch guards (a view's and a stack's contiguity, the slices' bounds): a
    graph for one row, one for one row of blocks, one for more, and ``torch.export`` with a
    ``Dim`` refused. Here the shapes are the element count and a block count alone, and
    each element picks its word from its block by index: the same values, one graph."""
    per_word = 32 // bits
    span = 2 * per_word * LANES  # elements per row of blocks
    first = offset // span
    # The rows of blocks the range meets, at most: a count that is plainly positive (the exact
    # one, a difference of two floors, would be guarded on, and an export refused again).
    blocks = (n + span - 1) // span + 1
    x0, x1 = _threefry32(*_counter(torch.arange(blocks * LANES, device=device) + first * LANES),
                         _key_schedule(k0, k1))  # fmt: skip
    index = torch.arange(n, device=device) + offset
    row = index // LANES
    at = ((row // per_word >> 1) - first) * LANES + index - row * LANES  # the element's block, and its lane
    return _element_field(x0[at], x1[at], row, bits)


def _element_field(x0: torch.Tensor, x1: torch.Tensor, row: torch.Tensor, bits: int) -> torch.Tensor:
    """The value of each element of rows ``row``, from the two outputs of its Threefry
    block: word row ``p = row // per_word`` takes output ``p mod 2``, and the element its
    field ``row mod per_word`` of that word (int32; int64 for ``bits == 32``)."""
    per_word = 32 // bits
    word_row = row // per_word
    word = torch.where((word_row & 1) == 1, x1, x0)
    if bits == 32:
        return word.to(torch.int64) & MASK32
    return (word >> ((row - word_row * per_word) * bits).to(torch.int32)) & ((1 << bits) - 1)


def random_bits(
    shape: int | Sequence[int],
    bits: int,
    key: Key | int | torch.Tensor,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Random ``bits``-bit values (in ``[0, 2**bits)``), one per element of ``shape``.

    Element ``i = offset + flat_position`` (row-major) takes the values the
    module docstring's layout gives index ``i``. So
    ``random_bits((n,), b, k, offset=o)`` equals ``random_bits((o + n,), b, k)[o:]``:
    a tensor processed in chunks gets exactly the bits it would get whole.

    ``device``: where the bits are made; by default a key tensor's device, else the CPU.
    ``bits``: int in 1..32, else ValueError. ``dtype``: default ``torch.int32``
    for ``bits <= 31`` and ``torch.int64`` for ``bits == 32``; any of uint8,
    int8, int16, int32, int64 that can hold ``bits`` non-negative bits is
    accepted (ValueError otherwise). Computes each Threefry block once, for
    ``2 * per_word`` elements.

    Works under ``torch.compile``: the key's words enter the graph as data, so once Dynamo
    has made the ints it saw change symbolic (a graph or two later) a new key or seed
    below 2**63 does not recompile (one beyond int64, which a graph input cannot hold, is
    a graph of its own); :meth:`Key.tensors` with :func:`bits_from_range` needs one graph.
    ``key`` may also be a key tensor (:func:`key_of`), which :func:`fold_in` gives traced.
    """
    bits = _check_bits(bits)
    k0, k1 = _key_words(key, device)
    dims = _as_shape(shape)
    if dtype is None:
        dtype = _default_dtype(bits)
    if dtype not in _DTYPE_VALUE_BITS:
        raise ValueError(f"dtype must be one of {sorted(map(str, _DTYPE_VALUE_BITS))}, got {dtype}")
    if bits > _DTYPE_VALUE_BITS[dtype]:
        raise ValueError(f"dtype {dtype} cannot hold {bits}-bit values; use torch.int64")
    n = 1
    for d in dims:
        n *= d
    offset = _check_range(offset, n)
    return _bits_range(offset, n, bits, k0, k1, device, dtype).reshape(dims)


def bits_from_range(
    offset: int,
    n: int,
    bits: int,
    k0: KeyInt,
    k1: KeyInt,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Values of elements ``[offset, offset + n)``, flat; the same values as
    :func:`random_bits`. Returns int32 for ``bits <= 31``, int64 for ``bits == 32``.

    The tensor-level form for compiled code: ``k0``/``k1`` may be 0-d int64
    tensors (:meth:`Key.tensors`) so that a new key needs no recompilation;
    ``offset``/``n`` may be symbolic under ``torch.compile(dynamic=True)``.
    Costs one Threefry block per ``2 * per_word`` elements, plus the part rows
    at either end.
    """
    bits = _check_bits(bits)
    k0, k1 = _check_key_words(k0, k1)
    n = _check_size(n, _MAX_INDEX + 1, "n")
    offset = _check_range(offset, n)
    on_host = not any(isinstance(k, torch.Tensor) and k.device.type != "cpu" for k in (k0, k1))
    if not torch.compiler.is_compiling() and on_host:
        # Eager: the fast in-place path takes the keys as Python ints. Keys on a GPU stay
        # tensors (reading them back would wait for the device).
        k0, k1 = int(k0), int(k1)
    return _bits_range(offset, n, bits, k0, k1, device, _default_dtype(bits))


def bits_from_index(index: torch.Tensor, bits: int, k0: KeyInt, k1: KeyInt) -> torch.Tensor:
    """Values for arbitrary element indices (an int64 or int32 tensor, each in
    ``[0, 2**63)``: not checked, as reading them would wait for a GPU; a negative
    index gives unspecified bits), the same as :func:`random_bits` gives those elements.
    Returns int32 (``bits <= 31``) or int64 (``bits == 32``) with ``index``'s
    shape and device. Keys: ints in ``[0, 2**32)`` or 0-d integer tensors.

    A pure function of tensors (keys: ints or 0-d int64 tensors, e.g. from
    :meth:`Key.tensors`) for use inside ``torch.compile(fullgraph=True)`` code,
    fused with the consumer. Each element runs its own Threefry block, i.e.
    ``2 * per_word`` times the work of :func:`bits_from_range`; prefer that
    for contiguous ranges.
    """
    bits = _check_bits(bits)
    k0, k1 = _check_key_words(k0, k1)
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
        got = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
        raise TypeError(f"index must be an int64 or int32 tensor, got {got}")
    row = index // LANES
    block = (row // (32 // bits) >> 1) * LANES + index - row * LANES  # its word row's block, its lane
    return _element_field(*_threefry32(*_counter(block), _key_schedule(k0, k1)), row, bits)
