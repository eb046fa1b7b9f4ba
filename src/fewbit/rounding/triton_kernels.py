"""The Triton code of fewbit's GPU kernel (``gpu.py`` launches it; importing this module
needs Triton).

One program rounds ``ROWS`` rows of ``LANES`` elements of the stream's layout
(``fewbit.random``). With drawn bits, ``ROWS = 2 * per_word``: the rows that read one row
of Threefry blocks, whose words the program computes once, for ``LANES`` blocks, and then
splits into fields row by row, as native.cpp's ``Stream`` does; so a word is generated
once per ``per_word`` elements instead of once per element. The rounding is native.cpp's, path
for path: ``round_one`` (fast.round_fast on float32 bits) for every mode, and the
float-adder RNE and SRC (magic.py) and classical SR where native.py takes them, a few
instructions an element instead of some forty, with the format's parameters as
compile-time constants; a 16-bit input is widened and the result narrowed
in the same pass, so each element is read and written once, in its own width. Block
formats take the same pass: a row's blocks are scaled (native.cpp's ``scale_blocks``)
before the rounding, and scaled back or encoded after it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..random import LANES as _LANES
from ..random import SKEIN_KS_PARITY32
from .modes import SELECT_BITS as _SELECT_BITS
from .modes import SELECT_KEY as _SELECT_KEY

LANES = tl.constexpr(_LANES)
PARITY = tl.constexpr(SKEIN_KS_PARITY32)
SELECT_BITS = tl.constexpr(_SELECT_BITS)
SELECT_KEY = tl.constexpr(_SELECT_KEY)
NAN_BITS = tl.constexpr(0x7FC00000)
SIGN_BIT = tl.constexpr(-(1 << 31))  # 0x80000000 as an int32


@triton.jit
def _mix(x0, x1, R: tl.constexpr):
    """One Threefry round: x0 += x1, x1 = rotl(x1, R) ^ x0 (uint32)."""
    x0 = x0 + x1
    x1 = ((x1 << R) | (x1 >> (32 - R))) ^ x0
    return x0, x1


@triton.jit
def _four(x0, x1, ka, kb, i: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
          R3: tl.constexpr):  # fmt: skip
    """Four rounds, then key injection ``i`` (ka, kb: ks[i % 3], ks[(i + 1) % 3])."""
    x0, x1 = _mix(x0, x1, R0)
    x0, x1 = _mix(x0, x1, R1)
    x0, x1 = _mix(x0, x1, R2)
    x0, x1 = _mix(x0, x1, R3)
    return x0 + ka, x1 + kb + i


@triton.jit
def threefry(block, k0, k1):
    """Threefry-2x32-20 of int64 block numbers ``block`` (counter ``(block mod 2^32,
    block / 2^32)``) under key ``(k0, k1)`` (uint32): its two output words (uint32)."""
    k2 = k0 ^ k1 ^ PARITY
    x0 = (block & 0xFFFFFFFF).to(tl.uint32) + k0
    x1 = (block >> 32).to(tl.uint32) + k1
    x0, x1 = _four(x0, x1, k1, k2, 1, 13, 15, 26, 6)
    x0, x1 = _four(x0, x1, k2, k0, 2, 17, 29, 16, 24)
    x0, x1 = _four(x0, x1, k0, k1, 3, 13, 15, 26, 6)
    x0, x1 = _four(x0, x1, k1, k2, 4, 17, 29, 16, 24)
    x0, x1 = _four(x0, x1, k2, k0, 5, 13, 15, 26, 6)
    return x0, x1


@triton.jit
def _select_bits(row, lanes, s0, s1):
    """The selection stream's 16-bit fields of element row ``row`` (sr_fraction), drawn
    per row: word row row / 2, block row row / 4."""
    x0, x1 = threefry((row // 4) * LANES + lanes, s0, s1)
    word = tl.where((row // 2) % 2 == 0, x0, x1)
    return ((word >> ((row % 2) * SELECT_BITS).to(tl.uint32)) & 0xFFFF).to(tl.int32)


@triton.jit
def _few_bit_away(rem, D, n, BITS: tl.constexpr, TIE: tl.constexpr):
    """native.cpp's few_bit_away: d_N = d 2^N by the tie rule (TIE 0: truncate, 1: up,
    2: even, 3: odd), and away iff n > 2^N - 1 - d_N."""
    shift = D - BITS
    right = tl.minimum(tl.maximum(shift, 0), 25)
    left = tl.minimum(tl.maximum(-shift, 0), BITS)
    q = rem >> right
    if TIE == 0:
        d_n = tl.where(shift > 0, q, rem << left)
    else:
        one = tl.full(rem.shape, 1, tl.int32)
        low2 = (rem & ((one << right) - 1)) << 1
        half2 = one << right
        if TIE == 1:
            up = low2 >= half2
        else:
            tie_up = (q & 1) == (3 - TIE)  # even: q odd; odd: q even
            up = (low2 > half2) | ((low2 == half2) & tie_up)
        d_n = tl.where(shift > 0, q + up.to(tl.int32), rem << left)
    return n > ((1 << BITS) - 1) - d_n


@triton.jit
def round_bits(b, n, s, MODE: tl.constexpr, T: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
               MIN_ULP_EXP: tl.constexpr, SUBNORMAL_BELOW: tl.constexpr, MAX: tl.constexpr,
               MAX_NEG: tl.constexpr, BEYOND_POS: tl.constexpr, BEYOND_NEG: tl.constexpr,
               SMALLEST_NORMAL: tl.constexpr, P_IS_1: tl.constexpr, HAS_NZ: tl.constexpr,
               HAS_ZERO: tl.constexpr, SAT: tl.constexpr, LIMIT_RULE: tl.constexpr, BITS: tl.constexpr,
               SELECT_BELOW: tl.constexpr):  # fmt: skip
    """native.cpp's round_one on int32 float32 bits ``b``: n the N random bits, s the
    selection bits (MODE: native.cpp's ``Mode``)."""
    negative = b < 0
    a = b & 0x7FFFFFFF
    is_inf = a == 0x7F800000
    is_nan = a > 0x7F800000
    e_field = a >> 23
    mantissa = a & 0x7FFFFF
    sig = tl.where(e_field > 0, mantissa | 0x800000, mantissa)
    e_x = tl.maximum(e_field, 1) - 127
    e_t = tl.maximum(e_x, EMIN)
    D = (23 - T) + (e_t - e_x)
    Dc = tl.minimum(D, 25)
    r = sig >> Dc
    one = tl.full(b.shape, 1, tl.int32) << Dc
    rem = sig & (one - 1)
    rem2 = rem << 1
    if P_IS_1:  # P = 1: the code's last bit is the exponent field's
        odd = (r != 0) & (((e_t + BIAS) & 1) == 1)
    else:
        odd = (r & 1) == 1
    nearest_even = (rem2 > one) | ((rem2 == one) & odd)
    if MODE == 0:  # RNE
        away = nearest_even
    elif MODE == 1:  # RNA
        away = rem2 >= one
    elif MODE == 2:  # RTZ
        away = rem < 0
    elif MODE == 3:  # RUP
        away = (rem != 0) & ~negative
    elif MODE == 4:  # RDN
        away = (rem != 0) & negative
    elif MODE == 5:  # RTO
        away = (rem != 0) & ~odd
    elif MODE == 6:  # SRFF
        away = _few_bit_away(rem, D, n, BITS, 0)
    elif MODE == 7:  # SRF
        away = _few_bit_away(rem, D, n, BITS, 1)
    elif MODE == 9:  # SRC with ties to odd
        away = _few_bit_away(rem, D, n, BITS, 3)
    elif MODE == 10:  # SR near zero, RNE elsewhere
        stochastic = _few_bit_away(rem, D, n, BITS, 2)
        away = tl.where((r == 0) & ~nearest_even, stochastic, nearest_even)
    elif MODE == 11:  # SR on the selected fraction of elements, RNE elsewhere
        stochastic = _few_bit_away(rem, D, n, BITS, 2)
        away = tl.where(s < SELECT_BELOW, stochastic, nearest_even)
    else:  # SRC
        away = _few_bit_away(rem, D, n, BITS, 2)
    r = r + away.to(tl.int32)

    normal = ((e_t + 126) << 23) + (r << (23 - T))
    # r 2^MIN_ULP_EXP in integer arithmetic, where a float multiply might flush a float32
    # subnormal to zero: those (r below SUBNORMAL_BELOW, 2^-126 / 2^MIN_ULP_EXP or 1) are r
    # shifted into place, the others float(r) (exact, r < 2^24) with MIN_ULP_EXP added to
    # its exponent.
    scaled = r.to(tl.float32).to(tl.int32, bitcast=True) + (MIN_ULP_EXP << 23)
    if SUBNORMAL_BELOW > 1:
        tiny = tl.where(r < SUBNORMAL_BELOW, r << (MIN_ULP_EXP + 149), scaled)
    else:  # (and no shift by 32 or more, which LLVM leaves undefined)
        tiny = tl.where(r == 0, 0, scaled)
    mag = tl.where(r >= (1 << T), normal, tiny)

    limit = tl.where(negative, MAX_NEG, MAX)
    over = (mag > limit) | is_inf
    mag = tl.where(over, tl.where(negative, BEYOND_NEG, BEYOND_POS), mag)
    if SAT:
        mag = tl.where(over, limit, mag)
    elif LIMIT_RULE == 1:  # directed modes stop at the limit: everywhere
        mag = tl.where(over & ~is_inf, limit, mag)
    elif LIMIT_RULE == 2:  # below zero
        mag = tl.where(over & ~is_inf & negative, limit, mag)
    elif LIMIT_RULE == 3:  # above zero
        mag = tl.where(over & ~is_inf & ~negative, limit, mag)
    if HAS_NZ:
        keep_sign = negative
    else:
        keep_sign = negative & (mag != 0)
    if not HAS_ZERO:
        mag = tl.where(mag == 0, SMALLEST_NORMAL, mag)
    out = tl.where(keep_sign, mag | SIGN_BIT, mag)
    return tl.where(is_nan, NAN_BITS, out)


@triton.jit
def _magic_core(b, n, SR: tl.constexpr, EMIN: tl.constexpr, MAGIC_SCALE: tl.constexpr, BITS: tl.constexpr):
    """The float adder's sum for x's bits ``b`` (RNE, or SRC with N = BITS random bits
    ``n``), before the range and NaN are looked at; and x's sign bit."""
    sign = b & SIGN_BIT
    # 2^e_t, not clamped at 2^emax as native.cpp's is: magic_applies keeps the constant a
    # float32 up to emax, so only an x beyond the range (Inf among them) can make it
    # overflow, into a NaN y (Inf - Inf) that the callers' compare takes as beyond. An
    # instruction less an element.
    c = tl.maximum(b & 0x7F800000, (EMIN + 127) << 23)
    if SR:
        c = c | sign
    big = c.to(tl.float32, bitcast=True) * MAGIC_SCALE  # exact: a power of two times 1 or 1.5
    y = b.to(tl.float32, bitcast=True) + big
    if SR:
        y = ((y.to(tl.int32, bitcast=True) + n) & -(1 << BITS)).to(tl.float32, bitcast=True)
    return y - big, sign


@triton.jit
def _magic_bits(b, n, SR: tl.constexpr, EMIN: tl.constexpr, MAGIC_SCALE: tl.constexpr, BITS: tl.constexpr,
                MAX: tl.constexpr, BEYOND: tl.constexpr, HAS_NZ: tl.constexpr):  # fmt: skip
    """native.cpp's magic_one (magic.round_magic): RNE, or SRC with N = BITS, by the float
    adder, where magic.magic_applies. BEYOND: what lies beyond MAX (MAX itself with sat)."""
    y, sign = _magic_core(b, n, SR, EMIN, MAGIC_SCALE, BITS)
    out = y.to(tl.int32, bitcast=True)
    if HAS_NZ:
        out = out | sign  # -0 where the subtraction gave +0
    # |y| > max (or NaN) as floats, as native.cpp's magic_one: one compare. A NaN x is found
    # from x itself (x != x, one compare too): a GPU's NaN sum is 0x7FFFFFFF, which n would
    # carry into the sign bit.
    within = tl.abs(y) <= tl.full((), MAX, tl.int32).to(tl.float32, bitcast=True)
    out = tl.where(within, out, BEYOND | sign)
    x = b.to(tl.float32, bitcast=True)
    return tl.where(x != x, NAN_BITS, out)


@triton.jit
def _magic_code(b, n, SR: tl.constexpr, EMIN: tl.constexpr, MAGIC_SCALE: tl.constexpr, BITS: tl.constexpr,
                MAX: tl.constexpr, T: tl.constexpr, K: tl.constexpr, BEYOND_MAG: tl.constexpr,
                HAS_NZ: tl.constexpr, CODE_OF_NAN: tl.constexpr):  # fmt: skip
    """The code of :func:`_magic_bits`'s result, as _code_of gives it, for a signed
    sign-magnitude format whose beyond is a code of its own (the largest value with sat,
    else Inf: ``BEYOND_MAG``): fewbit.quantize's path, without _magic_bits's choice of bits
    for beyond and NaN nor _code_of's cases for Inf and NaN, which are known here."""
    y, sign = _magic_core(b, n, SR, EMIN, MAGIC_SCALE, BITS)
    a = tl.abs(y)
    within = a <= tl.full((), MAX, tl.int32).to(tl.float32, bitcast=True)
    mag = _code_scaled(a, EMIN).to(tl.int32, bitcast=True) >> (23 - T)  # as _code_of's
    mag = tl.where(within, mag, BEYOND_MAG)
    negative = sign != 0
    if not HAS_NZ:
        negative = negative & (mag != 0)  # a zero result is +0
    code = tl.where(negative, mag | (1 << (K - 1)), mag)
    x = b.to(tl.float32, bitcast=True)
    return tl.where(x != x, CODE_OF_NAN, code)


@triton.jit
def _classical_sr_bits(b, n, EMIN: tl.constexpr, BITS: tl.constexpr, MAX: tl.constexpr, BEYOND: tl.constexpr,
                       HAS_NZ: tl.constexpr):  # fmt: skip
    """native.cpp's classical_sr_one: SRC with N = 23 - t, where native.classical_sr_applies."""
    a = b & 0x7FFFFFFF
    two_emin = tl.full(b.shape, (EMIN + 127) << 23, tl.int32)
    normal = a >= two_emin
    tiny = (a.to(tl.float32, bitcast=True) + two_emin.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    k = (tl.where(normal, a, tiny) + n) & -(1 << BITS)
    back = (k.to(tl.float32, bitcast=True) - two_emin.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    mag = tl.where(normal, k, back)
    mag = tl.where(mag > MAX, BEYOND, mag)
    if HAS_NZ:
        keep_sign = b < 0
    else:
        keep_sign = (b < 0) & (mag != 0)
    out = tl.where(keep_sign, mag | SIGN_BIT, mag)
    return tl.where(a > 0x7F800000, NAN_BITS, out)


@triton.jit(do_not_specialize=["n", "offset", "first_row", "per_run", "stride", "k0", "k1", "s0", "s1"],
            do_not_specialize_on_alignment=["x_ptr", "out_ptr", "given_ptr", "key_ptr", "scales_ptr",
                                            "ts_ptr"])
def round_kernel(x_ptr, out_ptr, given_ptr, key_ptr, scales_ptr, ts_ptr, n: tl.int64, offset: tl.int64,
                 first_row: tl.int64, per_run: tl.int64, stride: tl.int64, k0: tl.int64, k1: tl.int64,
                 s0: tl.int64, s1: tl.int64, ROWS: tl.constexpr, DRAWN: tl.constexpr, GIVEN: tl.constexpr,
                 PER_WORD: tl.constexpr, MODE: tl.constexpr, T: tl.constexpr, EMIN: tl.constexpr,
                 BIAS: tl.constexpr, MIN_ULP_EXP: tl.constexpr, SUBNORMAL_BELOW: tl.constexpr,
                 MAX: tl.constexpr, MAX_NEG: tl.constexpr, BEYOND_POS: tl.constexpr, BEYOND_NEG: tl.constexpr,
                 SMALLEST_NORMAL: tl.constexpr, P_IS_1: tl.constexpr, HAS_NZ: tl.constexpr,
                 HAS_ZERO: tl.constexpr, SAT: tl.constexpr, LIMIT_RULE: tl.constexpr, BITS: tl.constexpr,
                 SELECT_BELOW: tl.constexpr, MAGIC_SCALE: tl.constexpr, BEYOND: tl.constexpr,
                 FOREACH: tl.constexpr, VIA: tl.constexpr, TENSORS: tl.constexpr, ALIGNED: tl.constexpr,
                 HOST_KEY: tl.constexpr, CODES: tl.constexpr, K: tl.constexpr, CODE_OF_MAX: tl.constexpr,
                 CODE_OF_NAN: tl.constexpr, HAS_NANS: tl.constexpr, EXTENDED: tl.constexpr,
                 SIGNED: tl.constexpr, TWOS_COMPLEMENT: tl.constexpr, BLOCK: tl.constexpr, RULE: tl.constexpr,
                 EMAX: tl.constexpr, RCEIL_FRACTION: tl.constexpr, EVEN_FRACTION: tl.constexpr,
                 ELEMENT_MAX: tl.constexpr, RUNS: tl.constexpr):  # fmt: skip
    """Round stream elements ``offset .. offset + n`` (x and out hold them from 0) of rows
    ``first_row + program * ROWS ..``: bits drawn with the words at key_ptr (``DRAWN``:
    k0, k1, then the selection stream's for MODE 11), or with the words k0, k1 (and s0,
    s1) themselves (``HOST_KEY``: a key the host holds, which then travels with the
    launch, not in a copy of its own), or given at given_ptr (``GIVEN``:
    the N bits low, the selection bits above them), or none. MODE: native.py's kernel
    ids, native.cpp's ``Mode`` and its float-adder (13, 14) and classical SR (15) paths.

    ``FOREACH``: round ``n`` tensors in place, each from 0 of its own stream, as
    gpu.round_foreach_ lays them out in the int64 table at x_ptr: the tensors'
    addresses, sizes, indices i and first programs (``n`` of each, ``n`` at most
    ``TENSORS``). Tensor i draws with ``fold_in(key, step, i)``, derived here from the key
    k0, k1 and the step (in ``offset``) that come with the launch (the table holds nothing
    that changes from step to step). out_ptr: any tensor of theirs (for the dtype); each
    size and address is a multiple of 16.
    ``VIA``: the dtype each element is first rounded to (RNE), as ``x.to(VIA)``; None:
    x's own.

    ``ALIGNED`` (always, with FOREACH): x and out (and the given bits) lie at multiples of
    16 bytes, and n and offset are multiples of 16 (with FOREACH, each tensor's size, and
    its stream's start, 0: offset carries the step), so that a row's loads and stores can
    be 16 bytes each. The host says so (``gpu.aligned``) rather than Triton finding it
    from the arguments, which it is told not to look at: a launch is then known by its
    constants and dtypes alone, and gpu.py can launch a compiled kernel again without
    Triton's binding of them. It is said of each row's bounds and addresses: the
    compiler keeps no hint on an argument itself.

    ``CODES`` (fewbit.quantize): out takes the results' codes (_code_of, with the format's
    K .. TWOS_COMPLEMENT), one an element (1) or two a byte (2: the even element's in the
    low nibble; offset and n even), instead of the values in x's dtype (0).

    ``BLOCK`` (fewbit.block, B > 0 elements a block, dividing LANES; offset and n
    multiples of B: blocks outside the call's lanes hold zeros, and are not stored): each
    block of x is scaled by its S before rounding (_scale_blocks, by ``RULE``: native.py's
    ids, power-of-two scales below 4, E4M3 ones times the float32 at ts_ptr from 4), and
    the values are ``q S`` in x's dtype; with CODES, the blocks' scale codes go to
    scales_ptr, one a block.

    ``RUNS``: x holds runs of ``n`` elements, run r being stream elements ``offset + r *
    stride ..`` (a Shard(1) piece, a run a row; with BLOCK, values only), ``per_run``
    programs each, from the row of blocks that holds its first element (first_row
    unused)."""
    lanes = tl.arange(0, LANES)
    # quantize of a float-adder rounding (MODE 13, 14) into a sign-magnitude format whose
    # beyond has a code (the largest value with sat, else Inf): the code in one go.
    MAGIC_CODE: tl.constexpr = (CODES != 0 and MODE >= 13 and MODE != 15 and SIGNED and not TWOS_COMPLEMENT
                                and (SAT or EXTENDED))  # fmt: skip
    BEYOND_MAG: tl.constexpr = CODE_OF_MAX if SAT else CODE_OF_MAX + 1
    if FOREACH:  # the program's tensor: the last to start at or before it
        table, tensors, program = x_ptr, n, tl.program_id(0)
        j = tl.arange(0, TENSORS)
        starts = tl.load(table + 3 * tensors + j, mask=j < tensors, other=1 << 62)
        slot = tl.sum((starts <= program).to(tl.int32)) - 1
        x_ptr = tl.load(table + slot).to(tl.pointer_type(out_ptr.dtype.element_ty))
        out_ptr = x_ptr
        n = tl.load(table + tensors + slot)
        row0 = (program - tl.load(table + 3 * tensors + slot)) * ROWS
        if DRAWN:  # fold_in(key, step, i), the step in offset (below 2**63)
            # Through uint64: interpreted, a step in [2**31, 2**32) is uint32 data under an int64
            # type, which .to(int64) keeps and numpy's >> 32 returns whole (compiled: no-ops).
            step = offset.to(tl.uint64).to(tl.int64)
            k0, k1 = threefry(step, k0.to(tl.uint32), k1.to(tl.uint32))
            k0, k1 = threefry(tl.load(table + 2 * tensors + slot), k0, k1)
        offset = tl.full((), 0, tl.int64)  # each tensor is its stream from 0
    else:
        program = tl.program_id(0).to(tl.int64)
        if RUNS:  # the program's run, as if it were a call of its own
            run = program // per_run
            program -= run * per_run
            x_ptr += run * n
            if CODES == 2:  # two a byte (n and stride even)
                out_ptr += run * n // 2
            else:
                out_ptr += run * n
            if GIVEN:
                given_ptr += run * n
            offset += run * stride
            first_row = offset // LANES // ROWS * ROWS
        row0 = first_row + program * ROWS
        if DRAWN and HOST_KEY:  # (as int64s: a word's top bit set is no sign to the launch)
            k0, k1, s0, s1 = k0.to(tl.uint32), k1.to(tl.uint32), s0.to(tl.uint32), s1.to(tl.uint32)
        elif DRAWN:
            k0 = tl.load(key_ptr).to(tl.uint32)
            k1 = tl.load(key_ptr + 1).to(tl.uint32)
    if DRAWN:  # the program's row of blocks, whose words its ROWS = 2 * PER_WORD rows read
        w0, w1 = threefry((row0 // ROWS) * LANES + lanes, k0, k1)
        if PER_WORD > 1:
            # Row r's bits are field r of both words' used fields end to end (w0's PER_WORD,
            # then w1's): a 64-bit shift a row, whose low half is one funnel shift (sm_90:
            # two instructions an element less than selecting the word, then shifting).
            # (A constexpr: a plain name would hold an int32, and 1 << 32 in int32 is
            # undefined, which let the compiler drop the whole computation for used = 32.)
            used: tl.constexpr = PER_WORD * BITS
            words = (w0 & ((1 << used) - 1)).to(tl.uint64) | (w1.to(tl.uint64) << used)
        if MODE == 11:
            if FOREACH:  # fold_in(key, SELECT_KEY)
                s0, s1 = threefry(tl.full((), SELECT_KEY, tl.int64), k0, k1)
            elif not HOST_KEY:
                s0 = tl.load(key_ptr + 2).to(tl.uint32)
                s1 = tl.load(key_ptr + 3).to(tl.uint32)
    if BLOCK > 0 and RULE >= 4 and ts_ptr is not None:  # (E4M3 scales without a tensor scale: 1)
        ts = tl.load(ts_ptr)
    else:
        ts = 1.0
    # Only the rows that hold elements: a small tensor need not fill the program's rows.
    first = tl.maximum(offset // LANES - row0, 0)
    # offset + n may be the stream's end, 2^63: rounding up from it would overflow int64.
    end = tl.minimum(offset // LANES + (offset % LANES + n + LANES - 1) // LANES - row0, ROWS)
    for r in range(first, end):
        row = row0 + r
        # Element index of lane 0, and the lanes that hold elements: the bounds as scalars, so
        # that each lane compares 32-bit lane numbers (and, ALIGNED, loads 16 bytes at a time).
        base = row * LANES - offset
        lo, hi = tl.maximum(-base, 0).to(tl.int32), tl.minimum(n - base, LANES).to(tl.int32)
        x_row, out_row, given_row = x_ptr + base, out_ptr + base, given_ptr + base if GIVEN else None
        if ALIGNED:
            lo, hi = tl.multiple_of(lo, 16), tl.multiple_of(hi, 16)
            x_row, out_row = tl.multiple_of(x_row, 16), tl.multiple_of(out_row, 16)
            if GIVEN:
                given_row = tl.multiple_of(given_row, 16)
        inside = (lanes >= lo) & (lanes < hi)
        b = _load_bits(x_row, lanes, inside, VIA)
        if BLOCK > 0:  # x / S; a row holds whole blocks
            b, factor, scale_code = _scale_blocks(b, ts, BLOCK, RULE, EMAX, RCEIL_FRACTION, EVEN_FRACTION,
                                                  ELEMENT_MAX, HAS_NANS, MODE)  # fmt: skip
            if CODES != 0:
                j = tl.arange(0, LANES // BLOCK)
                tl.store(scales_ptr + base // BLOCK + j, scale_code.to(tl.uint8),
                         mask=(j * BLOCK >= lo) & (j * BLOCK < hi))  # fmt: skip
        bits = b  # read by the stochastic modes only
        select = b
        if DRAWN:
            if PER_WORD > 1:
                field = tl.cast(r, tl.int32) * BITS  # (r in 64 bits: ten instructions a row)
                bits = ((words >> tl.cast(field, tl.uint64)) & ((1 << BITS) - 1)).to(tl.int32)
            else:  # a word a row
                bits = (tl.where(r == 0, w0, w1) & ((1 << BITS) - 1)).to(tl.int32)
            if MODE == 11:
                select = _select_bits(row, lanes, s0, s1)
        if GIVEN:
            g = tl.load(given_row + lanes, mask=inside, other=0)
            bits = g & ((1 << BITS) - 1)
            select = (g.to(tl.uint32) >> BITS).to(tl.int32)
        if MAGIC_CODE:
            code = _magic_code(b, bits, MODE == 14, EMIN, MAGIC_SCALE, BITS, MAX, T, K, BEYOND_MAG, HAS_NZ,
                               CODE_OF_NAN)  # fmt: skip
        else:
            if MODE < 13:
                y = round_bits(b, bits, select, MODE, T, EMIN, BIAS, MIN_ULP_EXP, SUBNORMAL_BELOW, MAX,
                               MAX_NEG, BEYOND_POS, BEYOND_NEG, SMALLEST_NORMAL, P_IS_1, HAS_NZ, HAS_ZERO,
                               SAT, LIMIT_RULE, BITS, SELECT_BELOW)  # fmt: skip
            elif MODE == 15:
                y = _classical_sr_bits(b, bits, EMIN, BITS, MAX, BEYOND, HAS_NZ)
            else:
                y = _magic_bits(b, bits, MODE == 14, EMIN, MAGIC_SCALE, BITS, MAX, BEYOND, HAS_NZ)
            if CODES == 0:
                if BLOCK > 0:  # q S in float32, then x's dtype, as block.kernel multiplies and converts
                    scaled_back = y.to(tl.float32, bitcast=True) * factor.to(tl.float32, bitcast=True)
                    y = scaled_back.to(tl.int32, bitcast=True)
                    if out_ptr.dtype.element_ty == tl.bfloat16:
                        y = _to_bfloat16(y)
                if out_ptr.dtype.element_ty == tl.bfloat16:  # a value of the format: its low half is 0
                    y = (y >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
                else:
                    y = y.to(tl.float32, bitcast=True).to(out_ptr.dtype.element_ty)
                tl.store(out_row + lanes, y, mask=inside)
            else:
                code = _code_of(y, T, EMIN, K, CODE_OF_MAX, CODE_OF_NAN, HAS_NZ, HAS_NANS, EXTENDED, SIGNED,
                                TWOS_COMPLEMENT)  # fmt: skip
        if CODES != 0:
            if CODES == 1:
                tl.store(out_row + lanes, code.to(out_ptr.dtype.element_ty), mask=inside)
            else:  # byte j of the row: lanes 2j (low nibble) and 2j + 1, which lie inside together
                pairs = tl.reshape(code & 15, (LANES // 2, 2))
                byte = tl.sum(pairs << (4 * tl.arange(0, 2))[None, :], axis=1)
                j = tl.arange(0, LANES // 2)
                tl.store(out_ptr + base // 2 + j, byte.to(tl.uint8), mask=(2 * j >= lo) & (2 * j < hi))


@triton.jit
def _load_bits(x_ptr, i, inside, VIA: tl.constexpr = None):
    """Elements i of x (float32 or 16-bit) as the int32 bits of their float32 values, or
    of ``x.to(VIA)``'s (round to nearest even)."""
    x = tl.load(x_ptr + i, mask=inside, other=0.0)
    if x_ptr.dtype.element_ty == tl.bfloat16:  # float32's high half: no conversion to trust
        b = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        b = x.to(tl.float32).to(tl.int32, bitcast=True)
    if VIA == tl.bfloat16 and x_ptr.dtype.element_ty != tl.bfloat16:
        b = _to_bfloat16(b)
    elif VIA == tl.float16 and x_ptr.dtype.element_ty != tl.float16:  # RNE, on a GPU and in numpy
        b = x.to(tl.float16).to(tl.float32).to(tl.int32, bitcast=True)
    return b


@triton.jit
def _to_bfloat16(b):
    """float32 bits ``b`` rounded to bfloat16 (its low half 0) to nearest even, as torch converts:
    in integers, where Triton's interpreter truncates (a GPU's cvt.rn does not)."""
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, b, (b + 0x7FFF + ((b >> 16) & 1)) & -(1 << 16))


@triton.jit
def _per_element(v, BLOCK: tl.constexpr):
    """A row's per-block values ``v`` (LANES / BLOCK) repeated for each element of the block."""
    return tl.reshape(tl.broadcast_to(v[:, None], (LANES // BLOCK, BLOCK)), (LANES,))


@triton.jit
def _pow2_bits(e):
    """2^e as float32 bits, e in [-127, 127] (2^-127 is a subnormal)."""
    return tl.where(e >= -126, (e + 127) << 23, 0x00400000)


@triton.jit
def _block_exponent(amax, RULE: tl.constexpr, EMAX: tl.constexpr, RCEIL_FRACTION: tl.constexpr,
                    EVEN_FRACTION: tl.constexpr):  # fmt: skip
    """native.cpp's block_exponent (block.kernel._exponent_of): floor(log2 amax) - emax, plus
    1 where RULE rounds up (ceil: a fraction; rceil: m above max's; even: m rounds to 2 at
    P bits), clamped to E8M0's [-127, 127]; amax (float32 bits, not NaN) = m 2^E. A
    subnormal amax, an integer times 2^-149, is normalised exactly as that integer's float."""
    normal = amax >= 0x00800000
    g = tl.where(normal, amax, amax.to(tl.float32).to(tl.int32, bitcast=True))
    exponent = (g >> 23) - tl.where(normal, 127, 127 + 149)
    fraction = g & 0x7FFFFF
    if RULE == 1:
        up = fraction != 0
    elif RULE == 2:
        up = fraction > RCEIL_FRACTION
    elif RULE == 3:
        up = fraction >= EVEN_FRACTION
    else:  # floor
        up = fraction < 0
    e = tl.minimum(tl.maximum(exponent - EMAX + up.to(tl.int32), -127), 127)
    return tl.where(amax == 0x7F800000, 127, tl.where(amax == 0, -127, e))  # zeros: -127, as gfloat


@triton.jit
def _pow2_f64(k):
    """2^k as a float64, k (int64) in [-1022, 1023]."""
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _e4m3_scale(target, UP: tl.constexpr):
    """native.cpp's e4m3_scale: ``target`` (float64, not negative) rounded to E4M3 to nearest
    even (or UP), saturating at 448; the scale (float64) and its code. A NaN target's
    results are the caller's to replace."""
    e = tl.maximum((target.to(tl.int64, bitcast=True) >> 52) - 1023, -6)
    q = tl.minimum(target * _pow2_f64(3 - e), 16.0)  # exact; at most 16 below 448
    r = (q + 2.0**52) - 2.0**52  # to nearest even: q + 2^52 keeps no fraction
    if UP:
        r = r + (r < q).to(tl.float64)
    sat = ~(target < 448.0)  # Inf too
    code = tl.where(sat, 0x7E, 8 * (e + 6) + r.to(tl.int64)).to(tl.int32)  # subnormals (e = -6, r < 8) too
    return tl.where(sat, 448.0, r * _pow2_f64(e - 3)), code


@triton.jit
def _scale_blocks(b, ts, BLOCK: tl.constexpr, RULE: tl.constexpr, EMAX: tl.constexpr,
                  RCEIL_FRACTION: tl.constexpr, EVEN_FRACTION: tl.constexpr, ELEMENT_MAX: tl.constexpr,
                  HAS_NANS: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """block.kernel.quantize_blocks up to the rounding, on a row of whole blocks (float32
    bits ``b``, 0 outside the call): the bits of x / S, each element's S (float32 bits) and
    each block's scale code. S: 2^e by RULE (E8M0; x / S then is x 2^-e, correctly rounded
    alike), or the block's E4M3 scale times ``ts`` (x / S correctly rounded; a division in
    Triton is not, by default). A quotient below float32's normal range rounds as
    +-2^-126, a block whose S is 0 holds zeros signed as x, and a block holding a NaN has S NaN, the
    scale code 0xFF and its elements NaN (0 without NaN in the format)."""
    a = b & 0x7FFFFFFF
    amax = tl.max(tl.reshape(a, (LANES // BLOCK, BLOCK)), axis=1)
    nan = amax > 0x7F800000
    x = b.to(tl.float32, bitcast=True)
    if RULE < 4:
        e = _block_exponent(amax, RULE, EMAX, RCEIL_FRACTION, EVEN_FRACTION)
        factor, code = _pow2_bits(e), e + 127
        q = x * _per_element(_pow2_bits(-e), BLOCK).to(tl.float32, bitcast=True)
    else:
        top = amax.to(tl.float32, bitcast=True).to(tl.float64)
        scale, code = _e4m3_scale(top / ELEMENT_MAX / ts.to(tl.float64), RULE == 5)
        if RULE == 5:  # up: where S rounds below amax / M, the next scale (native.cpp's scale_blocks)
            upper, upper_code = _e4m3_scale(scale * (1 + 2.0**-5), True)
            short = (scale.to(tl.float32) * ts).to(tl.float64) * ELEMENT_MAX < top
            scale, code = tl.where(short, upper, scale), tl.where(short, upper_code, code)
        factor = (scale.to(tl.float32) * ts).to(tl.int32, bitcast=True)
        q = tl.math.div_rn(x, _per_element(factor, BLOCK).to(tl.float32, bitcast=True))
    factor = tl.where(nan, NAN_BITS, factor)
    s = _per_element(factor, BLOCK)
    q = q.to(tl.int32, bitcast=True)
    # Below float32's normals x / S rounds as +-2^-126 does, 0 included, but in the modes that
    # round away by sign or parity (RUP, RDN, RTO): N <= 30 random bits reach no element
    # ulp from there (block.kernel). So 2^-126 takes its place in those modes, and where S
    # is no power of two (whose quotient is no exact product), as native.cpp's scale_blocks.
    if MODE == 3 or MODE == 4 or MODE == 5 or RULE >= 4:
        q = tl.where(((q & 0x7FFFFFFF) < 0x00800000) & (a != 0), (b & SIGN_BIT) | 0x00800000, q)
    if RULE >= 4:  # (2^e is never 0)
        q = tl.where(s == 0, b & SIGN_BIT, q)  # zeros, signed as x
    q = tl.where(s > 0x7F800000, NAN_BITS if HAS_NANS else 0, q)  # S NaN: a NaN block
    return q, s, tl.where(nan, 0xFF, code)


@triton.jit
def _code_scaled(a, EMIN: tl.constexpr):
    """a * 2^(-126 - emin), exact: in two steps where that factor is below float32's
    smallest (emin > 23, a hand-made format of large values), as native.cpp's code_of."""
    if EMIN > 23:
        return (a * (2.0**-126)) * (2.0 ** (-EMIN))
    else:
        return a * (2.0 ** (-126 - EMIN))


@triton.jit
def _code_of(b, T: tl.constexpr, EMIN: tl.constexpr, K: tl.constexpr, CODE_OF_MAX: tl.constexpr,
             CODE_OF_NAN: tl.constexpr, HAS_NZ: tl.constexpr, HAS_NANS: tl.constexpr, EXTENDED: tl.constexpr,
             SIGNED: tl.constexpr, TWOS_COMPLEMENT: tl.constexpr):  # fmt: skip
    """native.cpp's code_of for float32 bits ``b`` that hold a value of the format: scaled
    by 2^(-126 - emin) (exact, into float32's subnormals for the format's), a value's
    float32 bits are its code's magnitude shifted left by 23 - t."""
    negative = b < 0
    a = b & 0x7FFFFFFF
    mag = _code_scaled(a.to(tl.float32, bitcast=True), EMIN).to(tl.int32, bitcast=True) >> (23 - T)
    if EXTENDED:
        mag = tl.where(a == 0x7F800000, CODE_OF_MAX + 1, mag)
    if HAS_NANS:
        mag = tl.where(a > 0x7F800000, CODE_OF_NAN, mag)
    if TWOS_COMPLEMENT:
        code = tl.where(negative, -mag, mag) & ((1 << K) - 1)
    elif not SIGNED:
        code = mag
    else:
        keep_sign = negative & (a <= 0x7F800000)
        if not HAS_NZ:
            keep_sign = keep_sign & (mag != 0)
        code = tl.where(keep_sign, mag | (1 << (K - 1)), mag)
    # (Kept to K bits, as native.cpp's: a code, if unspecified, for an element that is no
    # value, which encode without its check lets through.)
    return code & ((1 << K) - 1)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr", "out_ptr", "bad_ptr"])
def encode_kernel(x_ptr, out_ptr, bad_ptr, n: tl.int64, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                  PACKED: tl.constexpr, T: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                  MIN_ULP_EXP: tl.constexpr, SUBNORMAL_BELOW: tl.constexpr, MAX: tl.constexpr,
                  MAX_NEG: tl.constexpr, BEYOND_POS: tl.constexpr, BEYOND_NEG: tl.constexpr,
                  SMALLEST_NORMAL: tl.constexpr, P_IS_1: tl.constexpr, HAS_NZ: tl.constexpr,
                  HAS_ZERO: tl.constexpr, K: tl.constexpr, CODE_OF_MAX: tl.constexpr,
                  CODE_OF_NAN: tl.constexpr, HAS_NANS: tl.constexpr, EXTENDED: tl.constexpr,
                  SIGNED: tl.constexpr, TWOS_COMPLEMENT: tl.constexpr, MAGIC: tl.constexpr,
                  MAGIC_SCALE: tl.constexpr, ALIGNED: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    """Codes of x[0 .. n) into out, BLOCKS blocks of BLOCK codes a program (PACKED: BLOCK
    bytes of two 4-bit codes, the even element's low; n even), and into bad_ptr (an int64
    holding n) the least position holding no value of the format, if any (an atomic min
    from each program that finds one; see _no_value). -0 encodes as +0 without -0.
    Bounds as scalars, as in round_kernel; the branches on PACKED are resolved when the
    kernel compiles. A program's blocks only note, lane by lane, whether an element was
    no value; a program that found one, which makes the call raise, reads its blocks
    again for the first. Keeping the least position in the loop cost three instructions a
    code (sm_90: float32 to e4m3 23.7 a code, 22.0 so; packed e2m1 27, 21.4), and its
    reduction per block of 1024 a barrier each. ``ALIGNED``: as round_kernel's, for x,
    out and n. Without ``CHECK`` nothing is checked (bad_ptr is unused): x holds values
    of the format, and another element gets whatever code _code_of makes of it."""
    lanes = tl.arange(0, BLOCK)
    if PACKED:  # [BLOCK, 2]: each byte's two elements, adjacent in memory
        index = 2 * lanes[:, None] + tl.arange(0, 2)[None, :]
    else:
        index = lanes
    PER: tl.constexpr = 2 if PACKED else 1  # elements a code (or byte)
    first_base = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS)  # the program's first code (or byte)
    seen = tl.zeros(index.shape, tl.int32)  # lane by lane: whether a block held an element that is no value
    for block in range(BLOCKS):
        b, inside, end = _block_bits(x_ptr, n, first_base + block * BLOCK, index, BLOCK, PER, ALIGNED)
        if CHECK:
            bad = inside & _no_value(b, T, EMIN, BIAS, MIN_ULP_EXP, SUBNORMAL_BELOW, MAX, MAX_NEG,
                                     BEYOND_POS, BEYOND_NEG, SMALLEST_NORMAL, P_IS_1, HAS_NZ, HAS_ZERO,
                                     HAS_NANS, EXTENDED, MAGIC, MAGIC_SCALE)  # fmt: skip
            seen = seen | bad.to(tl.int32)
        code = _code_of(b, T, EMIN, K, CODE_OF_MAX, CODE_OF_NAN, HAS_NZ, HAS_NANS, EXTENDED, SIGNED,
                        TWOS_COMPLEMENT)  # fmt: skip
        out_block = out_ptr + first_base + block * BLOCK
        if ALIGNED:
            out_block = tl.multiple_of(out_block, 16)
        if PACKED:
            # disjoint bits, the sum an or: each code kept to its nibble (one that is no value,
            # which CHECK False lets through, may have more bits)
            byte = tl.sum((code & 15) << (4 * tl.arange(0, 2))[None, :], axis=1)
            tl.store(out_block + lanes, byte.to(tl.uint8), mask=lanes < end // 2)  # (n is even)
        else:
            tl.store(out_block + lanes, code.to(out_ptr.dtype.element_ty), mask=inside)
    if CHECK:
        if tl.max(seen) > 0:  # rare (the call then raises): which element came first, block by block
            least = tl.full(index.shape, PER * BLOCK * BLOCKS, tl.int32)  # PER BLOCK BLOCKS: none
            for block in range(BLOCKS):
                b, inside, end = _block_bits(x_ptr, n, first_base + block * BLOCK, index, BLOCK, PER, ALIGNED)
                bad = inside & _no_value(b, T, EMIN, BIAS, MIN_ULP_EXP, SUBNORMAL_BELOW, MAX, MAX_NEG,
                                         BEYOND_POS, BEYOND_NEG, SMALLEST_NORMAL, P_IS_1, HAS_NZ, HAS_ZERO,
                                         HAS_NANS, EXTENDED, MAGIC, MAGIC_SCALE)  # fmt: skip
                least = tl.minimum(least, tl.where(bad, index + block * PER * BLOCK, least))
            tl.atomic_min(bad_ptr, PER * first_base + tl.min(least))


@triton.jit
def _block_bits(x_ptr, n, base, index, BLOCK: tl.constexpr, PER: tl.constexpr, ALIGNED: tl.constexpr):
    """encode_kernel's (and finite_amax_kernel's) block from code (or byte) ``base``: its
    elements' float32 bits (0 beyond n), the lanes within n, and how many elements it holds
    (at most PER BLOCK)."""
    end = tl.minimum(n - PER * base, PER * BLOCK).to(tl.int32)
    x_block = x_ptr + PER * base
    if ALIGNED:
        end, x_block = tl.multiple_of(end, 16), tl.multiple_of(x_block, 16)
    inside = index < end
    return _load_bits(x_block, index, inside), inside, end


@triton.jit
def _no_value(b, T: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, MIN_ULP_EXP: tl.constexpr,
              SUBNORMAL_BELOW: tl.constexpr, MAX: tl.constexpr, MAX_NEG: tl.constexpr,
              BEYOND_POS: tl.constexpr, BEYOND_NEG: tl.constexpr, SMALLEST_NORMAL: tl.constexpr,
              P_IS_1: tl.constexpr, HAS_NZ: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_NANS: tl.constexpr,
              EXTENDED: tl.constexpr, MAGIC: tl.constexpr, MAGIC_SCALE: tl.constexpr):  # fmt: skip
    """Where float32 bits ``b`` hold no value of the format: their RNE without saturation
    (native.cpp's encode check; the float adder's where MAGIC) changes them, or a NaN
    where the format has none. A zero is a value whatever its sign."""
    a = b & 0x7FFFFFFF
    if MAGIC:
        # magic.py's formats (signed, symmetric, with subnormals): the magnitude is a value
        # iff the float adder's RNE leaves it as it is and it lies within max, Inf where
        # the format has it; on magnitudes, so that -0 needs no case of its own.
        c = tl.maximum(a & 0x7F800000, (EMIN + 127) << 23)  # (unclamped above: _magic_bits)
        big = c.to(tl.float32, bitcast=True) * MAGIC_SCALE
        y = ((a.to(tl.float32, bitcast=True) + big) - big).to(tl.int32, bitcast=True)
        off = (y != a) | (a > MAX)
        if EXTENDED:
            off = off & (a != 0x7F800000)
    else:
        y = round_bits(b, b, b, 0, T, EMIN, BIAS, MIN_ULP_EXP, SUBNORMAL_BELOW, MAX, MAX_NEG, BEYOND_POS,
                       BEYOND_NEG, SMALLEST_NORMAL, P_IS_1, HAS_NZ, HAS_ZERO, False, 0, 0, 0)  # fmt: skip
        off = (y != b) & ((a != 0) | ((y & 0x7FFFFFFF) != 0))  # +0 for -0 is no change
    if HAS_NANS:
        return off & (a <= 0x7F800000)
    return off | (a > 0x7F800000)


@triton.jit(do_not_specialize=["n"],
            do_not_specialize_on_alignment=["codes_ptr", "table_ptr", "out_ptr", "bad_ptr"])
def decode_kernel(codes_ptr, table_ptr, out_ptr, bad_ptr, n: tl.int64, BLOCK: tl.constexpr,
                  K: tl.constexpr, PACKED: tl.constexpr, CHECK: tl.constexpr, ALIGNED: tl.constexpr):
    """fewbit.decode: values table[code] of n codes into out, BLOCK a program, the table's
    entries moved as bits (ints of the values' width: nothing is computed on them, so a
    NaN keeps its payload). Codes are uint8, int16 bit patterns, or PACKED pairs in uint8
    (the even element in the low nibble). A code at or above 2^K reads entry
    code & (2^K - 1), in bounds; with CHECK, bad_ptr (an int64 holding n) takes the least
    position of such a code (an atomic min from each program that finds one), as
    native.cpp's lookup reports it. ``ALIGNED``: the codes', table's and out's addresses
    and n are multiples of 16."""
    lanes = tl.arange(0, BLOCK)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    end = tl.minimum(n - first, BLOCK).to(tl.int32)
    out_block = out_ptr + first
    codes_block = codes_ptr + (first // 2 if PACKED else first)
    if ALIGNED:
        end = tl.multiple_of(end, 16)
        out_block, codes_block = tl.multiple_of(out_block, 16), tl.multiple_of(codes_block, 16)
    inside = lanes < end
    if PACKED:
        byte = tl.load(codes_block + lanes // 2, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((lanes & 1) * 4)) & 15
    else:
        code = tl.load(codes_block + lanes, mask=inside, other=0).to(tl.int32) & 0xFFFF  # int16's pattern
    if CHECK:
        beyond = inside & (code >= (1 << K))
        if tl.max(beyond.to(tl.int32)) > 0:
            tl.atomic_min(bad_ptr, first + tl.min(tl.where(beyond, lanes, BLOCK)))
    value = tl.load(table_ptr + (code & ((1 << K) - 1)), mask=inside)
    tl.store(out_block + lanes, value, mask=inside)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr", "amax_ptr"])
def finite_amax_kernel(x_ptr, amax_ptr, n: tl.int64, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                       ALIGNED: tl.constexpr):  # fmt: skip
    """The largest finite magnitude of x[0 .. n) (float32 or 16-bit) as float32 bits, into
    the int32 at amax_ptr, which holds 0: each program's largest over BLOCKS blocks of BLOCK
    elements, then an atomic max (magnitudes order as their bits). NVFP4's per-tensor scale
    (block.kernel.tensor_scale_of) in one read of x, as native.cpp's fewbit_finite_amax.
    ``ALIGNED``: x's address and n are multiples of 16."""
    lanes = tl.arange(0, BLOCK)
    first = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS)
    largest = tl.zeros((BLOCK,), tl.int32)
    for block in range(BLOCKS):
        b, _, _ = _block_bits(x_ptr, n, first + block * BLOCK, lanes, BLOCK, 1, ALIGNED)
        a = b & 0x7FFFFFFF  # 0 beyond n
        largest = tl.maximum(largest, tl.where(a < 0x7F800000, a, 0))  # Inf and NaN count as 0
    tl.atomic_max(amax_ptr, tl.max(largest))
