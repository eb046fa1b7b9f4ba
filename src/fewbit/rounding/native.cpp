// fewbit's CPU kernel: rounding (and rounding to codes) with the random bits generated
// in the same pass. Built at first use by native.py with the system C++ compiler and
// loaded with ctypes; no torch headers (it builds in about 15 s on one core).
//
// It computes what fast.round_fast computes, on float32 bit patterns (inputs of 16
// bits are widened exactly and the result narrowed by round-to-nearest-even, as torch
// converts; bfloat16 in the float-adder modes runs on its own 16 bits, magic_bf16 and
// bf16_blocks, wherever those give the float32 way's bits), and
// draws the bits of fewbit.random's stream layout: element i = row * LANES
// + lane takes field (row % per_word) of word `lane` of word row (row / per_word), and
// word row p holds output p % 2 of Threefry-2x32-20 blocks (p / 2) * LANES + lane.
// tests/test_native.py holds it to the torch kernels bit for bit.
//
// Work goes a row of LANES elements at a time through buffers that stay in L1: widen,
// draw the row's fields, round, narrow (or encode). Each stage is a plain loop over
// lanes without branches, which the compiler vectorises; each thread computes a row of
// Threefry blocks once for the 2 * per_word element rows that read it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __SSE2__
#include <xmmintrin.h>
#endif
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <vector>

namespace {

// A function of one lane, called in the loops over a row's lanes: always inlined, since a
// call keeps such a loop scalar. GCC inlines by a budget per caller, and the row loop outgrew
// it once: float32 SRC ran ten times slower, calling magic_one per element.
#define FEWBIT_LANE __attribute__((always_inline)) inline

constexpr int LANES = 512;
constexpr uint32_t PARITY = 0x1BD11BDA;  // Skein's key schedule parity
constexpr uint32_t NAN_BITS = 0x7FC00000;

// Argument layout of the int32 parameter array (native.py writes it in this order).
enum Param {
  T, EMIN, BIAS, MIN_ULP_EXP, MAX, MAX_NEG, BEYOND_POS, BEYOND_NEG, SMALLEST_NORMAL, FLAGS,
  LIMIT_RULE, BITS, SELECT_BELOW, K, CODE_OF_MAX, CODE_OF_NAN, EMAX, N_PARAMS
};
enum Flag { P_IS_1 = 1, HAS_NZ = 2, HAS_ZERO = 4, SAT = 8, HAS_NANS = 16, EXTENDED = 32, SIGNED = 64,
            TWOS_COMPLEMENT = 128 };
// Where a directed mode stops at the largest finite value when not saturating.
enum LimitRule { NOWHERE, EVERYWHERE, NEGATIVE, POSITIVE };
// Modes, in native.py's MODE_IDS order.
enum Mode { RNE, RNA, RTZ, RUP, RDN, RTO, SRFF, SRF, SRC, SRC_ODD, NEAR_ZERO, FRACTION };
enum Dtype { F32, BF16, F16 };

// The parameters, with the flags as 0 or 1: the per-element code combines them with & and |
// rather than branching on them, and holds truth values in int32 rather than bool (GCC 12
// does not vectorise the mix of bool and int32 lanes), so that it stays one vector loop.
struct Fmt {
  int32_t p[N_PARAMS];
  int32_t p_is_1, has_nz, has_zero, sat, has_nans, stop_always, stop_negative, stop_positive;
  uint32_t extended, is_signed, twos_complement;
  // 2^(-126 - emin) as one factor, or as 2^-126 then 2^-emin where it is below float32's
  // smallest (emin > 23: a hand-made format of large values): each product is exact.
  float code_scale, code_scale_2;

  float tiny_scale;  // 2^min_ulp_exponent: a subnormal result is r times it
  float max;  // the largest finite value
  float magic_scale[2];  // magic.py's 2^c / 2^e_t: for RNE (1.5 2^(23 - t)) and SRC (2^(23 - t - N))
  uint32_t rceil_fraction, even_fraction;  // block scale rules (block_exponent)
  // The code beyond the largest value in the magic modes: max's (sat), Inf's, or NaN's
  // (whose code holds the sign bit).
  uint32_t beyond_code;

  explicit Fmt(const int32_t* params) : tiny_scale(std::ldexp(1.0f, params[MIN_ULP_EXP])) {
    std::memcpy(p, params, sizeof p);
    max = __builtin_bit_cast(float, p[MAX]);
    magic_scale[0] = std::ldexp(1.5f, 23 - p[T]);
    magic_scale[1] = std::ldexp(1.0f, 23 - p[T] - p[BITS]);
    rceil_fraction = uint32_t(p[MAX]) & 0x7FFFFFu;
    const int32_t top_t = p[T] - flag(TWOS_COMPLEMENT);  // intM's top binade: P less its sign bit
    even_fraction = top_t < 23 ? 0x800000u - (1u << (22 - top_t)) : 0x800000u;  // never reached at t = 23
    p_is_1 = flag(P_IS_1), has_nz = flag(HAS_NZ), has_zero = flag(HAS_ZERO), sat = flag(SAT);
    has_nans = flag(HAS_NANS);
    extended = flag(EXTENDED), is_signed = flag(SIGNED), twos_complement = flag(TWOS_COMPLEMENT);
    const bool split = -126 - p[EMIN] < -149;
    code_scale = std::ldexp(1.0f, split ? -126 : -126 - p[EMIN]);
    code_scale_2 = std::ldexp(1.0f, split ? -p[EMIN] : 0);
    stop_always = p[LIMIT_RULE] == EVERYWHERE, stop_negative = p[LIMIT_RULE] == NEGATIVE;
    stop_positive = p[LIMIT_RULE] == POSITIVE;
    beyond_code = uint32_t(sat ? p[CODE_OF_MAX] : extended ? p[CODE_OF_MAX] + 1 : p[CODE_OF_NAN]);
  }
  int32_t operator[](Param i) const { return p[i]; }
  bool flag(Flag f) const { return p[FLAGS] & f; }
};

FEWBIT_LANE float as_float(uint32_t u) { return __builtin_bit_cast(float, u); }

// Eight 32-bit lanes (GCC's vector extensions, which Clang shares): Threefry is written on
// these, so that a rotation by whole bytes can be one byte shuffle.
typedef uint32_t u32x8 __attribute__((vector_size(32)));

template <int R>
inline u32x8 rotl(u32x8 x) {
#ifdef __AVX2__
  if constexpr (R == 16 || R == 24) {
    // Byte j of each lane takes byte (j - R / 8) mod 4: one vpshufb, where the two shifts
    // and an or of any other rotation wait on the vector shift units, Threefry's bottleneck
    // without AVX-512's rotate (GCC does not make this substitution itself). The indices
    // count within each 128-bit half, as vpshufb does.
    const __m256i base = _mm256_set1_epi32(R == 16 ? 0x01000302 : 0x00030201);
    const __m256i lane = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C,
                                           0, 0x04040404, 0x08080808, 0x0C0C0C0C);
    return (u32x8)_mm256_shuffle_epi8((__m256i)x, _mm256_add_epi8(base, lane));
  }
#endif
  return (x << R) | (x >> (32 - R));
}

// Threefry-2x32-20 of blocks b0 .. b0 + LANES - 1: outputs 0 into w0, 1 into w1. Lanes go
// GROUP at a time through all rounds: a round is a chain of dependent operations, and
// several vectors of lanes in flight keep the core busy while each waits on the last.
// Eight vectors (x0 and x1: 16 registers): on Zen 4 with AVX-512, float32 `sr` 8% and
// bfloat16 SRC 4% faster in L2 than with four; sixteen gained nothing more, and AVX2's 16
// registers time the same with eight as with four (native_ab.py, one thread).
constexpr int GROUP = 64, VECTORS = GROUP / 8;
#define FEWBIT_ROUND(r) for (int v = 0; v < VECTORS; ++v) { x0[v] += x1[v]; x1[v] = rotl<r>(x1[v]) ^ x0[v]; }
#define FEWBIT_INJECT(i) for (int v = 0; v < VECTORS; ++v) { x0[v] += ks[(i) % 3]; x1[v] += ks[((i) + 1) % 3] + (i); }
void threefry_row(uint64_t b0, uint32_t k0, uint32_t k1, uint32_t* __restrict w0,
                  uint32_t* __restrict w1) {
  const uint32_t ks[3] = {k0, k1, PARITY ^ k0 ^ k1};
  // Counter (b mod 2^32, b / 2^32); b0 is a multiple of LANES, so the row shares b / 2^32.
  const uint32_t lo = uint32_t(b0), hi = uint32_t(b0 >> 32);
  const u32x8 iota = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int h = 0; h < LANES; h += GROUP) {
    u32x8 x0[VECTORS], x1[VECTORS];
    for (int v = 0; v < VECTORS; ++v) {
      x0[v] = iota + (lo + uint32_t(h + 8 * v) + ks[0]);
      x1[v] = u32x8{} + (hi + ks[1]);
    }
    FEWBIT_ROUND(13) FEWBIT_ROUND(15) FEWBIT_ROUND(26) FEWBIT_ROUND(6) FEWBIT_INJECT(1)
    FEWBIT_ROUND(17) FEWBIT_ROUND(29) FEWBIT_ROUND(16) FEWBIT_ROUND(24) FEWBIT_INJECT(2)
    FEWBIT_ROUND(13) FEWBIT_ROUND(15) FEWBIT_ROUND(26) FEWBIT_ROUND(6) FEWBIT_INJECT(3)
    FEWBIT_ROUND(17) FEWBIT_ROUND(29) FEWBIT_ROUND(16) FEWBIT_ROUND(24) FEWBIT_INJECT(4)
    FEWBIT_ROUND(13) FEWBIT_ROUND(15) FEWBIT_ROUND(26) FEWBIT_ROUND(6) FEWBIT_INJECT(5)
    for (int v = 0; v < VECTORS; ++v) {
      std::memcpy(w0 + h + 8 * v, &x0[v], 32);
      std::memcpy(w1 + h + 8 * v, &x1[v], 32);
    }
  }
}

// A row of random fields as the rounding loop reads them: lane h's is (w[h] >> shift) & mask
// (w indexed by lane, like x).
struct Fields {
  const uint32_t* w;
  uint32_t shift, mask;
  uint32_t at(int h) const { return (w[h] >> shift) & mask; }
};

// One random stream: the element rows of a thread read its words through this cache
// of the last row of blocks computed.
struct Stream {
  uint32_t k0, k1;
  int bits, per_word;
  int64_t block_row = -1;
  alignas(64) uint32_t words[2][LANES];

  Stream(uint32_t k0, uint32_t k1, int bits) : k0(k0), k1(k1), bits(bits), per_word(32 / bits) {}

  // Where element row `row` finds its fields: field f of lane h is (w[h] >> shift) & mask.
  Fields fields(int64_t row) {
    const int64_t word_row = row / per_word;
    if (word_row / 2 != block_row) {
      block_row = word_row / 2;
      threefry_row(uint64_t(block_row) * LANES, k0, k1, words[0], words[1]);
    }
    return {words[word_row % 2], uint32_t(row % per_word) * bits, bits == 32 ? ~0u : (1u << bits) - 1};
  }
};

// As max then min, which vectorise to one instruction each (a select chain took three).
FEWBIT_LANE int32_t clampi(int32_t v, int32_t lo, int32_t hi) { return std::min(std::max(v, lo), hi); }

// fast._fraction_to_bits then fast._few_bit_away (N <= 30, so int32 holds every sum).
template <Mode M>
FEWBIT_LANE int32_t few_bit_away(int32_t rem, int32_t D, int32_t n, int bits) {
  const int32_t shift = D - bits;
  const int32_t right = clampi(shift, 0, 25), left = clampi(-shift, 0, bits);
  const int32_t q = rem >> right;
  int32_t d_n;
  if (M == SRFF) {
    d_n = shift > 0 ? q : rem << left;
  } else {
    const int32_t low2 = (rem & ((1 << right) - 1)) << 1, half2 = 1 << right;
    int32_t up;
    if (M == SRF) {
      up = low2 >= half2;
    } else {
      const int32_t q_odd = q & 1;
      const int32_t tie_up = M == SRC_ODD ? (q_odd ^ 1) : q_odd;
      up = (low2 > half2) | ((low2 == half2) & tie_up);
    }
    d_n = shift > 0 ? q + int32_t(up) : rem << left;
  }
  return n > ((1 << bits) - 1) - d_n;
}

// fast.round_fast for one float32 bit pattern. n: the N random bits, s: the selection bits.
template <Mode M>
FEWBIT_LANE uint32_t round_one(uint32_t bits_in, uint32_t n, uint32_t s, const Fmt& f) {
  const int32_t b = int32_t(bits_in);
  const int32_t negative = (b >> 31) & 1;
  const int32_t a = b & 0x7FFFFFFF;
  const int32_t is_inf = a == 0x7F800000, is_nan = a > 0x7F800000;
  const int32_t e_field = a >> 23, mantissa = a & 0x7FFFFF;
  const int32_t sig = e_field > 0 ? (mantissa | 0x800000) : mantissa;
  const int32_t e_x = std::max(e_field, 1) - 127;
  const int32_t t = f[T];
  const int32_t e_t = std::max(e_x, f[EMIN]);
  const int32_t D = (23 - t) + (e_t - e_x);
  const int32_t Dc = std::min(D, 25);
  int32_t r = sig >> Dc;
  const int32_t one = 1 << Dc;
  const int32_t rem = sig & (one - 1);

  const int32_t rem2 = rem << 1;
  const int32_t odd = (f.p_is_1 & (r != 0) & (((e_t + f[BIAS]) & 1) == 1)) | ((f.p_is_1 ^ 1) & ((r & 1) == 1));
  const int32_t nearest_even = (rem2 > one) | ((rem2 == one) & odd);
  int32_t away;
  switch (M) {
    case RNE: away = nearest_even; break;
    case RNA: away = rem2 >= one; break;
    case RTZ: away = 0; break;
    case RUP: away = (rem != 0) & (negative ^ 1); break;
    case RDN: away = (rem != 0) & negative; break;
    case RTO: away = (rem != 0) & (odd ^ 1); break;
    case NEAR_ZERO: {
      const int32_t sr = few_bit_away<SRC>(rem, D, int32_t(n), f[BITS]);
      away = (r == 0) & (nearest_even ^ 1) ? sr : nearest_even;
      break;
    }
    case FRACTION: {
      const int32_t sr = few_bit_away<SRC>(rem, D, int32_t(n), f[BITS]);
      away = int32_t(s) < f[SELECT_BELOW] ? sr : nearest_even;
      break;
    }
    default: away = few_bit_away<M>(rem, D, int32_t(n), f[BITS]);
  }
  r += int32_t(away);

  const int32_t normal = ((e_t + 126) << 23) + (r << (23 - t));
  const int32_t tiny = __builtin_bit_cast(int32_t, float(r) * f.tiny_scale);
  int32_t mag = r >= (1 << t) ? normal : tiny;

  const int32_t limit = negative ? f[MAX_NEG] : f[MAX];
  const int32_t over = (mag > limit) | is_inf;
  const int32_t directed = f.stop_always | (f.stop_negative & negative) | (f.stop_positive & (negative ^ 1));
  const int32_t to_limit = over & (f.sat | ((is_inf ^ 1) & directed));
  mag = over ? (negative ? f[BEYOND_NEG] : f[BEYOND_POS]) : mag;
  mag = to_limit ? limit : mag;
  const int32_t keep_sign = negative & (f.has_nz | (mag != 0));
  mag = (f.has_zero ^ 1) & (mag == 0) ? f[SMALLEST_NORMAL] : mag;
  const uint32_t out = keep_sign ? uint32_t(mag) | 0x80000000u : uint32_t(mag);
  return is_nan ? NAN_BITS : out;
}

// magic.round_magic for one float32 bit pattern (RNE, or SRC with N = BITS): the float
// adder rounds x to a multiple of ulp / 2^N; for SRC the N random bits are added to that
// multiple's low bits, and a carry out of them rounds away. Only where magic_applies.
// 2^e_t as float32 bits for float32 bits x: x's binade, clamped to the format's emin ..
// emax (magic.py's C is this times magic_scale).
FEWBIT_LANE uint32_t binade_of(uint32_t x, const Fmt& f) {
  return uint32_t(clampi(int32_t(x & 0x7F800000u), (f[EMIN] + 127) << 23, (f[EMAX] + 127) << 23));
}

template <bool SR>
FEWBIT_LANE uint32_t magic_one(uint32_t x, uint32_t n, const Fmt& f) {
  constexpr uint32_t SIGN = 0x80000000u;
  uint32_t c = binade_of(x, f);
  if (SR) c |= x & SIGN;
  const float big = as_float(c) * f.magic_scale[SR];  // exact: a power of two times 1 or 1.5
  float y = as_float(x) + big;
  if (SR) y = as_float((__builtin_bit_cast(uint32_t, y) + n) & (0u - (1u << f[BITS])));
  uint32_t out = __builtin_bit_cast(uint32_t, y - big);
  out |= x & SIGN & (0u - uint32_t(f.has_nz));  // -0 where the subtraction gave +0
  const uint32_t beyond = uint32_t(f.sat ? f[MAX] : f[BEYOND_POS]) | (x & SIGN);
  out = as_float(out & ~SIGN) > f.max ? beyond : out;
  return int32_t(x & ~SIGN) > 0x7F800000 ? NAN_BITS : out;  // signed: AVX2 compares no unsigned lanes
}

// A result's float32 bits to bfloat16's. A bfloat16 input holds every value of the format
// (checks.make_spec), so the result is one too and its low 16 bits are zero; NaN becomes
// 0xFFFF as in torch's vector conversion (its scalar one, for a tensor's tail, gives 0x7FC0).
FEWBIT_LANE uint16_t to_bfloat16(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFF : uint16_t(u >> 16); }

// magic_one for a bfloat16 x, on its 16 bits (where Bf16Magic::applies): in the target's
// normal range a bfloat16 carries 7 fraction bits, d = 7 - t more than the target, so the
// float adder's rounding there is integer arithmetic on x's magnitude bits (a carry runs into
// the exponent as the sum's would): round to nearest even to a multiple of 2^pre, pre = d
// (RNE) or d - N (SRC), then for SRC add n 2^pre and clear the low d bits. Below 2^emin the
// float adder runs with the constant of emin's binade, as in magic_one; above emax both ways
// give a value beyond max. On magnitudes, the sign put back after: x's, on a zero only where
// the format has -0, as magic_one's sum gives. Half the bits of magic_one's lanes, so twice
// the elements per instruction: bfloat16 has twice the elements per byte of float32.
// F16: the constants for a float16 x (10 fraction bits, bias 15) in the target's normal
// range, where the same arithmetic rounds it (float16_groups); the float adder's are bfloat16's.
struct Bf16Magic {
  // int16_t: magnitudes are below 2^15, and AVX2 compares 16-bit lanes only as signed.
  int16_t pre_half, pre_lsb, pre_unit, pre_keep, keep, emin, max, beyond, nz;
  float big;  // magic.py's C for 2^emin's binade
  uint32_t sr_keep;  // clears the N low bits of the float32 sum, as magic_one

  Bf16Magic(const Fmt& f, bool sr, bool f16 = false) {
    const int fraction = f16 ? 10 : 7, bias = f16 ? 15 : 127;
    // Clamped: every call builds one, and only those where applies() use it.
    const int d = std::clamp(fraction - f[T], 0, fraction), p = std::clamp(sr ? d - f[BITS] : d, 0, fraction);
    // The first rounding's 2^(pre-1) - 1 and its kept lsb 2^pre (none at pre = 0); n's unit 2^pre.
    pre_half = int16_t(p > 0 ? (1 << (p - 1)) - 1 : 0), pre_lsb = int16_t(p > 0 ? 1 << p : 0);
    pre_unit = int16_t(1 << p);
    pre_keep = int16_t(~((1 << p) - 1)), keep = int16_t(sr ? ~((1 << d) - 1) : -1);
    emin = int16_t((f[EMIN] + bias) << fraction), max = bits16(uint32_t(f[MAX]), f16);
    beyond = bits16(uint32_t(f.sat ? f[MAX] : f[BEYOND_POS]), f16);  // max (sat), Inf or NaN
    nz = int16_t(f.has_nz ? -1 : 0);
    big = as_float(uint32_t(f[EMIN] + 127) << 23) * f.magic_scale[sr];
    sr_keep = 0u - (1u << f[BITS]);
  }
  // The calls it takes: for SRC, N <= d (n's bits then lie within x's fraction). From
  // float16: where 2^emin is a normal float16, and no finite x at or above it can lack a
  // result (sat, or NaN for a value beyond max is one of the format's).
  static bool applies(const Fmt& f, bool sr, bool f16 = false) {
    return (!sr || f[BITS] <= (f16 ? 10 : 7) - f[T]) && (!f16 || (f[EMIN] >= -14 && (f.sat || f.has_nans)));
  }

  // A float32 value of the format (its bits u; max, Inf, NaN) as a 16-bit float's bits:
  // bfloat16's as to_bfloat16 gives them, float16's as narrow_f16 converts.
  static int16_t bits16(uint32_t u, bool f16) {
    return int16_t(f16 ? __builtin_bit_cast(uint16_t, _Float16(as_float(u))) : to_bfloat16(u));
  }
};

template <bool SR>
FEWBIT_LANE uint16_t magic_bf16(uint16_t v, uint32_t n, const Bf16Magic& g) {
  const int16_t a = int16_t(v & 0x7FFF);
  // The kept lsb, 0 or 1 (a min, not a shift: C++ would shift in 32 bits). The sum wraps
  // below zero only for a NaN, whose result the last line sets.
  const int16_t lsb = std::min<int16_t>(a & g.pre_lsb, 1);
  int16_t r = int16_t((a + g.pre_half + lsb) & g.pre_keep);
  if (SR) r = int16_t((r + int16_t(n) * g.pre_unit) & g.keep);  // a 16-bit multiply: no 32-bit shift
  float y = as_float(uint32_t(a) << 16) + g.big;
  if (SR) y = as_float((__builtin_bit_cast(uint32_t, y) + n) & g.sr_keep);
  const int16_t tiny = int16_t(__builtin_bit_cast(int32_t, y - g.big) >> 16);  // a positive float
  int16_t mag = a < g.emin ? tiny : r;
  mag = mag > g.max ? g.beyond : mag;
  const int16_t sign = int16_t(v & 0x8000) & (mag != 0 ? int16_t(-1) : g.nz);
  return a > 0x7F80 ? 0xFFFF : uint16_t(mag | sign);  // NaN as to_bfloat16's
}

#ifdef __AVX2__
// magic_bf16 on 16 lanes at a time, by hand: for the float adder's lanes, x's 16-bit halves
// unpacked under zeros are its float32 bits, and packing the results back undoes the
// unpacking's order within each 128-bit half, where GCC's code for the same loop widens,
// shifts, masks and permutes.
struct Bf16x16 {
  __m256i magnitude = _mm256_set1_epi16(0x7FFF), sign_bit = _mm256_set1_epi16(int16_t(0x8000));
  __m256i one = _mm256_set1_epi16(1), inf = _mm256_set1_epi16(0x7F80), zero = _mm256_setzero_si256();  // inf: above, NaN
  __m256i pre_lsb, pre_half, pre_keep, keep, pre_unit, emin, max, beyond, no_nz, sr_keep;
  __m256 big;
  int pre_bits;  // pre
  __m128i pre;  // pre, as a shift count
  bool whole;  // pre = 0 (SR with N = d, as classical SR): nothing to round before adding n

  explicit Bf16x16(const Bf16Magic& g)
      : pre_lsb(_mm256_set1_epi16(g.pre_lsb)), pre_half(_mm256_set1_epi16(g.pre_half)),
        pre_keep(_mm256_set1_epi16(g.pre_keep)), keep(_mm256_set1_epi16(g.keep)),
        pre_unit(_mm256_set1_epi16(g.pre_unit)), emin(_mm256_set1_epi16(g.emin)), max(_mm256_set1_epi16(g.max)),
        beyond(_mm256_set1_epi16(g.beyond)), no_nz(_mm256_set1_epi16(int16_t(~g.nz))),
        sr_keep(_mm256_set1_epi32(int32_t(g.sr_keep))), big(_mm256_set1_ps(g.big)),
        pre_bits(__builtin_ctz(uint32_t(g.pre_unit))), pre(_mm_cvtsi32_si128(pre_bits)), whole(g.pre_unit == 1) {}

  // Magnitudes a in the target's normal range rounded on their 16 bits, as magic_bf16: to
  // nearest even at 2^pre, then for SR plus n16 = n 2^pre (Fields16), the low d bits
  // cleared. For SR the bits below 2^pre that the first rounding would clear need no and:
  // less than 2^pre, they carry nowhere when n 2^pre is added, and keep clears them.
  template <bool SR>
  __m256i nearest(__m256i a, __m256i n16) const {
    if (SR && whole) return _mm256_and_si256(_mm256_add_epi16(a, n16), keep);  // no finer bits to round first
    const __m256i lsb = _mm256_min_epi16(_mm256_and_si256(a, pre_lsb), one);
    const __m256i r = _mm256_add_epi16(_mm256_add_epi16(a, pre_half), lsb);
    return SR ? _mm256_and_si256(_mm256_add_epi16(r, n16), keep) : _mm256_and_si256(r, pre_keep);
  }

  // The float adder's sums |x| + C of magnitudes a (as float32s: a's 16 bits unpacked under
  // zeros), in the unpacking's lane order (lanes 0-3 and 8-11, 4-7 and 12-15).
  void sums(__m256i a, __m256& ylo, __m256& yhi) const {
    ylo = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)), big);
    yhi = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)), big);
  }

  // Where lanes v lie below 2^emin (all ones), as magnitudes (a NaN does not).
  __m256i below(__m256i v) const { return _mm256_cmpgt_epi16(emin, _mm256_and_si256(v, magnitude)); }

  // The results of bfloat16 lanes v. SR: n16 holds n 2^pre in lane order. TINY: whether
  // any lane may lie below 2^emin; only then does it run the float adder's lanes, and set
  // ylo, yhi to their sums.
  template <bool SR, bool TINY>
  __m256i round(__m256i v, __m256i n16, __m256& ylo, __m256& yhi) const {
    const __m256i a = _mm256_and_si256(v, magnitude);
    const __m256i r = nearest<SR>(a, n16);
    __m256i mag = r;
    if (TINY) {
      sums(a, ylo, yhi);
      if (SR) {  // n in the unpacking's lane order (lanes 0-3 and 8-11, 4-7 and 12-15)
        const __m256i nlo = _mm256_srl_epi32(_mm256_unpacklo_epi16(n16, zero), pre);
        const __m256i nhi = _mm256_srl_epi32(_mm256_unpackhi_epi16(n16, zero), pre);
        ylo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(ylo), nlo), sr_keep));
        yhi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(yhi), nhi), sr_keep));
      }
      const __m256i tlo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_sub_ps(ylo, big)), 16);
      const __m256i thi = _mm256_srli_epi32(_mm256_castps_si256(_mm256_sub_ps(yhi, big)), 16);
      mag = _mm256_blendv_epi8(r, _mm256_packus_epi32(tlo, thi), _mm256_cmpgt_epi16(emin, a));
    }
    mag = _mm256_blendv_epi8(mag, beyond, _mm256_cmpgt_epi16(mag, max));
    // x's sign, off a zero where the format has no -0 (only a lane below 2^emin rounds to zero)
    __m256i sign = _mm256_and_si256(v, sign_bit);
    if (TINY) sign = _mm256_andnot_si256(_mm256_and_si256(_mm256_cmpeq_epi16(mag, zero), no_nz), sign);
    const __m256i out = _mm256_or_si256(mag, sign);
    return _mm256_or_si256(out, _mm256_cmpgt_epi16(a, inf));  // a NaN: 0xFFFF
  }
};

// A Fields row's n 2^pre (Bf16x16's pre), 16 lanes at a time in lane order. With AVX-512,
// a rotation right by shift - pre puts the field at bit pre (a rotation, not a shift: the
// field may lie below bit pre; what wraps around lands below pre, where the mask clears it),
// and vpmovdw narrows 16 words in one instruction: bfloat16 SRC 6% faster in L2.
struct Fields16 {
  const uint32_t* w;
#ifdef __AVX512F__
  __m512i turn;
  __m256i field;  // the mask at bit pre

  Fields16(Fields n, const Bf16x16& c)
      : w(n.w), turn(_mm512_set1_epi32(int32_t((n.shift - c.pre_bits) & 31))),
        field(_mm256_set1_epi16(int16_t(n.mask << c.pre_bits))) {}

  __m256i at(int h) const {
    const __m512i words = _mm512_rorv_epi32(_mm512_loadu_si512(w + h), turn);
    return _mm256_and_si256(_mm512_cvtepi32_epi16(words), field);
  }
#else
  __m256i field, unit;  // the mask, 2^pre
  __m128i shift;

  Fields16(Fields n, const Bf16x16& c)
      : w(n.w), field(_mm256_set1_epi32(int32_t(n.mask))), unit(c.pre_unit), shift(_mm_cvtsi32_si128(int(n.shift))) {}

  __m256i at(int h) const {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + h));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + h + 8));
    // packus interleaves 128-bit halves: from lanes 0-3 and 8-11, then 4-7 and 12-15, it
    // packs them in order
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(_mm256_permute2x128_si256(w0, w1, 0x20), shift), field);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(_mm256_permute2x128_si256(w0, w1, 0x31), shift), field);
    return _mm256_mullo_epi16(_mm256_packus_epi32(lo, hi), unit);
  }
#endif
};
#endif

#ifdef __AVX2__
// Values below 2^emin are rare in data scaled to the format, and without them a Bf16x16
// lane costs a quarter to a third less. So a row goes in groups of TINY_TEST lanes, each
// tested first: a group without such a value leaves out the float adder's lanes. A test of
// 16 lanes instead would be a coin toss in data where such values are common (unscaled
// weights of 0.01), its branch mispredicted half the time: 2.5x slower than no test.
constexpr int TINY_TEST = 64, PER_TEST = TINY_TEST / 16;  // lanes, vectors

// Calls fast(h, v) for the groups of TINY_TEST 16-bit lanes v (16 to a vector) at x16 + h,
// from h on, that hold no lane slow(v) marks (all ones), and slow_group(h, v) for the
// others, up to the first for which slow_group returns false or the first that reaches
// past h1; returns its h.
template <typename Slow, typename Fast, typename SlowGroup>
inline int by_groups(const uint16_t* x16, int h, int h1, Slow&& slow, Fast&& fast, SlowGroup&& slow_group) {
  for (; h + TINY_TEST <= h1; h += TINY_TEST) {
    __m256i v[PER_TEST], any = _mm256_setzero_si256();
    for (int j = 0; j < PER_TEST; ++j) {
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + h + 16 * j));
      any = _mm256_or_si256(any, slow(v[j]));
    }
    if (_mm256_testz_si256(any, any)) {
      fast(h, v);
    } else if (!slow_group(h, v)) {
      break;
    }
  }
  return h;
}
#endif

// magic_bf16 over lanes h0 .. h1 of a row (with AVX2, Bf16x16's 16 at a time). Not inlined:
// where GCC inlined it, the float16 loops compiled around it lost 7-10%
// (native_ab in L2).
template <bool SR>
__attribute__((noinline)) void magic_bf16_row(const uint16_t* x16, Fields n, uint16_t* o, int h0, int h1,
                                              const Bf16Magic& g) {
  int h = h0;
#ifdef __AVX2__
  const Bf16x16 c(g);
  const Fields16 n16s(n, c);
  const auto chunk = [&](int k, __m256i v, auto tiny) {
    __m256 ylo, yhi;
    const __m256i r = c.round<SR, decltype(tiny)::value>(v, SR ? n16s.at(k) : c.zero, ylo, yhi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), r);
  };
  // A group with a lane below 2^emin runs the float adder's lanes, and the next group is
  // tested again. (Where one such lane handed the rest of the row to the float adder's
  // loop, SRC and sr ran 7-8% slower on randn * 8 into binary8p4, 17-19% on randn * 1;
  // on randn * 0.01, where nearly every group holds one, they ran 1-4% faster that way.
  // Handing it over at the second such group in a row cost 12-15% on randn * 1.)
  const auto below = [&](__m256i v) { return c.below(v); };
  h = by_groups(
      x16, h, h1, below,
      [&](int k, const __m256i* v) {
        for (int j = 0; j < PER_TEST; ++j) chunk(k + 16 * j, v[j], std::false_type{});
      },
      [&](int k, const __m256i* v) {
        for (int j = 0; j < PER_TEST; ++j) chunk(k + 16 * j, v[j], std::true_type{});
        return true;
      });
  for (; h + 16 <= h1; h += 16)
    chunk(h, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + h)), std::true_type{});
#endif
  for (; h < h1; ++h) o[h] = magic_bf16<SR>(x16[h], n.at(h), g);
}

#ifdef __AVX2__
// encode (its check, magic_one's RNE, and code_of) for a whole row of bfloat16 into uint8
// codes, where encode's kernel is ENCODE_MAGIC: 16 lanes at a time on their 16 bits, as
// magic_bf16_row rounds. A value in the format's normal range has the code magnitude
// (a - 2^7 (emin + 126)) >> (7 - t) (the format's exponent field lands where bfloat16's
// was, 1 at emin); one below 2^emin, |x| / 2^(emin - t), which the float adder's sum |x| + C
// holds in its low bits (magic_codes's argument). Returns whether every lane held a value
// of the format; where one did not, the caller redoes the row the general way, which
// finds it. Without CHECK (values just rounded to the format) it checks nothing, and
// returns true.
template <bool CHECK>
inline bool encode_bf16_row(const uint16_t* x16, uint8_t* o, const Bf16x16& c, const Fmt& f) {
  const __m256i code_base = _mm256_set1_epi16(int16_t(((f[EMIN] + 126) << 7)));
  const __m128i ulp_shift = _mm_cvtsi32_si128(7 - f[T]);
  const __m256i big_bits = _mm256_castps_si256(c.big);
  const __m256i inf_code = _mm256_set1_epi16(int16_t(f[CODE_OF_MAX] + 1));
  const __m256i nan_code = _mm256_set1_epi16(int16_t(f[CODE_OF_NAN]));
  const __m256i sign_code = _mm256_set1_epi16(int16_t(1 << (f[K] - 1)));
  const __m256i k_bits = _mm256_set1_epi16(int16_t((1 << f[K]) - 1));
  const __m256i nz = _mm256_set1_epi16(int16_t(f.has_nz ? -1 : 0));
  const __m256i nan_bad = _mm256_set1_epi16(int16_t(f.has_nans ? 0 : -1));  // a NaN is no value
  __m256i bad = c.zero;
  const auto codes = [&](__m256i v, auto tiny) {
    __m256 ylo, yhi;
    const __m256i a = _mm256_and_si256(v, c.magnitude);
    __m256i rounded = c.zero;
    if constexpr (CHECK) {
      rounded = c.round<false, decltype(tiny)::value>(v, c.zero, ylo, yhi);
    } else if constexpr (decltype(tiny)::value) {
      c.sums(a, ylo, yhi);
    }
    __m256i code = _mm256_srl_epi16(_mm256_sub_epi16(a, code_base), ulp_shift);
    if (tiny) {
      const __m256i from_sum = _mm256_packus_epi32(_mm256_sub_epi32(_mm256_castps_si256(ylo), big_bits),
                                                     _mm256_sub_epi32(_mm256_castps_si256(yhi), big_bits));
      code = _mm256_blendv_epi8(code, from_sum, _mm256_cmpgt_epi16(c.emin, a));
    }
    const __m256i nan = _mm256_cmpgt_epi16(a, c.inf);
    code = _mm256_blendv_epi8(code, inf_code, _mm256_cmpeq_epi16(a, c.inf));  // extended formats' Inf
    code = _mm256_blendv_epi8(code, nan_code, nan);
    // code_of's sign: on a negative x that is no NaN, and on a zero only where the format has -0
    const __m256i dropped = _mm256_or_si256(nan, _mm256_andnot_si256(nz, _mm256_cmpeq_epi16(code, c.zero)));
    const __m256i keep = _mm256_andnot_si256(dropped, _mm256_cmpgt_epi16(c.zero, v));
    code = _mm256_or_si256(code, _mm256_and_si256(keep, sign_code));
    code = _mm256_and_si256(code, k_bits);  // K bits, as code_of keeps them
    if constexpr (CHECK) {
      // not_a_value: rounding changed x (as float32s: -0 and +0 alike), or a NaN without NaNs
      const __m256i same = _mm256_or_si256(
          _mm256_cmpeq_epi16(rounded, v),
          _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_or_si256(rounded, v), c.magnitude), c.zero));
      bad = _mm256_or_si256(bad, _mm256_blendv_epi8(_mm256_xor_si256(same, _mm256_cmpeq_epi16(c.zero, c.zero)),
                                                    nan_bad, nan));
    }
    return code;
  };
  // codes of 32 lanes from their two vectors (packus interleaves the 128-bit halves: lanes
  // 0-7, 16-23, 8-15, 24-31; the permute restores them)
  const auto store = [&](int h, __m256i lo, __m256i hi) {
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + h), bytes);
  };
  // Each group of TINY_TEST lanes runs the float adder's lanes only where one is below 2^emin
  // (as magic_bf16_row; handing the rest of the row over at the first such lane cost bfloat16
  // and float16 encode 0-3% on randn * 8 into binary8p4, 8-14% on randn * 1, and saved up to
  // 2% on randn * 0.01).
  const auto group = [&](auto tiny) {
    return [&, tiny](int k, const __m256i* v) {
      for (int j = 0; j < PER_TEST; j += 2) store(k + 16 * j, codes(v[j], tiny), codes(v[j + 1], tiny));
      return true;
    };
  };
  static_assert(LANES % TINY_TEST == 0, "by_groups covers the whole row");
  by_groups(x16, 0, LANES, [&](__m256i v) { return c.below(v); }, group(std::false_type{}),
            group(std::true_type{}));
  return _mm256_testz_si256(bad, bad);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// A whole row of float16 as bfloat16 bits, for encode_bf16_row: every value of an 8-bit
// format is a bfloat16, so where each lane converts exactly, the row's codes and its check
// are those of the bfloat16 row. Returns whether every lane did (a NaN, or a float16 with
// more significant bits than bfloat16 holds, did not: the caller takes the general way).
// Not inlined: inlined, it cost float32 encode 7% at 2^24 (native_ab, the same loop
// compiled around it otherwise).
__attribute__((noinline)) bool float16_as_bfloat16(const uint16_t* x16, uint16_t* b16) {
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  __m256i lost = _mm256_setzero_si256();
  for (int h = 0; h < LANES; h += 16) {
    const __m256i lo = _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x16 + h))));
    const __m256i hi =
        _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x16 + h + 8))));
    lost = _mm256_or_si256(lost, _mm256_and_si256(_mm256_or_si256(lo, hi), low));
    // packus interleaves the 128-bit halves: lanes 0-3, 8-11, 4-7, 12-15; the permute restores them
    const __m256i bits = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b16 + h), _mm256_permute4x64_epi64(bits, 0xD8));
  }
  return _mm256_testz_si256(lost, lost);
}
#endif

// SRC with N = 23 - t, classical SR from float32 (native.py's classical_sr_applies): in the
// target's normal range the N discarded bits are the whole fraction, so adding n to the
// magnitude's bits carries exactly when d + n 2^-N >= 1, into the exponent if need be.
// Below 2^emin the float adder first rounds |x| + 2^emin to a multiple of ulp / 2^N, ties
// to even (magic.py's argument with c = emin), and subtracting 2^emin again is exact.
FEWBIT_LANE uint32_t classical_sr_one(uint32_t x, uint32_t n, const Fmt& f) {
  constexpr uint32_t SIGN = 0x80000000u;
  const uint32_t a = x & ~SIGN;
  const uint32_t two_emin = uint32_t(f[EMIN] + 127) << 23;
  const int32_t normal = int32_t(a) >= int32_t(two_emin);  // Inf and NaN too (signed: as magic_one)
  const uint32_t y = normal ? a : __builtin_bit_cast(uint32_t, as_float(a) + as_float(two_emin));
  const uint32_t k = (y + n) & (0u - (1u << f[BITS]));
  uint32_t mag = normal ? k : __builtin_bit_cast(uint32_t, as_float(k) - as_float(two_emin));
  mag = as_float(mag) > f.max ? uint32_t(f.sat ? f[MAX] : f[BEYOND_POS]) : mag;
  const uint32_t keep_sign = (x >> 31) & (uint32_t(f.has_nz) | (mag != 0));
  return int32_t(a) > 0x7F800000 ? NAN_BITS : mag | (keep_sign << 31);
}

// codec.codes_of for one float32 bit pattern that is a value of the format. Scaled by
// 2^(-126 - emin), a value's float32 bits are its code's magnitude bits shifted left by
// 23 - t: the format's exponent field lands on float32's (field 1 at emin), and its
// subnormals on float32's subnormals (the scaling is exact: they are multiples of 2^-149).
template <bool EXTENDED, bool HAS_NANS, bool TWOS_COMPLEMENT>
FEWBIT_LANE uint32_t code_of(uint32_t bits_in, const Fmt& f) {
  const uint32_t a = bits_in & 0x7FFFFFFFu;
  const uint32_t is_inf = a == 0x7F800000u, is_nan = a > 0x7F800000u;
  uint32_t mag = __builtin_bit_cast(uint32_t, as_float(a) * f.code_scale * f.code_scale_2) >> (23 - f[T]);
  if (EXTENDED) mag = is_inf ? uint32_t(f[CODE_OF_MAX]) + 1 : mag;
  if (HAS_NANS) mag = is_nan ? uint32_t(f[CODE_OF_NAN]) : mag;
  const uint32_t negative = bits_in >> 31, k = f[K];
  // Two's complement (OCP INT8): the negated magnitude; sign-magnitude: the sign bit, kept
  // on a zero only with a negative zero, never on a NaN.
  if (TWOS_COMPLEMENT) return ((mag ^ (0u - negative)) + negative) & ((1u << k) - 1);
  const uint32_t keep_sign = negative & (is_nan ^ 1) & (f.has_nz | (mag != 0)) & f.is_signed;
  // (Kept to K bits: an element that is no value, which encode without its check lets
  // through, has a magnitude of more bits; its code is unspecified, but a code.)
  return (mag | (keep_sign << (k - 1))) & ((1u << k) - 1);
}

// code_of over lanes h0 .. h1, with the format's kind known to the compiler in each loop.
// On a local copy of the parameters, as round_lanes: read through the reference, they kept
// the loops scalar wherever GCC did not inline this into a caller that had copied them
// (rounded codes, fewbit.quantize, ran 5-10 times slower than rounded values).
inline void codes_of(const uint32_t* __restrict rs, uint32_t* __restrict codes, int h0, int h1, const Fmt& fmt) {
  const Fmt f = fmt;
  if (f.twos_complement) {
    for (int h = h0; h < h1; ++h) codes[h] = code_of<false, false, true>(rs[h], f);
  } else if (f.has_nans && f.extended) {
    for (int h = h0; h < h1; ++h) codes[h] = code_of<true, true, false>(rs[h], f);
  } else if (f.has_nans) {
    for (int h = h0; h < h1; ++h) codes[h] = code_of<false, true, false>(rs[h], f);
  } else if (f.extended) {
    for (int h = h0; h < h1; ++h) codes[h] = code_of<true, false, false>(rs[h], f);
  } else {
    for (int h = h0; h < h1; ++h) codes[h] = code_of<false, false, false>(rs[h], f);
  }
}

FEWBIT_LANE int32_t not_a_value(uint32_t x, uint32_t rounded, const Fmt& f) {
  const int32_t nan = (x & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? (f.has_nans ^ 1) : int32_t(as_float(rounded) != as_float(x));
}

// What a call writes: values in the input's dtype, or codes.
enum Output { VALUES, CODES_U8, CODES_I16, CODES_PACKED };
// Besides the rounding modes: encode, which checks that x is a value of the format
// (round to nearest leaves it unchanged) and writes its code.
constexpr int ENCODE = FRACTION + 1;
// magic_one's RNE and SRC, for the calls where magic.magic_applies.
constexpr int MAGIC_RNE = ENCODE + 1, MAGIC_SRC = ENCODE + 2;
// classical_sr_one, for the calls where native.classical_sr_applies.
constexpr int CLASSICAL_SR = ENCODE + 3;
// encode with magic_one's RNE as the check, where magic.magic_applies.
constexpr int ENCODE_MAGIC = ENCODE + 4;

// Block scaling (block/kernel.py): `size` consecutive elements share a scale S, set from
// their largest magnitude by `rule` (block.formats.SCALE_RULES), and each is rounded as
// x / S. S is 2^e (E8M0) for the first four rules, and for the last two a value of E4M3
// times a per-tensor float32 scale (NVFP4). Rows hold whole blocks: size divides LANES
// and the call starts on a block (a sharded piece's first row from a block inside it).
enum Rule { FLOOR, CEIL, RCEIL, EVEN, NEAREST, UP };
struct Blocks {
  int size;  // 0: no blocks
  Rule rule;
  float tensor_scale;  // 1 where the format has none
  uint8_t* scales;  // codes of the scales (for codes output), or null
  // Whether the element rounding tells a quotient that underflowed to 0 from +-2^-126: only
  // the modes that round away by sign or parity (rup, rdn, rto). The others round every
  // magnitude below 2^-125 to 0: no N <= 30 random bits reach it from an element ulp of at
  // least 2^-92 (block.kernel).
  int zero_is_not_tiny;
};

struct Job {
  const void* x;
  Dtype dtype;
  void* out;
  Output output;
  int64_t n, offset;
  Fmt fmt;
  const uint32_t* keys;  // k0, k1 of the bits stream, then those of the selection stream
  const int32_t* given;  // random bits given per element (or null: drawn from keys)
  bool stream;  // write whole rows of values with non-temporal stores
  Blocks blocks;
  // The random streams' caches, where a thread's jobs share them (run_runs: the runs of one
  // row of blocks draw its words once); null: each job has its own.
  std::vector<Stream>* streams = nullptr;
};

inline bool stochastic(int mode) {
  return (mode >= SRFF && mode <= FRACTION) || mode == MAGIC_SRC || mode == CLASSICAL_SR;
}

// Copy a row's results (bytes a multiple of 32, dst 32-byte aligned) to memory past the
// caches: an output larger than them is not read back soon, and a plain store first reads
// each line it writes (a third of the memory traffic of a copy).
inline void stream_out(const void* src, void* dst, int bytes) {
#ifdef __AVX__
  const __m256i* s = static_cast<const __m256i*>(src);
  __m256i* d = static_cast<__m256i*>(dst);
  for (int i = 0; i < bytes / 32; ++i) _mm256_stream_si256(d + i, _mm256_load_si256(s + i));
#else
  std::memcpy(dst, src, bytes);
#endif
}

// The same for any float32, rounded to nearest even as torch converts.
FEWBIT_LANE uint16_t round_to_bfloat16(uint32_t u) {
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFF : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float16 lanes h0 .. h1 widened to float32 bits, and float32 bits narrowed to float16
// (to nearest even, as torch converts), eight at a time with F16C: GCC leaves a loop of
// _Float16 conversions scalar, which held float16 calls to a fifth of bfloat16's speed.
inline void widen_f16(const uint16_t* x16, uint32_t* out, int h0, int h1) {
  int h = h0;
#ifdef __F16C__
  for (; h + 8 <= h1; h += 8)
    _mm256_storeu_ps(reinterpret_cast<float*>(out + h),
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x16 + h))));
#endif
  for (; h < h1; ++h) {
    const float w = float(__builtin_bit_cast(_Float16, x16[h]));
    std::memcpy(out + h, &w, 4);
  }
}

// 16-bit lanes h0 .. h1 widened to float32 bits: bfloat16's are the high half.
inline void widen(Dtype dtype, const uint16_t* x16, uint32_t* out, int h0, int h1) {
  if (dtype == F16) return widen_f16(x16, out, h0, h1);
  for (int h = h0; h < h1; ++h) out[h] = uint32_t(x16[h]) << 16;
}

inline void narrow_f16(const uint32_t* rs, uint16_t* o, int h0, int h1) {
  int h = h0;
#ifdef __F16C__
  for (; h + 8 <= h1; h += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + h),
                     _mm256_cvtps_ph(_mm256_loadu_ps(reinterpret_cast<const float*>(rs + h)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; h < h1; ++h) o[h] = __builtin_bit_cast(uint16_t, _Float16(as_float(rs[h])));
}

#if defined(__AVX2__) && defined(__F16C__)
// magic_one over float16 lanes h0 .. into o, where Bf16Magic::applies(f, SR, true): in
// groups of TINY_TEST on their 16 bits, where a group holding a lane below 2^emin, Inf or
// NaN goes to in_float32(h) (half_rows's float32 way), up to the second such group in a row
// or the first that reaches past h1; returns its first lane, from which half_rows takes the
// rest of the row in float32. (Group by group all the way, float16 SRC and sr ran 13-17%
// faster on randn * 1 into binary8p4, but RNE 26% slower on randn * 0.01, where nearly
// every group holds such a lane: each group paid for the calls. This way, against the
// whole rest of the row: 10% faster on randn * 1, 4-9% on randn * 8, within 2% on 0.01.) In the target's normal range a float16's magnitude rounds
// as a bfloat16's does (Bf16x16::nearest with Bf16Magic's F16 constants, g), and x's sign
// goes back on whatever it rounds to (F16C: narrow_f16's NaN beyond max). A function of its
// own, not inlined: written into the row loop (when one function held every kind of row),
// it cost float32 block codes up to 12%.
template <bool SR, typename InFloat32>
__attribute__((noinline)) int float16_groups(const uint16_t* x16, Fields n, uint16_t* o, int h0, int h1,
                                             const Bf16Magic& g, InFloat32&& in_float32) {
  const Bf16x16 c(g);
  const Fields16 n16s(n, c);
  const __m256i largest = _mm256_set1_epi16(0x7BFF);  // float16's largest finite magnitude
  const auto slow = [&](__m256i v) {  // below 2^emin, Inf or NaN
    const __m256i a = _mm256_and_si256(v, c.magnitude);
    return _mm256_or_si256(_mm256_cmpgt_epi16(c.emin, a), _mm256_cmpgt_epi16(a, largest));
  };
  const auto fast = [&](int k, const __m256i* v) {
    for (int j = 0; j < PER_TEST; ++j) {
      __m256i mag = c.nearest<SR>(_mm256_and_si256(v[j], c.magnitude), SR ? n16s.at(k + 16 * j) : c.zero);
      mag = _mm256_blendv_epi8(mag, c.beyond, _mm256_cmpgt_epi16(mag, c.max));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k + 16 * j),
                          _mm256_or_si256(mag, _mm256_and_si256(v[j], c.sign_bit)));
    }
  };
  int last_slow = -2 * TINY_TEST;
  return by_groups(x16, h0, h1, slow, fast, [&](int k, const __m256i*) {
    if (k == last_slow + TINY_TEST) return false;
    in_float32(k);
    last_slow = k;
    return true;
  });
}
#endif

// 2^e as float32 bits, e in [-127, 127] (2^-127 is a subnormal).
FEWBIT_LANE uint32_t pow2_bits(int32_t e) { return e >= -126 ? uint32_t(e + 127) << 23 : 0x00400000u; }

// block.kernel._exponent_of for a block whose largest magnitude has float32 bits `amax`
// (not NaN): floor(log2 amax) - emax, plus 1 where the call's rule rounds up (ceil, rceil,
// even: 1 for that rule, else 0), clamped to E8M0's [-127, 127]. amax = m 2^E, m in
// [1, 2), with m's 23 fraction bits F (a subnormal amax, an integer below 2^23 times
// 2^-149, is normalised exactly by converting that integer to float). The rules round up:
// ceil where F != 0; rceil where m > max / 2^emax (F above max's fraction bits); even
// where m rounded to P bits is 2 (F >= 2^23 - 2^(22 - t)). Plain integer selects, so that
// a loop over a row's blocks vectorises.
FEWBIT_LANE int32_t block_exponent(uint32_t amax, int32_t ceil, int32_t rceil, int32_t even, const Fmt& f) {
  const int32_t normal = amax >= 0x00800000u;
  const uint32_t g = normal ? amax : __builtin_bit_cast(uint32_t, float(int32_t(amax)));
  const int32_t E = int32_t(g >> 23) - (normal ? 127 : 127 + 149);
  const uint32_t F = g & 0x7FFFFFu;
  const int32_t up = (ceil & (F != 0)) | (rceil & (F > f.rceil_fraction)) | (even & (F >= f.even_fraction));
  int32_t e = E - f[EMAX] + up;
  e = clampi(e, -127, 127);
  return amax == 0x7F800000u ? 127 : amax == 0 ? -127 : e;  // Inf: log2 is 1024; zeros take -127, as gfloat
}

// block.kernel.block_scales for an E4M3 scale: `target` (amax / M / tensor scale, in
// float64, not negative; NaN for a NaN block, whose results the caller replaces) rounded
// to E4M3 (to nearest even, or up), saturating at its largest value 448. Returns the
// scale and sets its code. Without branches, so that a loop over a row's blocks
// vectorises: a scalar call per block cost as much as the rest of the block's work.
FEWBIT_LANE double e4m3_scale(double target, bool up, uint32_t& code) {
  // E4M3: emin -6, 3 fraction bits. Powers of two built from their bits (std::ilogb and
  // std::ldexp are calls); k + 1023 stays in 1 .. 2046 for every e below.
  const auto pow2 = [](int64_t k) { return __builtin_bit_cast(double, uint64_t(k + 1023) << 52); };
  const int64_t e = std::max<int64_t>(int64_t(__builtin_bit_cast(uint64_t, target) >> 52) - 1023, -6);
  const double q = target * pow2(3 - e);  // exact; at most 16 below 448 (a bound for Inf and NaN)
  const double bounded = q < 16.0 ? q : 16.0;
  const double r = up ? std::ceil(bounded) : std::nearbyint(bounded);
  const bool sat = !(target < 448.0);  // beyond 448 (Inf too) both roundings saturate to it
  code = sat ? 0x7Eu : uint32_t(8 * (e + 6) + int64_t(r));  // r 2^(e-3), r <= 16; subnormals (e = -6, r < 8) too
  return sat ? 448.0 : r * pow2(e - 3);
}

#ifdef __AVX512BW__
// The permutations of bf16_maxima's steps on vectors of 32 16-bit lanes: step k takes
// blocks of s = 32 >> k partial maxima each, in two vectors a and b, to s / 2 each in one:
// lane j s / 2 + i (block j) from lanes j s + i (lo) and j s + i + s / 2 (hi) of a and b
// side by side.
struct Halving {
  static constexpr int STEPS = 5;
  alignas(64) uint16_t lo[STEPS][32], hi[STEPS][32];
  constexpr Halving() : lo(), hi() {
    for (int k = 0; k < STEPS; ++k) {
      const int half = 16 >> k;
      for (int l = 0; l < 32; ++l) {
        lo[k][l] = uint16_t(l / half * 2 * half + l % half);
        hi[k][l] = uint16_t(lo[k][l] + half);
      }
    }
  }
};
constexpr Halving HALVING{};

// N vectors of blocks with S partial maxima each, to vectors of their blocks' maxima.
template <int S, int N>
inline void halve_all(__m512i* v) {
  if constexpr (S > 1) {
    constexpr int k = __builtin_ctz(32u / S), M = N > 1 ? N / 2 : 1;
    const __m512i lo = _mm512_load_si512(HALVING.lo[k]), hi = _mm512_load_si512(HALVING.hi[k]);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const __m512i a = v[2 * i], b = N > 1 ? v[2 * i + 1] : a;  // alone: the second half's lanes are no blocks
      v[i] = _mm512_max_epu16(_mm512_permutex2var_epi16(a, lo, b), _mm512_permutex2var_epi16(a, hi, b));
    }
    halve_all<S / 2, M>(v);
  }
}

// block_maxima of a whole row of bfloat16 in blocks of B. GCC reduced one block at a time,
// a chain of some 12 dependent instructions each; here a step takes two vectors holding
// blocks' partial maxima to one holding both's blocks with half the partials each (two
// permutes and a max), a tree over the row: bfloat16 mxfp8 5-13% faster in L2 on one
// thread (RNE and SRC, codes and values; at 2^24 on two, within the VM's noise). Not for
// float32, whose rows it left as fast in L2 and up to 13% slower at 2^24.
template <int B>
void bf16_maxima(const uint16_t* __restrict x16, uint32_t* __restrict amax) {
  static_assert(B >= 16 && LANES % B == 0, "bfloat16 blocks go on 16 bits in whole vectors of 16");
  constexpr int N = LANES / std::max(B, 32);  // vectors of blocks
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  __m512i v[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) {  // a block spanning several vectors: their maxima
    v[i] = _mm512_and_si512(_mm512_loadu_si512(x16 + i * std::max(B, 32)), magnitude);
#pragma GCC unroll 16
    for (int j = 32; j < B; j += 32)
      v[i] = _mm512_max_epu16(v[i], _mm512_and_si512(_mm512_loadu_si512(x16 + i * B + j), magnitude));
  }
  halve_all<std::min(B, 32), N>(v);
  // v[0] holds the LANES / B <= 32 maxima; as float32 bits (amax holds LANES)
  const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v[0]));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v[0], 1));
  _mm512_storeu_si512(amax, _mm512_slli_epi32(lo, 16));
  _mm512_storeu_si512(amax + 16, _mm512_slli_epi32(hi, 16));
}
#endif

// Each block's largest magnitude, as float32 bits, into amax: the whole blocks b0 .. of
// lanes .. h1 of float32 bits or bfloat16 (FIXED_B as for scale_blocks).
template <int FIXED_B, typename T>
void block_maxima(const T* __restrict xs, int b0, int h1, int B, uint32_t* __restrict amax) {
  if (FIXED_B > 0) B = FIXED_B;
#ifdef __AVX512BW__
  if constexpr (FIXED_B > 0 && sizeof(T) == 2) {
    if (b0 == 0 && h1 == LANES) return bf16_maxima<FIXED_B>(xs, amax);
  }
#endif
  constexpr int WIDEN = 32 - 8 * int(sizeof(T));  // bfloat16: the high half of a float32
  constexpr T MAGNITUDE = T(~T(0)) >> 1;
  for (int b = b0; b < h1 / B; ++b) {
    T m = 0;
    for (int i = 0; i < B; ++i) m = std::max<T>(m, xs[b * B + i] & MAGNITUDE);
    amax[b] = uint32_t(m) << WIDEN;
  }
}

// block.kernel.quantize_blocks up to the rounding, for the whole blocks b0 .. of lanes .. h1
// (a call's lanes start at a block; B elements each; FIXED_B: B known at compile time, 0:
// read from blocks), lane 0 being x's element pos0, from each block's
// largest magnitude in amax (block_maxima): its factor S (NaN for a block holding a NaN)
// into factor and 1 / S into inv where S is a power of two, its scale's code into
// blocks.scales (from pos0 / B), and, unless `scaled` is null, the elements x / S into
// `scaled`. A quotient below float32's normal range becomes +-2^-126 (it rounds alike,
// and a zero would not); a block whose S is 0 holds zeros signed as x, and a NaN block's
// elements are NaN, or 0 in an element format without NaN (the scale carries the NaN).
template <int FIXED_B>
void scale_blocks(const uint32_t* __restrict xs, int b0, int h1, int64_t pos0, const Blocks& blocks, const Fmt& f,
                  uint32_t* __restrict scaled, const uint32_t* __restrict amax, uint32_t* __restrict factor,
                  uint32_t* __restrict inv) {
  const int B = FIXED_B > 0 ? FIXED_B : blocks.size;
  const int b1 = h1 / B;
  const uint32_t fill = f.has_nans ? NAN_BITS : 0;
  const bool pow2 = blocks.rule < NEAREST;
  // In passes each over all the row's blocks, so that one block's chain (reduce, scale,
  // divide) overlaps the next block's instead of stalling on it.
  alignas(64) uint32_t code[LANES];
  if (pow2) {
    const int32_t ceil = blocks.rule == CEIL, rceil = blocks.rule == RCEIL, even = blocks.rule == EVEN;
    for (int b = b0; b < b1; ++b) {
      const int32_t nan = amax[b] > 0x7F800000u;
      const int32_t e = block_exponent(amax[b], ceil, rceil, even, f);
      factor[b] = nan ? NAN_BITS : pow2_bits(e);
      inv[b] = pow2_bits(-e);  // x * 2^-e is x / 2^e, correctly rounded alike
      code[b] = nan ? 0xFF : uint32_t(e + 127);  // E8M0, whose NaN is 0xFF
    }
  } else {
    const bool up = blocks.rule == UP;
    for (int b = b0; b < b1; ++b) {
      const double target = double(as_float(amax[b])) / double(f.max) / double(blocks.tensor_scale);
      uint32_t c;
      float scale = float(e4m3_scale(target, up, c));
      if (up) {
        // S = scale * tensor scale rounds to nearest, maybe below amax / M: then the next
        // scale (E4M3's values lie at least 1/16 apart: 1 + 2^-5 lies below the next).
        uint32_t c_next;
        const float next = float(e4m3_scale(double(scale) * (1 + 0x1p-5), true, c_next));
        const bool short_ = double(scale * blocks.tensor_scale) * double(f.max) < double(as_float(amax[b]));
        scale = short_ ? next : scale;
        c = short_ ? c_next : c;
      }
      const int32_t nan = amax[b] > 0x7F800000u;
      factor[b] = nan ? NAN_BITS : __builtin_bit_cast(uint32_t, scale * blocks.tensor_scale);
      code[b] = nan ? 0xFF : c;  // E4M3's NaN code, as E8M0's
    }
  }
  if (blocks.scales != nullptr)
    for (int b = b0; b < b1; ++b) blocks.scales[pos0 / B + b] = uint8_t(code[b]);  // (pos0 / B exact)
  if (scaled == nullptr) return;
  for (int b = b0; b < b1; ++b) {
    const float s = as_float(pow2 ? inv[b] : factor[b]);
    const uint32_t* x = xs + b * B;
    uint32_t* out = scaled + b * B;
    if (amax[b] > 0x7F800000u || as_float(factor[b]) == 0.0f) {  // a NaN block, or S = 0
      for (int i = 0; i < B; ++i) out[i] = amax[b] > 0x7F800000u ? fill : x[i] & 0x80000000u;
    } else if (pow2 && !blocks.zero_is_not_tiny) {
      // Here x / 2^e rounds as +-2^-126 wherever it lies below it, 0 included.
      for (int i = 0; i < B; ++i) out[i] = __builtin_bit_cast(uint32_t, as_float(x[i]) * s);
    } else {
      for (int i = 0; i < B; ++i) {
        const uint32_t q = __builtin_bit_cast(uint32_t, pow2 ? as_float(x[i]) * s : as_float(x[i]) / s);
        const int32_t under = ((q & 0x7FFFFFFFu) < 0x00800000u) & ((x[i] & 0x7FFFFFFFu) != 0);
        out[i] = under ? (x[i] & 0x80000000u) | 0x00800000u : q;
      }
    }
  }
}

// magic_codes's and magic_values's scaling of an element: x * 2^-e, or x / S (DIVIDE);
// and the blocks they do not scale: a NaN block, or one whose S is 0 (2^-e never is).
template <bool DIVIDE>
FEWBIT_LANE float scale_by(float x, float by) { return DIVIDE ? x / by : x * by; }
template <bool DIVIDE>
FEWBIT_LANE bool unscaled(uint32_t amax, float by) { return amax > 0x7F800000u || (DIVIDE && by == 0.0f); }

// Codes of the magic modes (magic_one's RNE and SRC) on blocks, where no element can be
// refused (sat, or a format with NaN), in one loop per block: each element is scaled, then
// rounded and encoded, x * 2^-e with power-of-two scales (by: each block's 2^-e), x / S
// with others (DIVIDE; by: each block's S). A quotient below float32's normal range needs
// none of scale_blocks's care: these modes round it to 0, as they would +-2^-126. A block
// whose S is 0 holds zeros (-0 where x < 0 and the format has it). The code comes from the
// float adder's sum y = |v| + C, whose low bits count the rounded magnitude in ulps of the binade e_t:
// code_of's result without computing the value (nor its float32 subnormals, which cost
// a microcode assist each for e2m1's 0.5). NaN blocks hold the codes that scale_blocks's
// NaN elements get. (magic_values does the same for values.) Blocks b0 .. h1 / B.
template <bool SR, bool DIVIDE, int FIXED_B>
void magic_codes(const uint32_t* __restrict xs, int b0, int h1, int B, const uint32_t* __restrict amax,
                 const uint32_t* __restrict by, Fields n, const Fmt& f, uint32_t* __restrict codes) {
  if (FIXED_B > 0) B = FIXED_B;
  constexpr uint32_t SIGN = 0x80000000u;
  const uint32_t emin_binade = uint32_t(f[EMIN] + 127) << 23;
  const uint32_t ulp_shift = 23 - f[T], bits = SR ? f[BITS] : 0, sign_at = f[K] - 1;
  const uint32_t max_code = f[CODE_OF_MAX], beyond = f.beyond_code;
  const uint32_t nz = f.has_nz, fill = f.has_nans ? uint32_t(f[CODE_OF_NAN]) : 0;
  for (int b = b0; b < h1 / B; ++b) {
    const float s = as_float(by[b]);
    if (unscaled<DIVIDE>(amax[b], s)) {
      for (int i = 0; i < B; ++i)  // a zero keeps x's sign where the format has -0
        codes[b * B + i] = amax[b] > 0x7F800000u ? fill : ((xs[b * B + i] >> 31) & nz) << sign_at;
      continue;
    }
    for (int i = 0; i < B; ++i) {
      const int h = b * B + i;
      const uint32_t v = __builtin_bit_cast(uint32_t, scale_by<DIVIDE>(as_float(xs[h]), s));
      const uint32_t a = v & ~SIGN;
      const uint32_t c = binade_of(a, f);
      const float big = as_float(c) * f.magic_scale[SR];
      // SRC: y's low N bits hold the fraction below the rounded magnitude; adding n carries
      // out of them where it rounds away (C's low bits are zero; the shift drops them).
      const uint32_t y = __builtin_bit_cast(uint32_t, as_float(a) + big) + (SR ? n.at(h) : 0);
      uint32_t mag = ((y - __builtin_bit_cast(uint32_t, big)) >> bits) + ((c - emin_binade) >> ulp_shift);
      mag = mag > max_code ? beyond : mag;
      const uint32_t keep_sign = (v >> 31) & (nz | (mag != 0));
      codes[h] = mag | (keep_sign << sign_at);  // no NaN here: x * 2^-e is one only in a NaN block
    }
  }
}

#ifdef __AVX2__
// A group of TINY_TEST bfloat16 lanes of power-of-two blocks from lane h, 16 to a vector:
// the lanes v, their magnitudes a, each vector's block exponent e (by: each block's 2^-e),
// and the quotients q = a 2^-e as x's bits with e taken off the exponent field (exact where
// x is normal and q's field stays above 0). B divides LANES, a power of two: block_shift
// = log2 B finds a lane's block (a division per vector cost bfloat16 mxfp8 codes 4-7% in L2).
struct BlockGroup {
  __m256i v[PER_TEST], a[PER_TEST], q[PER_TEST];
  int e[PER_TEST];

  BlockGroup(const uint16_t* x16, int h, const uint32_t* by, int block_shift) {
    for (int j = 0; j < PER_TEST; ++j) {
      const int k = h + 16 * j;
      e[j] = 127 - int(by[k >> block_shift] >> 23);  // 2^-e's exponent field (0 for e = 127: 2^-127 is subnormal)
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + k));
      a[j] = _mm256_and_si256(v[j], _mm256_set1_epi16(0x7FFF));
      q[j] = _mm256_sub_epi16(a[j], _mm256_set1_epi16(int16_t(e[j] * 128)));
    }
  }
};

// bfloat16 blocks with power-of-two scales 2^e on their 16 bits, for the magic modes (B a
// multiple of 16, so that no vector straddles two blocks; SR where Bf16Magic::applies).
// Where x is normal and finite and its quotient q = x 2^-e is at or above 2^emin, q's bits
// are x's with e taken off the exponent field (exact, as the float product x * 2^-e is),
// and q rounds as magic_bf16 rounds in the normal range (to r, no zero). Groups of
// TINY_TEST lanes from lane 0, each passed to out(h, v, r, e) one vector at a time, up to
// the first group holding a lane for which this fails (x zero, subnormal, Inf or NaN, or q
// below 2^emin: the float adder's cases): returns its first lane. by: each block's 2^-e.
// Always inlined: a call took `out`'s closure by reference, and each vector's store,
// which may alias anything an __m256i may, reloaded the closure's fields (bfloat16 mxfp8
// values 19% faster in L2 inlined).
template <bool SR, typename Out>
__attribute__((always_inline)) inline int bf16_blocks(const uint16_t* x16, int h1, int B, const uint32_t* by,
                                                      Fields n, const Bf16x16& c, Out&& out) {
  const Fields16 n16s(n, c);
  const __m256i smallest = _mm256_set1_epi16(0x80), largest = _mm256_set1_epi16(0x7F7F);  // normal, finite
  const int block_shift = __builtin_ctz(unsigned(B));
  int h = 0;
  for (; h + TINY_TEST <= h1; h += TINY_TEST) {
    const BlockGroup g(x16, h, by, block_shift);
    __m256i slow = c.zero;
    for (int j = 0; j < PER_TEST; ++j) {
      const __m256i odd = _mm256_or_si256(_mm256_cmpgt_epi16(smallest, g.a[j]), _mm256_cmpgt_epi16(g.a[j], largest));
      slow = _mm256_or_si256(slow, _mm256_or_si256(odd, _mm256_cmpgt_epi16(c.emin, g.q[j])));
    }
    if (!_mm256_testz_si256(slow, slow)) break;
    for (int j = 0; j < PER_TEST; ++j) {
      out(h + 16 * j, g.v[j], c.nearest<SR>(g.q[j], SR ? n16s.at(h + 16 * j) : c.zero), g.e[j]);
    }
  }
  return h;
}

// Where the 16-bit loops' codes go: uint8 codes (bytes), 4-bit pairs (pairs: lanes k and
// k + 1 in byte k / 2), or, where neither is given, 32-bit codes for write_codes.
struct CodesOut {
  uint8_t* bytes;
  uint8_t* pairs;
  uint32_t* codes;
};

// 16 codes of 16-bit lanes, from lane k (even).
inline void store_codes16(int k, __m256i code, const CodesOut& o) {
  const __m128i lo = _mm256_castsi256_si128(code), hi = _mm256_extracti128_si256(code, 1);
  if (o.bytes != nullptr) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o.bytes + k), _mm_packus_epi16(lo, hi));
  } else if (o.pairs != nullptr) {
    // a 32-bit lane holds codes c0 | c1 << 16 (below 16 each): its low byte, c0 | c1 << 4,
    // from the lane or'd with itself shifted right by 12
    const __m128i low = _mm_set1_epi32(0xFF);
    const __m128i plo = _mm_and_si128(_mm_or_si128(lo, _mm_srli_epi32(lo, 12)), low);
    const __m128i phi = _mm_and_si128(_mm_or_si128(hi, _mm_srli_epi32(hi, 12)), low);
    const __m128i bytes = _mm_packus_epi16(_mm_packus_epi32(plo, phi), _mm_setzero_si128());
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o.pairs + k / 2), bytes);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.codes + k), _mm256_cvtepu16_epi32(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.codes + k + 8), _mm256_cvtepu16_epi32(hi));
  }
}

// magic_codes through bf16_blocks: a code is encode_bf16_row's shift of r, or the code
// beyond max, with x's sign, to `to`. Returns the first lane left to magic_codes. (Not inlined, as the value one:
// block_rows is big enough.)
template <bool SR>
__attribute__((noinline)) int bf16_block_codes(const uint16_t* x16, int h1, int B, const uint32_t* by, Fields n,
                                               const Bf16x16& c, const Fmt& f, CodesOut to) {
  const __m256i code_base = _mm256_set1_epi16(int16_t(((f[EMIN] + 126) << 7)));
  const __m128i ulp_shift = _mm_cvtsi32_si128(7 - f[T]), sign_shift = _mm_cvtsi32_si128(16 - f[K]);
  const __m256i max_code = _mm256_set1_epi16(int16_t(f[CODE_OF_MAX]));
  const __m256i beyond = _mm256_set1_epi16(int16_t(f.beyond_code));
  return bf16_blocks<SR>(x16, h1, B, by, n, c, [&](int k, __m256i v, __m256i r, int) {
    __m256i code = _mm256_srl_epi16(_mm256_sub_epi16(r, code_base), ulp_shift);
    code = _mm256_blendv_epi8(code, beyond, _mm256_cmpgt_epi16(code, max_code));
    code = _mm256_or_si256(code, _mm256_srl_epi16(_mm256_and_si256(v, c.sign_bit), sign_shift));
    store_codes16(k, code, to);
  });
}

// magic_values through bf16_blocks, into bfloat16 `out`: r, or the value beyond max (max,
// Inf or NaN), times 2^e, with x's sign (NaN as 0xFFFF). A finite r 2^e is r's bits with e
// put back on the exponent field, as float32's product gives it: it is x rounded on the
// grid of x's binade (normal: at least 2^-126), or max 2^e below |x| (r exceeds max only
// where q does); past float32's largest value lies only 2^128, a power of two, whose bits
// so put are Inf's. Returns the first lane left to magic_values.
template <bool SR>
__attribute__((noinline)) int bf16_block_values(const uint16_t* x16, int h1, int B, const uint32_t* by, Fields n,
                                                const Bf16x16& c, bool sat, uint16_t* out) {
  const bool special = !sat;  // beyond max lies Inf or NaN (magic_valued: sat, or a format with NaN)
  return bf16_blocks<SR>(x16, h1, B, by, n, c, [&](int k, __m256i v, __m256i r, int e) {
    const __m256i over = _mm256_cmpgt_epi16(r, c.max);
    const __m256i mag = _mm256_blendv_epi8(r, c.beyond, over);
    __m256i value = _mm256_add_epi16(mag, _mm256_set1_epi16(int16_t(e * 128)));
    if (special) value = _mm256_blendv_epi8(value, mag, over);
    value = _mm256_or_si256(value, _mm256_and_si256(v, c.sign_bit));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), value);
  });
}

// An element format of at most 8 magnitudes (e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6), for RNE of
// bfloat16 power-of-two blocks on their 16 bits. Its normal range spans so few binades
// that most quotients q = x 2^-e lie below 2^emin, where bf16_blocks hands the row over;
// here the code of q's magnitude is the number of midpoints between magnitudes that q
// exceeds (at a midpoint, the even code: the one whose last significand bit is 0), at any
// magnitude and without the float adder.
struct FewMagnitudes {
  static constexpr int MOST = 8;
  int count = 0;  // magnitudes; code i is the i-th (its code_of), so max's is count - 1
  int16_t above[MOST - 1];  // code = #{i: q's bits > above[i]} (past count - 1: never)
  alignas(16) int16_t value[MOST] = {};  // each magnitude's bfloat16 bits (past count - 1: 0)
  int lo_e = 0;  // the least block exponent e for which the 16 bits hold (few_blocks)
  int16_t nz;  // the sign bit where a zero keeps x's sign (the format has -0), else 0

  explicit FewMagnitudes(const Fmt& f) : nz(int16_t(f.has_nz ? 0x8000 : 0)) {
    double v[MOST + 1];
    for (double x = 0; count <= MOST && x <= f.max; ++count) {
      v[count] = x;
      x += std::ldexp(1.0, (x < std::ldexp(1.0, f[EMIN]) ? f[EMIN] : std::ilogb(x)) - f[T]);  // its ulp
    }
    if (count > MOST) return;
    std::fill(above, above + MOST - 1, INT16_MAX);  // the loops compare all 7, without a branch
    for (int i = 0; i < count; ++i) value[i] = int16_t(to_bfloat16(__builtin_bit_cast(uint32_t, float(v[i]))));
    for (int i = 0; i + 1 < count; ++i) {
      const int16_t mid = int16_t(to_bfloat16(__builtin_bit_cast(uint32_t, float((v[i] + v[i + 1]) / 2))));
      above[i] = int16_t(i % 2 == 0 ? mid : mid - 1);  // a tie goes to code i where i is even
    }
    // A zero or subnormal x yields q's bits below 0x80 - 128 e, which must stay at or below
    // above[0]; then value[1] 2^e, twice that midpoint or more, is a normal bfloat16 too.
    // (No bound above: a value's bits with e added are finite up to 2^128, which q never
    // exceeds and whose bits so made are Inf's, as bf16_block_values's; a block holding
    // NaN or Inf hands its lanes over from its first, where the group holding it does.)
    lo_e = -((above[0] - 0x7F) / 128);
  }
  // Whether it holds f's magnitudes, laid out so: sign-magnitude codes from zero, a code's
  // last bit its significand's (t >= 1: what RNE's ties go by), saturating (every magnitude
  // above the last midpoint is max's), and values that bfloat16 holds.
  bool holds(const Fmt& f) const {
    return count <= MOST && count - 1 == f[CODE_OF_MAX] && f.sat && f.has_zero && f.is_signed && !f.twos_complement
           && f[T] >= 1 && f[T] <= 7;
  }
};

// As bf16_blocks, into a FewMagnitudes format by RNE: out(h, code, sign, e) for each vector
// of groups without a lane that is Inf or NaN, in blocks whose e is at least lo_e; sign is
// x's sign bit, off a code-0 magnitude where the format has no -0.
template <typename Out>
__attribute__((always_inline)) inline int few_blocks(const uint16_t* x16, int h1, int B, const uint32_t* by,
                                                     const FewMagnitudes& m, Out&& out) {
  const __m256i largest = _mm256_set1_epi16(0x7F7F), zero = _mm256_setzero_si256();
  const __m256i sign_bit = _mm256_set1_epi16(int16_t(0x8000)), nz = _mm256_set1_epi16(m.nz);
  __m256i above[FewMagnitudes::MOST - 1];
  for (int i = 0; i < FewMagnitudes::MOST - 1; ++i) above[i] = _mm256_set1_epi16(m.above[i]);
  const int block_shift = __builtin_ctz(unsigned(B));
  int h = 0;
  for (; h + TINY_TEST <= h1; h += TINY_TEST) {
    const BlockGroup g(x16, h, by, block_shift);
    __m256i slow = zero;
    bool below = false;
    for (int j = 0; j < PER_TEST; ++j) {
      below |= g.e[j] < m.lo_e;
      slow = _mm256_or_si256(slow, _mm256_cmpgt_epi16(g.a[j], largest));
    }
    if (below || !_mm256_testz_si256(slow, slow)) break;
    for (int j = 0; j < PER_TEST; ++j) {
      __m256i code = zero;  // minus the midpoints exceeded
      for (int i = 0; i < FewMagnitudes::MOST - 1; ++i) code = _mm256_add_epi16(code, _mm256_cmpgt_epi16(g.q[j], above[i]));
      code = _mm256_sub_epi16(zero, code);
      const __m256i kept = _mm256_or_si256(nz, _mm256_andnot_si256(_mm256_cmpeq_epi16(code, zero), sign_bit));
      out(h + 16 * j, code, _mm256_and_si256(g.v[j], kept), g.e[j]);
    }
  }
  return h;
}

// magic_codes of RNE into a FewMagnitudes format through few_blocks, with the sign it gives.
// Returns the first lane left to magic_codes.
__attribute__((noinline)) int few_block_codes(const uint16_t* x16, int h1, int B, const uint32_t* by,
                                              const FewMagnitudes& m, const Fmt& f, CodesOut to) {
  const __m128i sign_shift = _mm_cvtsi32_si128(16 - f[K]);
  return few_blocks(x16, h1, B, by, m, [=](int k, __m256i code, __m256i sign, int) {
    store_codes16(k, _mm256_or_si256(code, _mm256_srl_epi16(sign, sign_shift)), to);
  });
}

// magic_values of RNE into a FewMagnitudes format through few_blocks, into bfloat16 `out`:
// the code's magnitude times 2^e (its exponent field plus e; a zero stays 0), with the sign
// it gives. Returns the first lane left to magic_values.
__attribute__((noinline)) int few_block_values(const uint16_t* x16, int h1, int B, const uint32_t* by,
                                               const FewMagnitudes& m, uint16_t* out) {
  // value[code] by a byte shuffle: lane bytes 2 code and 2 code + 1 of the table
  const __m256i values = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(m.value)));
  const __m256i pair = _mm256_set1_epi16(0x0202), odd = _mm256_set1_epi16(0x0100), zero = _mm256_setzero_si256();
  return few_blocks(x16, h1, B, by, m, [=](int k, __m256i code, __m256i sign, int e) {
    const __m256i at = _mm256_add_epi16(_mm256_mullo_epi16(code, pair), odd);
    const __m256i value = _mm256_add_epi16(_mm256_shuffle_epi8(values, at), _mm256_set1_epi16(int16_t(e * 128)));
    const __m256i magnitude = _mm256_andnot_si256(_mm256_cmpeq_epi16(code, zero), value);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_or_si256(magnitude, sign));
  });
}
#endif

// Block values of the magic modes where no element can be refused, in one loop per block
// as magic_codes: each element scaled (x * 2^-e, or x / S: DIVIDE; by as there), rounded by
// magic_one, and multiplied by S (factor). A NaN block's values are NaN and a block whose S
// is 0 holds zeros, as scale_blocks, magic_one and scale_back give them. Blocks b0 .. h1 / B.
template <bool SR, bool DIVIDE, int FIXED_B>
void magic_values(const uint32_t* __restrict xs, int b0, int h1, int B, const uint32_t* __restrict amax,
                  const uint32_t* __restrict by, const uint32_t* __restrict factor, Fields n, const Fmt& f,
                  uint32_t* __restrict rs) {
  if (FIXED_B > 0) B = FIXED_B;
  for (int b = b0; b < h1 / B; ++b) {
    const float s = as_float(by[b]), back = as_float(factor[b]);
    if (unscaled<DIVIDE>(amax[b], s)) {
      for (int i = 0; i < B; ++i)
        rs[b * B + i] = amax[b] > 0x7F800000u ? NAN_BITS : f.has_nz ? xs[b * B + i] & 0x80000000u : 0;
      continue;
    }
    for (int i = 0; i < B; ++i) {
      const int h = b * B + i;
      const float v = scale_by<DIVIDE>(as_float(xs[h]), s);
      const uint32_t r = magic_one<SR>(__builtin_bit_cast(uint32_t, v), SR ? n.at(h) : 0, f);
      rs[h] = __builtin_bit_cast(uint32_t, as_float(r) * back);
    }
  }
}

// Block values q * S in place, in float32 as block.kernel (FIXED_B as for scale_blocks).
template <int FIXED_B>
void scale_back(uint32_t* __restrict rs, int b0, int h1, int B, const uint32_t* __restrict factor) {
  if (FIXED_B > 0) B = FIXED_B;
  for (int b = b0; b < h1 / B; ++b) {
    const float s = as_float(factor[b]);
    for (int i = 0; i < B; ++i) rs[b * B + i] = __builtin_bit_cast(uint32_t, as_float(rs[b * B + i]) * s);
  }
}

// The block sizes of the registered formats get loops of a known length (unrolled, no
// remainder); others the general one: call(size) with size an std::integral_constant of
// the block size, or of 0.
template <typename Call>
inline void by_block_size(int B, Call&& call) {
  switch (B) {
    case 16: call(std::integral_constant<int, 16>{}); break;
    case 32: call(std::integral_constant<int, 32>{}); break;
    case 64: call(std::integral_constant<int, 64>{}); break;
    default: call(std::integral_constant<int, 0>{});
  }
}

// Where a row lies in the call: lanes h0 .. h1 of elements start .. start + LANES are the
// call's, and lane 0 lies at position pos0 of x (negative in an offset call's first row).
struct Row {
  int64_t start, pos0;
  int h0, h1;
  Row(const Job& job, int64_t row)
      : start(row * LANES), pos0(start - job.offset), h0(int(std::max<int64_t>(job.offset - start, 0))),
        h1(int(std::min<int64_t>(job.n - pos0, LANES))) {}  // not offset + n: it may be 2^63
  bool whole() const { return h0 == 0 && h1 == LANES; }
};

// The random fields of each row: from a stream's words, or the given bits (the N rounding
// bits low, sr_fraction's selection bits above them). Deterministic modes read none.
template <int MODE>
struct RowBits {
  std::vector<Stream> own;  // on the heap: each holds a row of words of both outputs
  std::vector<Stream>& streams;  // own, or the job's
  const int32_t* given;
  int bits;

  explicit RowBits(const Job& job)
      : streams(job.streams != nullptr ? *job.streams : own), given(job.given), bits(job.fmt[BITS]) {
    if (stochastic(MODE) && given == nullptr && streams.empty()) {
      streams.emplace_back(job.keys[0], job.keys[1], bits);
      if (MODE == FRACTION) streams.emplace_back(job.keys[2], job.keys[3], 16);
    }
  }

  // n and sel of element row `row` (lane 0 at pos0); `xs` stands in for deterministic modes.
  void at(int64_t row, int64_t pos0, const uint32_t* xs, Fields& n, Fields& sel) {
    n = sel = {xs, 0, 0};
    if (!stochastic(MODE)) return;
    if (given != nullptr) {
      const uint32_t* g = reinterpret_cast<const uint32_t*>(given + pos0);
      n = {g, 0, (1u << bits) - 1};
      sel = {g, uint32_t(bits), ~0u};
    } else {
      n = streams[0].fields(row);
      if (MODE == FRACTION) sel = streams[1].fields(row);
    }
  }
};

// Lanes h0 .. h1 of xs rounded into rs as MODE rounds them (encode: to nearest, to check
// them). Returns the first lane without a valid result (not a value of the format, for
// encode; NaN in a format without NaN, for the others), or -1.
template <int MODE>
__attribute__((noinline)) int round_lanes(const uint32_t* xs, uint32_t* rs, Fields n, Fields sel, int h0, int h1,
                                          const Fmt& fmt) {
  const Fmt f = fmt;  // a local copy: stores through rs cannot change it, and the loops vectorise
  if constexpr (MODE == ENCODE || MODE == ENCODE_MAGIC) {
    for (int h = h0; h < h1; ++h)
      rs[h] = MODE == ENCODE_MAGIC ? magic_one<false>(xs[h], 0, f) : round_one<RNE>(xs[h], 0, 0, f);
    // x is a value of the format iff rounding leaves it unchanged (a NaN iff it has NaNs).
    int32_t any = 0;
    for (int h = h0; h < h1; ++h) any |= not_a_value(xs[h], rs[h], f);
    for (int h = h0; any && h < h1; ++h)
      if (not_a_value(xs[h], rs[h], f)) return h;
    return -1;
  } else {
    if constexpr (MODE == MAGIC_RNE || MODE == MAGIC_SRC) {
      for (int h = h0; h < h1; ++h) rs[h] = magic_one<MODE == MAGIC_SRC>(xs[h], n.at(h), f);
    } else if constexpr (MODE == CLASSICAL_SR) {
      for (int h = h0; h < h1; ++h) rs[h] = classical_sr_one(xs[h], n.at(h), f);
    } else {
      for (int h = h0; h < h1; ++h) rs[h] = round_one<Mode(MODE)>(xs[h], n.at(h), sel.at(h), f);
    }
    if (f.has_nans) return -1;  // NaN marks an element without a valid result
    int32_t any = 0;
    for (int h = h0; h < h1; ++h) any |= (rs[h] & 0x7FFFFFFFu) > 0x7F800000u;
    for (int h = h0; any && h < h1; ++h)
      if ((rs[h] & 0x7FFFFFFFu) > 0x7F800000u) return h;
    return -1;
  }
}

// Whether a row of values goes out through stream_out: a whole row, where the call streams.
inline bool streamed(const Job& job, const Row& r) {
  const int elem = job.dtype == F32 ? 4 : 2;
  return job.stream && r.whole() && reinterpret_cast<uintptr_t>(static_cast<char*>(job.out) + r.pos0 * elem) % 32 == 0;
}

// A row's values (float32 bits, lanes from .. h1) written out in x's dtype. bfloat16 takes
// their top halves where they are bfloat16 values already (`exact`), else rounds to nearest.
inline void write_values(const Job& job, const Row r, const uint32_t* rs, int from, bool exact, bool stream) {
  if (job.dtype == F32) {
    if (stream) {
      stream_out(rs, static_cast<uint32_t*>(job.out) + r.pos0, LANES * 4);
    } else {
      std::memcpy(static_cast<uint32_t*>(job.out) + r.pos0 + from, rs + from, size_t(r.h1 - from) * 4);
    }
  } else if (job.dtype == BF16) {
    uint16_t* o = static_cast<uint16_t*>(job.out) + r.pos0;
    if (exact) {
      for (int h = from; h < r.h1; ++h) o[h] = to_bfloat16(rs[h]);
    } else {
      for (int h = from; h < r.h1; ++h) o[h] = round_to_bfloat16(rs[h]);
    }
  } else {
    narrow_f16(rs, static_cast<uint16_t*>(job.out) + r.pos0, from, r.h1);
  }
}

// A row's codes (32 bits each, lanes from .. h1) narrowed into the call's output: computed in
// 32 bits because GCC vectorises no mix of widths. (r by value: a byte store may alias
// anything, and a loop bound read through a reference would keep the loop scalar.)
inline void write_codes(const Job& job, const Row r, const uint32_t* codes, int from) {
  if (job.output == CODES_U8) {
    uint8_t* o = static_cast<uint8_t*>(job.out) + r.pos0;
    for (int h = from; h < r.h1; ++h) o[h] = uint8_t(codes[h]);
  } else if (job.output == CODES_I16) {
    uint16_t* o = static_cast<uint16_t*>(job.out) + r.pos0;
    for (int h = from; h < r.h1; ++h) o[h] = uint16_t(codes[h]);
  } else {  // packed: offset and row starts are even, so pairs lie within a row
    // (Each code kept to its nibble: an element that is no value, which encode without its
    // check lets through, has a code of more bits, which must not reach its neighbour's.)
    uint8_t* o = static_cast<uint8_t*>(job.out) + r.pos0 / 2;
    for (int h = from / 2; h < r.h1 / 2; ++h) o[h] = uint8_t((codes[2 * h] & 15u) | (codes[2 * h + 1] << 4));
  }
}

// The rows of a call, one function per kind of row (float32 elements, 16-bit elements,
// blocks), each with its own loop and buffers. Not inlined into run_rows: in one function
// the three compiled as one frame, and any edit of one moved the others' speed by 5-12%.
// Each returns the first position without a valid result, or -1.

template <int MODE>
__attribute__((noinline)) int64_t float32_rows(const Job& job, int64_t row0, int64_t row1) {
  const Fmt f = job.fmt;  // a local copy: stores through the output pointers cannot change it
  RowBits<MODE> bits(job);
  alignas(64) uint32_t rbuf[LANES], cbuf[LANES];
  int64_t bad = -1;
  for (int64_t row = row0; row < row1; ++row) {
    const Row r(job, row);
    const uint32_t* xs = static_cast<const uint32_t*>(job.x) + r.pos0;
    Fields n, sel;
    bits.at(row, r.pos0, xs, n, sel);
    const bool values = job.output == VALUES, stream = values && streamed(job, r);
    // Values go straight out where they do not stream.
    uint32_t* rs = values && !stream ? static_cast<uint32_t*>(job.out) + r.pos0 : rbuf;
    const int lane = round_lanes<MODE>(xs, rs, n, sel, r.h0, r.h1, f);
    if (lane >= 0 && bad < 0) bad = r.pos0 + lane;
    if (stream) {
      stream_out(rbuf, static_cast<uint32_t*>(job.out) + r.pos0, LANES * 4);
    } else if (!values) {
      codes_of(rs, cbuf, r.h0, r.h1, f);
      write_codes(job, r, cbuf, r.h0);
    }
  }
  return bad;
}

template <int MODE>
__attribute__((noinline)) int64_t half_rows(const Job& job, int64_t row0, int64_t row1) {
  constexpr bool MAGIC = MODE == MAGIC_RNE || MODE == MAGIC_SRC, SR = MODE == MAGIC_SRC;
  const Fmt f = job.fmt;
  RowBits<MODE> bits(job);
  alignas(64) uint32_t xbuf[LANES], rbuf[LANES], cbuf[LANES];
  const bool values = job.output == VALUES;
  // bfloat16 values of the magic modes into formats with NaN (no result to check): widened,
  // rounded and narrowed in one loop, on their 16 bits where Bf16Magic applies.
  const bool fused = MAGIC && job.dtype == BF16 && values && f.has_nans;
  const Bf16Magic g16(f, SR);
  const bool bf16_magic = fused && Bf16Magic::applies(f, SR);
#ifdef __AVX2__
  // encode to uint8 codes: whole rows of bfloat16 on their 16 bits (encode_bf16_row), and
  // of float16 that way where they convert to bfloat16 exactly (with F16C)
  const bool bf16_codes = MODE == ENCODE_MAGIC && job.output == CODES_U8;
  const Bf16x16 c16(g16);
  // Rounded codes (fewbit.quantize) of bfloat16 into a format with NaN (every element has a
  // result): whole rows rounded on their 16 bits into a row buffer, then encoded from it as
  // encode's rows are (c_nearest: the constants of its rounding, for the codes below 2^emin),
  // without encode's check.
  const bool quantize16 = MAGIC && job.output == CODES_U8 && f.has_nans;  // with f16_quantize below
  const bool bf16_quantize = quantize16 && job.dtype == BF16 && Bf16Magic::applies(f, SR);
  const Bf16Magic g_nearest(f, false);
  const Bf16x16 c_nearest(g_nearest);
#endif
#if defined(__AVX2__) && defined(__F16C__)
  // float16 values on their 16 bits where they can (float16_groups); and rounded codes of
  // whole rows of float16 into a format with NaN, from those values in a row buffer,
  // encoded as bfloat16s (every value of an 8-bit format is one).
  const bool f16_rows = MAGIC && job.dtype == F16 && values && Bf16Magic::applies(f, SR, true);
  const bool f16_quantize = quantize16 && job.dtype == F16 && Bf16Magic::applies(f, SR, true);
  const Bf16Magic g_f16(f, SR, true);
#endif
  int64_t bad = -1;
  for (int64_t row = row0; row < row1; ++row) {
    const Row r(job, row);
    const uint16_t* x16 = static_cast<const uint16_t*>(job.x) + r.pos0;
#ifdef __AVX2__
    if (bf16_codes && r.whole()) {
      uint16_t* b16 = reinterpret_cast<uint16_t*>(xbuf);  // widened again below if need be
#ifdef __F16C__
      const bool exact = job.dtype == BF16 || float16_as_bfloat16(x16, b16);
#else
      const bool exact = job.dtype == BF16;
#endif
      if (exact && encode_bf16_row<true>(job.dtype == BF16 ? x16 : b16, static_cast<uint8_t*>(job.out) + r.pos0,
                                         c16, f))
        continue;
    }
#endif
    Fields n, sel;
    bits.at(row, r.pos0, xbuf, n, sel);
    int from = r.h0;  // the first lane left to the float32 path
    if constexpr (MAGIC) {
#ifdef __AVX2__
      if (bf16_quantize && r.whole()) {
        uint16_t* b16 = reinterpret_cast<uint16_t*>(rbuf);
        magic_bf16_row<SR>(x16, n, b16, 0, LANES, g16);
        encode_bf16_row<false>(b16, static_cast<uint8_t*>(job.out) + r.pos0, c_nearest, f);
        continue;
      }
#endif
      if (fused) {
        const bool stream = streamed(job, r);
        uint16_t* o = stream ? reinterpret_cast<uint16_t*>(rbuf) : static_cast<uint16_t*>(job.out) + r.pos0;
        if (bf16_magic) {
          magic_bf16_row<SR>(x16, n, o, r.h0, r.h1, g16);
        } else {
          for (int h = r.h0; h < r.h1; ++h) o[h] = to_bfloat16(magic_one<SR>(uint32_t(x16[h]) << 16, n.at(h), f));
        }
        if (stream) stream_out(rbuf, static_cast<uint16_t*>(job.out) + r.pos0, LANES * 2);
        continue;
      }
#if defined(__AVX2__) && defined(__F16C__)
      // Groups that need float32 go the float32 way one by one, as does the tail.
      if (f16_rows || (f16_quantize && r.whole())) {
        uint16_t* o = f16_rows ? static_cast<uint16_t*>(job.out) + r.pos0 : reinterpret_cast<uint16_t*>(cbuf);
        const auto in_float32 = [&](int k, int end) {
          widen_f16(x16, xbuf, k, end);
          const int lane = round_lanes<MODE>(xbuf, rbuf, n, sel, k, end, f);
          if (lane >= 0 && bad < 0) bad = r.pos0 + lane;
          narrow_f16(rbuf, o, k, end);
        };
        from = float16_groups<SR>(x16, n, o, from, r.h1, g_f16, [&](int k) { in_float32(k, k + TINY_TEST); });
        if (from < r.h1) in_float32(from, r.h1);
        if (f16_rows) continue;
        uint16_t* b16 = reinterpret_cast<uint16_t*>(xbuf);
        if (float16_as_bfloat16(o, b16)) {  // (a rounding's NaN is float16's quiet one, which converts)
          encode_bf16_row<false>(b16, static_cast<uint8_t*>(job.out) + r.pos0, c_nearest, f);
          continue;
        }
        from = r.h0;  // should a row's values not be bfloat16s, the general way does it again
      }
#endif
    }
    widen(job.dtype, x16, xbuf, from, r.h1);
    const int lane = round_lanes<MODE>(xbuf, rbuf, n, sel, from, r.h1, f);
    if (lane >= 0 && bad < 0) bad = r.pos0 + lane;
    if (values) {
      write_values(job, r, rbuf, from, true, false);
    } else {
      codes_of(rbuf, cbuf, from, r.h1, f);
      write_codes(job, r, cbuf, from);
    }
  }
  return bad;
}

// How far ahead block_rows prefetches x, in rows.
constexpr int PREFETCH_ROWS = 2;

template <int MODE>
__attribute__((noinline)) int64_t block_rows(const Job& job, int64_t row0, int64_t row1) {
  constexpr bool MAGIC = MODE == MAGIC_RNE || MODE == MAGIC_SRC, SR = MODE == MAGIC_SRC;
  const Fmt f = job.fmt;
  RowBits<MODE> bits(job);
  const int B = job.blocks.size;
  // The scaled elements, each block's largest magnitude, S and 1 / S; the row's values or codes.
  alignas(64) uint32_t xbuf[LANES], sbuf[LANES], amax[LANES], factor[LANES], inv[LANES];
  alignas(64) uint32_t rbuf[LANES], cbuf[LANES];
  const bool values = job.output == VALUES;
  // The magic modes scale, round and encode (or scale back) in one loop per block where no
  // element can be refused.
  const bool magic = MAGIC && (f.sat || f.has_nans);
  const bool pow2 = job.blocks.rule < NEAREST;
#ifdef __AVX2__
  // bfloat16 codes and values of power-of-two blocks on their 16 bits where they can
  // (bf16_block_codes, bf16_block_values). Not into element formats whose normal range
  // spans 4 binades or fewer (e2m1, e2m3: 2): most quotients of a Gaussian block lie below
  // their 2^emin, so the first group nearly always hands the row over, and the test alone
  // cost mxfp4 5-12%.
  const bool bf16_blocks = magic && pow2 && job.dtype == BF16 && B % 16 == 0 && Bf16Magic::applies(f, SR)
                           && f[EMAX] - f[EMIN] > 4;
  const Bf16x16 c16(Bf16Magic(f, SR));
  // Those formats' RNE by their few magnitudes instead (few_block_codes, few_block_values).
  const FewMagnitudes few16(f);
  const bool few = !SR && magic && pow2 && job.dtype == BF16 && B % 16 == 0 && !bf16_blocks && few16.holds(f);
  const bool on_16_bits = bf16_blocks || few;
#else
  constexpr bool on_16_bits = false;
#endif
  const int elem = job.dtype == F32 ? 4 : 2;
  int64_t bad = -1;
  for (int64_t row = row0; row < row1; ++row) {
    const Row r(job, row);
    // The row's first block: 0 but in a sharded piece's first row, which starts at a block
    // inside it (the lanes before it are not the call's, and x's memory before them is not
    // read). The 16-bit loops take whole rows from lane 0.
    const int first = r.h0 / B;
    const bool sixteen = on_16_bits && first == 0;
    int done = r.h0;  // the lanes before this one went out already (or are not the call's)
    // Ask for x's row after next now: the hardware prefetchers stop at 4 KiB pages, two
    // rows of float32, and a block row's work is long enough to wait on memory otherwise
    // (block codes went from 0.79 to 0.86 of a copy's speed at 2^24 elements).
    if (row + PREFETCH_ROWS < row1) {
      const char* ahead = static_cast<const char*>(job.x) + (r.pos0 + PREFETCH_ROWS * LANES) * elem;
      for (int i = 0; i < LANES * elem; i += 64) __builtin_prefetch(ahead + i);
    }
    const uint16_t* x16 = static_cast<const uint16_t*>(job.x) + r.pos0;
    const uint32_t* xs = xbuf;
    if (job.dtype == F32) {
      xs = static_cast<const uint32_t*>(job.x) + r.pos0;
    } else if (!sixteen) {  // which widens the lanes it leaves, below
      widen(job.dtype, x16, xbuf, r.h0, r.h1);
    }
    uint32_t* scaled = magic ? nullptr : sbuf;  // the magic loops scale as they go
    by_block_size(B, [&](auto size) {
      if (sixteen) {
        block_maxima<size()>(x16, 0, r.h1, B, amax);
      } else {
        block_maxima<size()>(xs, first, r.h1, B, amax);
      }
      scale_blocks<size()>(xs, first, r.h1, r.pos0, job.blocks, f, scaled, amax, factor, inv);
    });
    Fields n, sel;
    bits.at(row, r.pos0, xs, n, sel);
    if constexpr (MAGIC) {
      if (magic) {
        int b0 = first;  // the first block left to magic_codes or magic_values
#ifdef __AVX2__
        if (sixteen) {
          if (values) {
            uint16_t* out16 = static_cast<uint16_t*>(job.out) + r.pos0;
            b0 = (few ? few_block_values(x16, r.h1, B, inv, few16, out16)
                      : bf16_block_values<SR>(x16, r.h1, B, inv, n, c16, f.sat, out16)) / B;
            done = b0 * B;
          } else {
            uint8_t* out8 = static_cast<uint8_t*>(job.out);
            const CodesOut to{job.output == CODES_U8 ? out8 + r.pos0 : nullptr,
                              job.output == CODES_PACKED ? out8 + r.pos0 / 2 : nullptr, cbuf};
            b0 = (few ? few_block_codes(x16, r.h1, B, inv, few16, f, to)
                      : bf16_block_codes<SR>(x16, r.h1, B, inv, n, c16, f, to)) / B;
            if (to.bytes != nullptr || to.pairs != nullptr) done = b0 * B;
          }
          if (done == r.h1) continue;  // every lane went out
          widen(BF16, x16, xbuf, b0 * B, r.h1);
        }
#endif
        by_block_size(B, [&](auto size) {
          if (values && pow2) {
            magic_values<SR, false, size()>(xs, b0, r.h1, B, amax, inv, factor, n, f, rbuf);
          } else if (values) {
            magic_values<SR, true, size()>(xs, b0, r.h1, B, amax, factor, factor, n, f, rbuf);
          } else if (pow2) {
            magic_codes<SR, false, size()>(xs, b0, r.h1, B, amax, inv, n, f, cbuf);
          } else {
            magic_codes<SR, true, size()>(xs, b0, r.h1, B, amax, factor, n, f, cbuf);
          }
        });
        if (values) {
          write_values(job, r, rbuf, done, pow2, streamed(job, r));
        } else {
          write_codes(job, r, cbuf, done);
        }
        continue;
      }
    }
    const int lane = round_lanes<MODE>(sbuf, rbuf, n, sel, r.h0, r.h1, f);
    if (lane >= 0 && bad < 0) bad = r.pos0 + lane;
    if (values) {
      // q * S, in float32 as block.kernel. From a bfloat16 x with S = 2^e they are bfloat16
      // values too: where q's grid times 2^e is finer than bfloat16's at x / 2^e, x / 2^e
      // lies on it and q * 2^e = x; elsewhere q * 2^e is a multiple of bfloat16's step
      // there. Other scales need the rounding.
      by_block_size(B, [&](auto size) { scale_back<size()>(rbuf, first, r.h1, B, factor); });
      write_values(job, r, rbuf, r.h0, pow2, streamed(job, r));
    } else {
      codes_of(rbuf, cbuf, r.h0, r.h1, f);
      write_codes(job, r, cbuf, r.h0);
    }
  }
  return bad;
}

template <int MODE>
int64_t run_rows(const Job& job, int64_t row0, int64_t row1) {
  const int64_t bad = job.blocks.size > 0 ? block_rows<MODE>(job, row0, row1)
                      : job.dtype == F32  ? float32_rows<MODE>(job, row0, row1)
                                          : half_rows<MODE>(job, row0, row1);
#ifdef __AVX__
  if (job.stream) _mm_sfence();  // the streamed stores are seen before the call returns
#endif
  return bad;
}

using RowsFn = int64_t (*)(const Job&, int64_t, int64_t);
constexpr RowsFn KERNELS[] = {
  run_rows<RNE>, run_rows<RNA>, run_rows<RTZ>, run_rows<RUP>, run_rows<RDN>, run_rows<RTO>,
  run_rows<SRFF>, run_rows<SRF>, run_rows<SRC>, run_rows<SRC_ODD>, run_rows<NEAR_ZERO>,
  run_rows<FRACTION>, run_rows<ENCODE>, run_rows<MAGIC_RNE>, run_rows<MAGIC_SRC>,
  run_rows<CLASSICAL_SR>, run_rows<ENCODE_MAGIC>,
};

// Outputs of at least this many bytes are written with non-temporal stores (stream_out).
constexpr int64_t STREAM_BYTES = int64_t(16) << 20;

// Fewer rows than this per thread cost more to start a thread for than they save.
constexpr int64_t MIN_ROWS_PER_THREAD = 64;

// The floating-point environment a call computes in, on each thread that runs part of it,
// restored after: subnormals kept, and rounding to nearest. torch.set_flush_denormal(True)
// sets FTZ and DAZ on a thread, and code_of scales values into float32's subnormals (a
// flushed one is code 0: int8's 1.0 was); the float-adder paths round as nearest does.
class CallEnv {
#if defined(__SSE2__)
  static constexpr unsigned FTZ = 0x8000, DAZ = 0x0040, ROUNDING = 0x6000;
  const unsigned saved_ = _mm_getcsr();

 public:
  CallEnv() {
    if (saved_ & (FTZ | DAZ | ROUNDING)) _mm_setcsr(saved_ & ~(FTZ | DAZ | ROUNDING));
  }
  ~CallEnv() {
    if (saved_ & (FTZ | DAZ | ROUNDING)) _mm_setcsr(saved_);
  }
#elif defined(__aarch64__)
  static constexpr uint64_t FZ = uint64_t(1) << 24, ROUNDING = uint64_t(3) << 22;
  uint64_t saved_;

 public:
  CallEnv() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    if (saved_ & (FZ | ROUNDING)) asm volatile("msr fpcr, %0" : : "r"(saved_ & ~(FZ | ROUNDING)));
  }
  ~CallEnv() {
    if (saved_ & (FZ | ROUNDING)) asm volatile("msr fpcr, %0" : : "r"(saved_));
  }
#endif
};

// Run a job's rows on `threads` OpenMP threads; returns the first position without a valid
// result, or -1.
int64_t run_on_threads(const Job& job, int mode, int threads) {
  const RowsFn kernel = KERNELS[mode];
  // offset + n may be the stream's end, 2^63: rounding up from it would overflow int64.
  const int64_t first = job.offset / LANES, end = first + (job.offset % LANES + job.n + LANES - 1) / LANES;
  const int64_t rows = end - first;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, rows / MIN_ROWS_PER_THREAD));
  if (workers == 1) return kernel(job, first, end);
  // OpenMP, not threads of our own: the process has loaded torch's libgomp, whose threads
  // are already there (and may still be spinning after torch's last parallel op).
  std::vector<int64_t> bad(workers, -1);
#pragma omp parallel for num_threads(workers) schedule(static, 1)
  for (int64_t w = 0; w < workers; ++w) {
    const CallEnv env;
    bad[w] = kernel(job, first + rows * w / workers, first + rows * (w + 1) / workers);
  }
  for (int64_t b : bad)
    if (b >= 0) return b;  // workers hold rows in order: the first one found is the first
  return -1;
}

// The bytes of out that `count` of a job's elements take (count even for packed codes).
int64_t out_bytes(const Job& job, int64_t count) {
  return job.output == VALUES         ? count * (job.dtype == F32 ? 4 : 2)
         : job.output == CODES_I16    ? count * 2
         : job.output == CODES_PACKED ? count / 2
                                      : count;
}

// Elements from .. from + n of a job's x as a job of their own, at stream elements offset ..
// (from even for packed codes, a multiple of the block size with blocks).
Job part(const Job& job, int64_t from, int64_t n, int64_t offset) {
  Job p = job;
  p.x = static_cast<const char*>(job.x) + from * (job.dtype == F32 ? 4 : 2);
  p.out = static_cast<char*>(job.out) + out_bytes(job, from);
  if (job.given != nullptr) p.given = job.given + from;
  if (job.blocks.scales != nullptr) p.blocks.scales = job.blocks.scales + from / job.blocks.size;
  p.n = n;
  p.offset = offset;
  return p;
}

// Run a job on `threads` threads.
int64_t run(const Job& job, int mode, int threads) {
  if (job.n <= 0) return -1;
  return run_on_threads(job, mode, threads);
}

// Run a job of `runs` runs of job.n / runs elements each, run r being x's elements from
// r * job.n / runs on and the stream's from job.offset + r * stride on: a sharded piece cut
// along a later dimension than the first (Shard(1)), each run a row of it (with blocks,
// whole blocks, each from a block's first element on). Each run is a job of its own; a
// thread takes consecutive runs, and its jobs share the streams' caches (short runs lie
// many to a row of blocks: cpu-small's Shard(1) write-back on 2 ranks, runs of 64, took 1.7
// ms drawing each row of words for every run, 0.9 sharing them). Returns as run does.
int64_t run_runs(const Job& job, int mode, int threads, int64_t runs, int64_t stride) {
  const int64_t n = job.n / runs;
  const int64_t rows = runs * ((n + LANES - 1) / LANES);
  const auto some = [&](int64_t r0, int64_t r1) -> int64_t {
    std::vector<Stream> streams;
    for (int64_t r = r0; r < r1; ++r) {
      Job one = part(job, r * n, n, job.offset + r * stride);
      one.streams = &streams;
      const int64_t bad = run(one, mode, 1);
      if (bad >= 0) return r * n + bad;
    }
    return -1;
  };
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>({int64_t(threads), runs, rows / MIN_ROWS_PER_THREAD}));
  if (workers == 1) return some(0, runs);
  std::vector<int64_t> bad(workers, -1);
#pragma omp parallel for num_threads(workers) schedule(static, 1)
  for (int64_t w = 0; w < workers; ++w) {
    const CallEnv env;
    bad[w] = some(runs * w / workers, runs * (w + 1) / workers);
  }
  for (int64_t b : bad)
    if (b >= 0) return b;
  return -1;
}

// Streaming pays where the output outgrows the caches.
bool streams(int dtype, int output, int64_t n) {
  return output == VALUES && dtype != F16 && n * (dtype == F32 ? 4 : 2) >= STREAM_BYTES;
}

// A code of decode's lookup: from a uint8 or a 16-bit pattern (C) or, PACKED, from nibble
// i % 2 of byte i / 2 (the even element's low).
template <typename C, bool PACKED>
inline uint32_t code_at(const C* codes, int64_t i) {
  return PACKED ? (uint32_t(codes[i >> 1]) >> ((i & 1) << 2)) & 15u : uint32_t(codes[i]);
}

// Values i0 .. i1 of decode's lookup; returns the codes' bits beyond mask, or-ed. A
// function of its own, its pointers restrict: inside the OpenMP region GCC had to assume
// that out might alias the table (float32 values from uint8 codes, L2, one thread: 0.55 ns
// an element, 0.45 so; packed codes a byte at a time, 0.81 -> 0.43).
template <typename C, typename V, bool PACKED>
uint32_t lookup_chunk(const C* __restrict codes, const V* __restrict table, V* __restrict out, int64_t i0,
                      int64_t i1, uint32_t mask) {
  uint32_t beyond = 0;
  if (PACKED) {  // a byte at a time: its two nibbles (i0 and i1 are even: whole bytes)
    for (int64_t j = i0 >> 1; j < i1 >> 1; ++j) {
      const uint32_t pair = codes[j];
      beyond |= (pair & 15u & ~mask) | ((pair >> 4) & ~mask);
      out[2 * j] = table[pair & 15u & mask];
      out[2 * j + 1] = table[(pair >> 4) & mask];
    }
    return beyond;
  }
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t code = codes[i];
    beyond |= code & ~mask;
    out[i] = table[code & mask];
  }
  return beyond;
}

// decode's lookup: value i is table[code i] (code_at), outputs of V (a float32's or a
// 16-bit float's bits). A code at or above 2^k reads entry code & (2^k - 1), in bounds,
// and is reported: returns the first such, or -1.
template <typename C, typename V, bool PACKED>
int64_t lookup(const C* codes, int64_t n, const V* table, int k, V* out, int threads) {
  const uint32_t mask = (1u << k) - 1;
  // Chunks of 2^16 values, each a plain loop, with its bad codes noted.
  constexpr int64_t CHUNK = int64_t(1) << 16;
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>(threads, chunks / 4)));
  int64_t first = n;
#pragma omp parallel for num_threads(workers) schedule(static) reduction(min : first)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * CHUNK, i1 = std::min(n, i0 + CHUNK);
    const uint32_t beyond = lookup_chunk<C, V, PACKED>(codes, table, out, i0, i1, mask);
    for (int64_t i = i0; beyond && i < i1; ++i) {
      if (code_at<C, PACKED>(codes, i) & ~mask) {
        first = std::min(first, i);
        break;
      }
    }
  }
  return first < n ? first : -1;
}

}  // namespace

extern "C" {

// One call of fewbit_round, as native.py's CALL packs it: one bytes object, where ctypes
// converts the arguments of a call one by one (eleven took 2.2 us on the 2-core VM, three
// times the kernel's time on 4096 float32 elements; the packed struct takes 0.4).
struct Call {
  const void* x;
  int64_t dtype;
  void* out;
  int64_t output, n, offset;
  const int32_t* params;
  int64_t mode;
  uint32_t keys[4];  // k0, k1 of the bits stream, then those of the selection stream
  const int32_t* given;  // random bits given per element (or null: drawn from keys)
  int64_t threads;
  int64_t block_size, rule;  // blocks (size 0: none)
  double tensor_scale;
  uint8_t* scales;
  int64_t runs, run_stride;  // runs of n / runs elements (run_runs); 1, 0: one range
};
static_assert(sizeof(Call) == 144, "native.py's CALL packs this layout");

// Round (mode 0 .. FRACTION) or encode (mode ENCODE) x[0 .. n) of dtype into out, the
// elements being offset .. offset + n of the random stream. With blocks (x[0 .. n) in
// blocks of block_size, which divides LANES; offset a multiple of it), each block is
// scaled by its rule first: values q * S in x's dtype into out, or element codes into out
// and the codes of the blocks' scales (E8M0 or E4M3) into scales. Returns the first
// position without a valid result, or -1. With runs > 1, x holds runs of n / runs
// elements each, run r being stream elements offset + r * run_stride ...
int64_t fewbit_round(const Call* c) {
  const CallEnv env;  // before Fmt's constants (int8's code scale is 2^-127)
  const int mode = int(c->mode), dtype = int(c->dtype), output = int(c->output);
  const Blocks blocks{int(c->block_size), Rule(c->rule), float(c->tensor_scale), c->scales,
                      mode == RUP || mode == RDN || mode == RTO};
  const Job job{c->x, Dtype(dtype), c->out, Output(output), c->n, c->offset, Fmt(c->params), c->keys, c->given,
                streams(dtype, output, c->n), blocks};
  const int threads = int(c->threads);
  return c->runs > 1 ? run_runs(job, mode, threads, c->runs, c->run_stride) : run(job, mode, threads);
}

// The largest finite magnitude in x[0 .. n) (0 if none), for NVFP4's per-tensor scale
// (block.kernel.tensor_scale_of): one read of x instead of torch's three temporaries.
// Returned as its float32 bits: the caller's conversion of a returned float (ctypes'
// float to double) reads a subnormal as 0 under torch.set_flush_denormal(True) (DAZ).
uint32_t fewbit_finite_amax(const void* x, int dtype, int64_t n, int threads) {
  // Magnitudes compare as their float32 bits, in int32 (below 2^31: AVX2 has no unsigned
  // compare); Inf and NaN count as 0. One loop per dtype, each of which vectorises (a
  // dtype test per element kept the loop scalar, slower than the quantisation it serves).
  const auto finite = [](int32_t bits) {
    const int32_t a = bits & 0x7FFFFFFF;
    return a < 0x7F800000 ? a : 0;
  };
  int32_t best = 0;
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>(threads, n >> 20)));
  if (dtype == F32) {
    const int32_t* v = static_cast<const int32_t*>(x);
#pragma omp parallel for num_threads(workers) reduction(max : best) schedule(static)
    for (int64_t i = 0; i < n; ++i) best = std::max(best, finite(v[i]));
  } else if (dtype == BF16) {
    const uint16_t* v = static_cast<const uint16_t*>(x);
#pragma omp parallel for num_threads(workers) reduction(max : best) schedule(static)
    for (int64_t i = 0; i < n; ++i) best = std::max(best, finite(int32_t(uint32_t(v[i]) << 16)));
  } else {  // float16 magnitudes compare as their bits too: the largest is widened once
    const uint16_t* v = static_cast<const uint16_t*>(x);
#pragma omp parallel for num_threads(workers) reduction(max : best) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int32_t a = v[i] & 0x7FFF;
      best = std::max(best, a < 0x7C00 ? a : 0);
    }
    return __builtin_bit_cast(uint32_t, float(__builtin_bit_cast(_Float16, uint16_t(best))));
  }
  return uint32_t(best);
}

// One call of fewbit_decode, as native.py's LOOKUP packs it (as Call, one bytes object).
struct Lookup {
  const void* codes;
  int64_t input, n;
  const void* table;
  int64_t k, width;
  void* out;
  int64_t threads;
};
static_assert(sizeof(Lookup) == 64, "native.py's LOOKUP packs this layout");

// fewbit.decode: values of n codes (input CODES_U8, CODES_I16 or CODES_PACKED) from a table
// of the 2^k values of the format as output bits of `width` bytes (4: float32; 2: bfloat16
// or float16). Returns the first position whose code is not below 2^k, or -1.
int64_t fewbit_decode(const Lookup* c) {
  const void* codes = c->codes;
  const int input = int(c->input), k = int(c->k), threads = int(c->threads);
  const int64_t n = c->n;
  void* out = c->out;
  const void* table = c->table;
  const auto run = [&](auto value) {
    using V = decltype(value);
    const V* t = static_cast<const V*>(table);
    V* o = static_cast<V*>(out);
    if (input == CODES_I16) return lookup<uint16_t, V, false>(static_cast<const uint16_t*>(codes), n, t, k, o, threads);
    const uint8_t* c = static_cast<const uint8_t*>(codes);
    return input == CODES_PACKED ? lookup<uint8_t, V, true>(c, n, t, k, o, threads)
                                 : lookup<uint8_t, V, false>(c, n, t, k, o, threads);
  };
  return c->width == 4 ? run(uint32_t{}) : run(uint16_t{});
}

}  // extern "C"
