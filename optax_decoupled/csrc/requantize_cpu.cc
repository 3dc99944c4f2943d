// The 8-bit moment update on CPU as one multi-threaded XLA FFI kernel.
//
// For each block of B elements: dequantize the stored moments (code -> map value x absmax),
// apply the exponential moving averages of the gradient (and a running max), take the new
// block absmax and encode the new values to the nearest map entry (Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization", ICLR 2022). Each block is read once and written
// once; blocks are spread over XLA's intra-op thread pool. The decode has hand-written
// AVX-512 versions (VBMI byte permutes, AVX-512F register permutes) and the encoder two
// (VBMI and VBMI2 byte permutes of a smaller table, EncodeBlockVbmi; an explicit gather,
// EncodeBlockAvx512), picked at run time on CPUs that have them; everything else is
// portable C++ that the compiler vectorizes (target clones for AVX-512, AVX2 and baseline
// x86-64). With out_mode it also computes the transform's output, Adam's or AMSGrad's from
// each block's new float32 moments before they are quantized, Lion's from its old momentum
// (AdamOutBlock, LionOutBlock; inside the moments' passes on the VBMI, AVX-512F and AVX2
// paths, AdamPart), and writes it to its own result, which the caller aliases with the
// gradient or not. A second handler, OdEmaBf16 (at the end), does the same moving averages
// on moments stored in bfloat16, with the same optional output.
//
// With the attribute n_after = 1 both take one more operand after the moments, which they
// never read: the caller passes a result of the previous kernel call of the same update, so
// that XLA runs the calls of a tree's leaves one after another, each followed by what reads
// its results, instead of all calls first (its CPU scheduler's default order), which keeps
// every call's temporaries alive at once (docs/memory_log.md, eighteenth session).
//
// The Python side (optax_decoupled/cpu_kernel.py) is the only caller. It passes the maps and
// the encoder tables of optax_decoupled/quantization.py; this file adds no numerics of its
// own: float32 arithmetic in the order jnp writes it, each multiply and add rounded.
//
// Encoding y = x / absmax (clipped to the map's range) uses the lookup table of
// quantization.quantize_normalized, packed: the top bits of |y| as a float32 (exponent and
// leading mantissa bits) index an entry holding the code below the one decision point
// (midpoint between neighbouring map values) that the entry's interval may contain and that
// point's low float bits; one comparison of |y|'s low bits with them picks the code. So the
// codes are exactly those of the XLA path (nearest map value, ties toward the smaller
// magnitude); tests/test_cpu_kernel.py checks this on every float32 within 4096 ulps of
// every decision point.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define OD_X86_AVX512 1
#endif

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#pragma GCC diagnostic ignored "-Wattributes"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

namespace ffi = xla::ffi;

namespace {

// Target clones: one copy of each loop per instruction set, picked when the library loads.
// Clang (14) does not combine them with noinline, and its resolver chooses an "arch=" clone
// by the CPU model, not by features: on the Zen 5 here it ran the baseline copy, and the
// kernel was 3x slower. Clang gets clones by feature instead (as fast as GCC's, measured).
#if defined(__x86_64__) && defined(__clang__)
#define OD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__)
#define OD_CLONES __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OD_CLONES __attribute__((noinline))
#endif

// Layout of an encoder table (int32), written by cpu_kernel.encoder_table:
// [shift, first, n, signed, 0, 0, 0, 0], then n entries for y >= 0 and n for y < 0, each
// (low bits of the decision point << 8) | code below it, with 2^shift as the low bits when
// the entry's interval has no decision point. Entry i covers the float bits of |y| in
// [(first + i) << shift, (first + i + 1) << shift); the last one everything above.
constexpr int kHeader = 8;

struct ByteTable;  // the VBMI encoder's table (x86-64 only, below)

struct Encoder {
  const float* qmap;      // 256 map values, by code
  const int32_t* entries;  // 2 n packed entries
  int32_t shift;
  int32_t first;
  int32_t n;
  float lo;  // -1 (signed map) or 0 (unsigned)
};

inline uint32_t BitsOf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float FloatOf(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The transform's output, computed from the block's new float32 moments as the transform
// computes it in XLA (out_mode, below): Adam's
//   u = n / (sqrt(d + eps_root) + eps),  n = mu [* 1/bc1],  d = den [* 1/bc2]
// with den the new nu (Adam) or nu_max (AMSGrad), and the bias corrections applied as
// multiplications by their float32 reciprocals, as XLA:CPU compiles a division by a scalar
// (measured: docs/memory_log.md); sqrt and the last division are IEEE, as XLA's. In two parts,
// each rounded as the whole is: the denominator sqrt(d + eps_root) + eps from den, then the
// quotient from mu (the VBMI, AVX-512F and AVX2 paths compute them in different passes:
// AdamPart).
struct AdamCoefficients {
  int scale_num;
  float inv_bc1;
  int scale_den;
  float inv_bc2;
  float eps;
  float eps_root;
};

inline float AdamDenominator(const AdamCoefficients& a, float den) {
  const float d = a.scale_den ? den * a.inv_bc2 : den;
  return std::sqrt(d + a.eps_root) + a.eps;
}

inline float AdamQuotient(const AdamCoefficients& a, float mu, float denominator) {
  const float n = a.scale_num ? mu * a.inv_bc1 : mu;
  return n / denominator;
}

// jnp.sign of Lion's interpolation: +-1, a zero keeps its sign, NaN stays NaN.
inline float SignOf(float t) { return t > 0.0f ? 1.0f : (t < 0.0f ? -1.0f : t); }

// Lion's u = sign(c_g * g + c_mu * mu_old) from the old codes (before they are replaced).
// `out` may be `g` itself.
OD_CLONES void LionOutBlock(const float* g, const uint8_t* __restrict codes,
                            const float* __restrict qmap, float absmax, float c_g, float c_mu,
                            int valid, float* out) {
  for (int i = 0; i < valid; ++i) {
    const float m = qmap[codes[i]] * absmax;
    const float t1 = c_g * g[i];
    const float t2 = c_mu * m;
    out[i] = SignOf(t1 + t2);
  }
}

// The transform's output in the fused passes: Adam's in two of them (StoresDenominator,
// StoresQuotient and their 8-element versions, below), Lion's sign in mu's, its one moment's,
// from the old moment the pass decodes (kLionSign: StoresSign, StoresSign8), where
// LionOutBlock decoded the old codes again in a pass of its own.
struct AdamPart {
  enum Role { kNone, kDenominator, kQuotient, kLionSign } role;
  AdamCoefficients a;
  float* denominator;  // the block's, written by kDenominator and read by kQuotient
  float* out;          // the block's output (kQuotient, kLionSign), possibly g's own buffer
  const float* g = nullptr;     // the block's gradient (kLionSign)
  float c_g = 0.0f, c_mu = 0.0f;  // Lion's interpolation, c_g * g + c_mu * mu_old
};

// `part`'s role for elements [begin, valid) of the block (a pass's tail, after the portable
// function computed its moment values `values`): Adam's parts from those values, Lion's sign
// from the old codes.
inline void PartTail(const AdamPart& part, const float* values, const uint8_t* codes,
                     const float* qmap, float absmax, int begin, int valid) {
  if (part.role == AdamPart::kLionSign) {
    if (begin < valid) {
      LionOutBlock(part.g + begin, codes + begin, qmap, absmax, part.c_g, part.c_mu,
                   valid - begin, part.out + begin);
    }
    return;
  }
  for (int i = begin; i < valid; ++i) {
    if (part.role == AdamPart::kDenominator) {
      part.denominator[i] = AdamDenominator(part.a, values[i]);
    } else if (part.role == AdamPart::kQuotient) {
      part.out[i] = AdamQuotient(part.a, values[i], part.denominator[i]);
    }
  }
}

// out[i] = c_in * g[i]^power + c_keep * (qmap[codes[i]] * absmax), as jnp computes
// `(1 - b) * g + b * m`; zero past `valid` (the padded tail of the last block).
OD_CLONES void EmaBlock(const float* __restrict g, const uint8_t* __restrict codes,
                        const float* __restrict qmap, float absmax, float c_in, float c_keep,
                        int power, int valid, int block, float* __restrict out) {
  if (power == 2) {
    for (int i = 0; i < valid; ++i) {
      const float s = g[i] * g[i];
      const float m = qmap[codes[i]] * absmax;
      const float t1 = c_in * s;
      const float t2 = c_keep * m;
      out[i] = t1 + t2;
    }
  } else {
    for (int i = 0; i < valid; ++i) {
      const float m = qmap[codes[i]] * absmax;
      const float t1 = c_in * g[i];
      const float t2 = c_keep * m;
      out[i] = t1 + t2;
    }
  }
  for (int i = valid; i < block; ++i) out[i] = 0.0f;
}

// out[i] = max(qmap[codes[i]] * absmax, seen[i] [/ divisor]), NaN-propagating like
// jnp.maximum; zero past `valid`.
OD_CLONES void MaxBlock(const float* __restrict seen, const uint8_t* __restrict codes,
                        const float* __restrict qmap, float absmax, int divide, float divisor,
                        int valid, int block, float* __restrict out) {
  if (divide) {
    for (int i = 0; i < valid; ++i) {
      const float old = qmap[codes[i]] * absmax;
      const float s = seen[i] / divisor;
      out[i] = (old > s || old != old) ? old : s;
    }
  } else {
    for (int i = 0; i < valid; ++i) {
      const float old = qmap[codes[i]] * absmax;
      out[i] = (old > seen[i] || old != old) ? old : seen[i];
    }
  }
  for (int i = valid; i < block; ++i) out[i] = 0.0f;
}

// max |x| over the block as float32 bits (the integer order of |x|'s bits is its float
// order; a NaN's bits exceed infinity's, so a NaN propagates as in jnp.max).
OD_CLONES uint32_t AbsMaxBits(const float* __restrict x, int block) {
  uint32_t m = 0;
  for (int i = 0; i < block; ++i) {
    const uint32_t u = BitsOf(x[i]) & 0x7fffffffu;
    m = u > m ? u : m;
  }
  return m;
}

#if defined(OD_X86_AVX512)
// The same two functions with the map lookup done by register permutes: the 256 map values
// sit in 16 AVX-512 registers, and qmap[code] for 16 codes is 8 two-register permutes (each
// picks by the code's low 5 bits) and 7 blends (by bits 5, 6 and 7), instead of 16 loads
// that GCC emits for the gather. The arithmetic is the portable loops', operation by
// operation, so the values are identical (tests/test_cpu_kernel.py runs both).
#define OD_AVX512 __attribute__((target("avx512f")))

struct MapRegisters {
  __m512 t[16];
};

OD_AVX512 inline MapRegisters LoadMap(const float* qmap) {
  MapRegisters m;
  for (int j = 0; j < 16; ++j) m.t[j] = _mm512_loadu_ps(qmap + 16 * j);
  return m;
}

// qmap[codes[i]] for the 16 codes at `codes`.
OD_AVX512 inline __m512 Decode16(const MapRegisters& m, const uint8_t* codes) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512i idx = _mm512_cvtepu8_epi32(bytes);
  __m512 r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(m.t[2 * j], idx, m.t[2 * j + 1]);
  const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
  for (int j = 0; j < 4; ++j) r[j] = _mm512_mask_blend_ps(b5, r[2 * j], r[2 * j + 1]);
  for (int j = 0; j < 2; ++j) r[j] = _mm512_mask_blend_ps(b6, r[2 * j], r[2 * j + 1]);
  return _mm512_mask_blend_ps(b7, r[0], r[1]);
}

OD_AVX512 void EmaBlockAvx512(const float* g, const uint8_t* codes, const float* qmap,
                              float absmax, float c_in, float c_keep, int power, int valid,
                              int block, float* out) {
  const MapRegisters m = LoadMap(qmap);
  const __m512 a = _mm512_set1_ps(absmax), cin = _mm512_set1_ps(c_in);
  const __m512 ckeep = _mm512_set1_ps(c_keep);
  const int full = valid - valid % 16;
  for (int i = 0; i < full; i += 16) {
    const __m512 old = _mm512_mul_ps(Decode16(m, codes + i), a);
    const __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 src = power == 2 ? _mm512_mul_ps(gi, gi) : gi;
    const __m512 t1 = _mm512_mul_ps(cin, src);
    const __m512 t2 = _mm512_mul_ps(ckeep, old);
    _mm512_storeu_ps(out + i, _mm512_add_ps(t1, t2));
  }
  if (full < block) {  // no tail, no call
    EmaBlock(g + full, codes + full, qmap, absmax, c_in, c_keep, power, valid - full,
             block - full, out + full);
  }
}

OD_AVX512 void MaxBlockAvx512(const float* seen, const uint8_t* codes, const float* qmap,
                              float absmax, int divide, float divisor, int valid, int block,
                              float* out) {
  const MapRegisters m = LoadMap(qmap);
  const __m512 a = _mm512_set1_ps(absmax), d = _mm512_set1_ps(divisor);
  const int full = valid - valid % 16;
  for (int i = 0; i < full; i += 16) {
    const __m512 old = _mm512_mul_ps(Decode16(m, codes + i), a);
    const __m512 si = _mm512_loadu_ps(seen + i);
    const __m512 s = divide ? _mm512_div_ps(si, d) : si;
    const __mmask16 keep = _mm512_cmp_ps_mask(old, s, _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(old, old, _CMP_UNORD_Q);
    _mm512_storeu_ps(out + i, _mm512_mask_blend_ps(keep, s, old));
  }
  if (full < block) {
    MaxBlock(seen + full, codes + full, qmap, absmax, divide, divisor, valid - full,
             block - full, out + full);
  }
}

bool CpuHasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

// The decode again, with byte permutes (AVX-512 VBMI, e.g. Ice Lake and later, Zen 4 and
// later): the map's 256 values as four planes of bytes (byte j of every value), each plane
// in four registers. 64 codes are looked up per plane by two 128-entry byte permutes and a
// blend, and the four planes are interleaved into 32-bit values by unpacks: 21 instructions
// for 64 codes where the register permutes above take 72 (2.3x faster in a harness, in
// cache; the same bits). The values are the map's own, so the arithmetic after it is the
// same, operation by operation.
#define OD_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

struct MapPlanes {
  alignas(64) uint8_t b[4][256];
};

MapPlanes PlanesOf(const float* qmap) {
  MapPlanes p;
  for (int c = 0; c < 256; ++c) {
    const uint32_t u = BitsOf(qmap[c]);
    for (int j = 0; j < 4; ++j) p.b[j][c] = static_cast<uint8_t>(u >> (8 * j));
  }
  return p;
}

// The unpacks interleave within 128-bit lanes, so the codes are first put in the order that
// makes them come out in element order: position 16 L + 4 k + j holds code 16 k + 4 L + j.
struct DecodeOrder {
  alignas(64) uint8_t b[64];
  DecodeOrder() {
    for (int L = 0; L < 4; ++L)
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 4; ++j) {
          b[16 * L + 4 * k + j] = static_cast<uint8_t>(16 * k + 4 * L + j);
        }
  }
};
const DecodeOrder kDecodeOrder;

struct PlaneRegisters {
  __m512i p[4][4];
};

OD_AVX512_VBMI inline PlaneRegisters LoadPlanes(const MapPlanes& planes) {
  PlaneRegisters r;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 4; ++h) r.p[j][h] = _mm512_load_si512(planes.b[j] + 64 * h);
  return r;
}

// Byte c of a 256-byte table held in four registers, for the 64 indices c of `index`
// (`high`: their top bits, _mm512_movepi8_mask(index)): two byte permutes and a blend.
OD_AVX512_VBMI inline __m512i Lookup256(const __m512i (&r)[4], __m512i index, __mmask64 high) {
  const __m512i lo = _mm512_permutex2var_epi8(r[0], index, r[1]);
  const __m512i hi = _mm512_permutex2var_epi8(r[2], index, r[3]);
  return _mm512_mask_blend_epi8(high, lo, hi);
}

// qmap[c] for the 64 codes c in `codes`, as four vectors of 16 in element order.
OD_AVX512_VBMI inline void Decode64(const PlaneRegisters& r, __m512i codes, __m512 (&out)[4]) {
  const __m512i order = _mm512_load_si512(kDecodeOrder.b);
  const __m512i c = _mm512_permutexvar_epi8(order, codes);
  const __mmask64 high = _mm512_movepi8_mask(c);
  __m512i p[4];
  for (int j = 0; j < 4; ++j) p[j] = Lookup256(r.p[j], c, high);
  const __m512i w01l = _mm512_unpacklo_epi8(p[0], p[1]);
  const __m512i w01h = _mm512_unpackhi_epi8(p[0], p[1]);
  const __m512i w23l = _mm512_unpacklo_epi8(p[2], p[3]);
  const __m512i w23h = _mm512_unpackhi_epi8(p[2], p[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}

// These two also do what the other paths do in separate passes over the block: they copy
// the old codes to `old_codes` (when not null) from the registers they decode, and return
// the block's max |out| as AbsMaxBits would (the unsigned integer max of |x|'s bits).
OD_AVX512 inline __m512i AbsBits(__m512 x) {
  return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
}

// The VBMI pass both share: over the 64-code groups of [0, full) decode the codes (copying
// them to `old_codes` when it is not null), store value(old, i) for the 16 elements at i
// (old: the decoded moment times absmax) to `out`, and return their max |value| bits.
template <typename Value>
OD_AVX512_VBMI inline uint32_t VbmiPass(const uint8_t* codes, const MapPlanes& planes,
                                        float absmax, int full, float* out, uint8_t* old_codes,
                                        const Value& value) {
  const PlaneRegisters r = LoadPlanes(planes);
  const __m512 a = _mm512_set1_ps(absmax);
  __m512i top = _mm512_setzero_si512();
  for (int i = 0; i < full; i += 64) {
    const __m512i c = _mm512_loadu_si512(codes + i);
    if (old_codes != nullptr) _mm512_storeu_si512(old_codes + i, c);
    __m512 m[4];
    Decode64(r, c, m);
    for (int q = 0; q < 4; ++q) {
      const __m512 v = value(_mm512_mul_ps(m[q], a), i + 16 * q);
      _mm512_storeu_ps(out + i + 16 * q, v);
      top = _mm512_max_epu32(top, AbsBits(v));
    }
  }
  return _mm512_reduce_max_epu32(top);
}

// The rest of the block after a VBMI, AVX-512F or AVX2 pass (`valid` not a multiple of 64,
// 16 or 32, and the padding), once the caller has computed its values: its codes through
// memcpy, its max |value| bits through AbsMaxBits.
inline uint32_t PassTail(const uint8_t* codes, int full, int block, const float* out,
                         uint8_t* old_codes, uint32_t top) {
  if (old_codes != nullptr) {
    std::memcpy(old_codes + full, codes + full, static_cast<size_t>(block - full));
  }
  return std::max(top, AbsMaxBits(out + full, block - full));
}

struct EmaValue {  // c_in * g^power + c_keep * old, as EmaBlock
  const float* g;
  __m512 cin, ckeep;
  int power;
  OD_AVX512 __m512 operator()(__m512 old, int i) const {
    const __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 src = power == 2 ? _mm512_mul_ps(gi, gi) : gi;
    const __m512 t1 = _mm512_mul_ps(cin, src);
    const __m512 t2 = _mm512_mul_ps(ckeep, old);
    return _mm512_add_ps(t1, t2);
  }
};

struct MaxValue {  // max(old, seen [/ divisor]), NaN-propagating, as MaxBlock
  const float* seen;
  __m512 d;
  int divide;
  OD_AVX512 __m512 operator()(__m512 old, int i) const {
    const __m512 si = _mm512_loadu_ps(seen + i);
    const __m512 s = divide ? _mm512_div_ps(si, d) : si;
    const __mmask16 keep = _mm512_cmp_ps_mask(old, s, _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(old, old, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(keep, s, old);
  }
};

// Adam's output (out_mode 1) spread over the VBMI passes instead of a pass of its own: the
// pass of its denominator's moment (nu, or AMSGrad's nu_max) stores sqrt(d + eps_root) + eps
// for each element (kDenominator), and mu's pass, run after it, stores the output, mu's
// value over that (kQuotient). The square root and the division (about 10 and 6 cycles per
// 16 elements in a Zen 4's divider, measured) then run beside the passes' byte permutes, where
// the separate pass (AdamOutBlock) waited on the divider alone: the per-block work took 9-10%
// less time (benchmarks/kernel_pipeline.py; docs/memory_log.md, nineteenth session). The AVX2
// path does the same (StoresDenominator8, below). The values are AdamOutValue's, operation by
// operation.
template <typename Value>
struct StoresDenominator {  // value(old, i) (the moment), also storing its denominator
  const Value& value;
  const AdamPart& part;
  OD_AVX512 __m512 operator()(__m512 old, int i) const {
    const __m512 v = value(old, i);
    const AdamCoefficients& a = part.a;
    const __m512 d = a.scale_den ? _mm512_mul_ps(v, _mm512_set1_ps(a.inv_bc2)) : v;
    const __m512 r = _mm512_sqrt_ps(_mm512_add_ps(d, _mm512_set1_ps(a.eps_root)));
    _mm512_storeu_ps(part.denominator + i, _mm512_add_ps(r, _mm512_set1_ps(a.eps)));
    return v;
  }
};

template <typename Value>
struct StoresQuotient {  // value(old, i) (mu), also storing the output. After value's read of
  const Value& value;    // g at i, so that the output may be written in g's place.
  const AdamPart& part;
  OD_AVX512 __m512 operator()(__m512 old, int i) const {
    const __m512 m = value(old, i);
    const AdamCoefficients& a = part.a;
    const __m512 n = a.scale_num ? _mm512_mul_ps(m, _mm512_set1_ps(a.inv_bc1)) : m;
    _mm512_storeu_ps(part.out + i, _mm512_div_ps(n, _mm512_loadu_ps(part.denominator + i)));
    return m;
  }
};

template <typename Value>
struct StoresSign {  // value(old, i) (mu's new value), also storing Lion's output from old
  const Value& value;  // (LionOutBlock's arithmetic: c_g * g + c_mu * old, then its sign);
  const AdamPart& part;  // g at i read before the output may be written in its place.
  OD_AVX512 __m512 operator()(__m512 old, int i) const {
    const __m512 gi = _mm512_loadu_ps(part.g + i);
    const __m512 v = value(old, i);
    const __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(part.c_g), gi);
    const __m512 t2 = _mm512_mul_ps(_mm512_set1_ps(part.c_mu), old);
    const __m512 t = _mm512_add_ps(t1, t2);
    const __m512 zero = _mm512_setzero_ps();
    __m512 sign = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, zero, _CMP_GT_OQ), t,
                                       _mm512_set1_ps(1.0f));
    sign = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, zero, _CMP_LT_OQ), sign,
                                _mm512_set1_ps(-1.0f));
    _mm512_storeu_ps(part.out + i, sign);
    return v;
  }
};

// VbmiPass with `part`'s role.
template <typename Value>
OD_AVX512_VBMI inline uint32_t VbmiPassWith(const AdamPart& part, const uint8_t* codes,
                                            const MapPlanes& planes, float absmax, int full,
                                            float* out, uint8_t* old_codes, const Value& value) {
  switch (part.role) {
    case AdamPart::kDenominator:
      return VbmiPass(codes, planes, absmax, full, out, old_codes,
                      StoresDenominator<Value>{value, part});
    case AdamPart::kQuotient:
      return VbmiPass(codes, planes, absmax, full, out, old_codes,
                      StoresQuotient<Value>{value, part});
    case AdamPart::kLionSign:
      return VbmiPass(codes, planes, absmax, full, out, old_codes, StoresSign<Value>{value, part});
    default:
      return VbmiPass(codes, planes, absmax, full, out, old_codes, value);
  }
}

OD_AVX512_VBMI uint32_t EmaBlockVbmi(const float* g, const uint8_t* codes, const float* qmap,
                                     const MapPlanes& planes, float absmax, float c_in,
                                     float c_keep, int power, int valid, int block, float* out,
                                     uint8_t* old_codes, const AdamPart& part) {
  const int full = valid - valid % 64;
  const EmaValue value{g, _mm512_set1_ps(c_in), _mm512_set1_ps(c_keep), power};
  const uint32_t top = VbmiPassWith(part, codes, planes, absmax, full, out, old_codes, value);
  // A block of whole 64s has no tail: no calls. (These empty calls, each with its setup, made
  // the 8-bit update step 10-20% slower at 1e7 on a Zen 4; docs/memory.md.)
  if (full == block) return top;
  EmaBlockAvx512(g + full, codes + full, qmap, absmax, c_in, c_keep, power, valid - full,
                 block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

OD_AVX512_VBMI uint32_t MaxBlockVbmi(const float* seen, const uint8_t* codes, const float* qmap,
                                     const MapPlanes& planes, float absmax, int divide,
                                     float divisor, int valid, int block, float* out,
                                     uint8_t* old_codes, const AdamPart& part) {
  const int full = valid - valid % 64;
  const MaxValue value{seen, _mm512_set1_ps(divisor), divide};
  const uint32_t top = VbmiPassWith(part, codes, planes, absmax, full, out, old_codes, value);
  if (full == block) return top;  // no tail, no calls
  MaxBlockAvx512(seen + full, codes + full, qmap, absmax, divide, divisor, valid - full,
                 block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

// The same passes on CPUs with AVX-512F but not VBMI (e.g. Intel Xeons of the Skylake and
// Cascade Lake generations), with EmaBlockAvx512's register-permute decode of 16 codes at a
// time: the copy of the old codes, the block's max |value| bits and Adam's output parts
// (AdamPart) in the moments' passes, where this path made a pass of its own for each
// (AbsMaxBits, memcpy, AdamOutBlock) before. The values are EmaBlockAvx512's and
// MaxBlockAvx512's, operation by operation (the value functors above are theirs).
template <typename Value>
OD_AVX512 inline uint32_t Avx512Pass(const uint8_t* codes, const MapRegisters& m, float absmax,
                                     int full, float* out, uint8_t* old_codes,
                                     const Value& value) {
  const __m512 a = _mm512_set1_ps(absmax);
  __m512i top = _mm512_setzero_si512();
  for (int i = 0; i < full; i += 16) {
    if (old_codes != nullptr) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(old_codes + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    }
    const __m512 v = value(_mm512_mul_ps(Decode16(m, codes + i), a), i);
    _mm512_storeu_ps(out + i, v);
    top = _mm512_max_epu32(top, AbsBits(v));
  }
  return _mm512_reduce_max_epu32(top);
}

template <typename Value>
OD_AVX512 inline uint32_t Avx512PassWith(const AdamPart& part, const uint8_t* codes,
                                         const MapRegisters& m, float absmax, int full,
                                         float* out, uint8_t* old_codes, const Value& value) {
  switch (part.role) {
    case AdamPart::kDenominator:
      return Avx512Pass(codes, m, absmax, full, out, old_codes,
                        StoresDenominator<Value>{value, part});
    case AdamPart::kQuotient:
      return Avx512Pass(codes, m, absmax, full, out, old_codes,
                        StoresQuotient<Value>{value, part});
    case AdamPart::kLionSign:
      return Avx512Pass(codes, m, absmax, full, out, old_codes, StoresSign<Value>{value, part});
    default:
      return Avx512Pass(codes, m, absmax, full, out, old_codes, value);
  }
}

OD_AVX512 uint32_t EmaBlockAvx512Pass(const float* g, const uint8_t* codes, const float* qmap,
                                      float absmax, float c_in, float c_keep, int power,
                                      int valid, int block, float* out, uint8_t* old_codes,
                                      const AdamPart& part) {
  const int full = valid - valid % 16;
  const MapRegisters m = LoadMap(qmap);
  const EmaValue value{g, _mm512_set1_ps(c_in), _mm512_set1_ps(c_keep), power};
  const uint32_t top = Avx512PassWith(part, codes, m, absmax, full, out, old_codes, value);
  if (full == block) return top;  // no tail, no calls
  EmaBlock(g + full, codes + full, qmap, absmax, c_in, c_keep, power, valid - full,
           block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

OD_AVX512 uint32_t MaxBlockAvx512Pass(const float* seen, const uint8_t* codes,
                                      const float* qmap, float absmax, int divide,
                                      float divisor, int valid, int block, float* out,
                                      uint8_t* old_codes, const AdamPart& part) {
  const int full = valid - valid % 16;
  const MapRegisters m = LoadMap(qmap);
  const MaxValue value{seen, _mm512_set1_ps(divisor), divide};
  const uint32_t top = Avx512PassWith(part, codes, m, absmax, full, out, old_codes, value);
  if (full == block) return top;  // no tail, no calls
  MaxBlock(seen + full, codes + full, qmap, absmax, divide, divisor, valid - full,
           block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

// VBMI2 too, for the encoder's funnel shifts: every CPU with VBMI has it but Cannon Lake.
bool CpuHasAvx512Vbmi() {
  static const bool has = [] {
    __builtin_cpu_init();
    return CpuHasAvx512() && __builtin_cpu_supports("avx512bw") != 0 &&
           __builtin_cpu_supports("avx512vbmi") != 0 &&
           __builtin_cpu_supports("avx512vbmi2") != 0;
  }();
  return has;
}
#else
bool CpuHasAvx512() { return false; }
bool CpuHasAvx512Vbmi() { return false; }
#endif

// Codes of one block: y = clip((x * factor) / scale, lo, 1) per element (NaN stays NaN,
// as in jnp.clip), then the packed table lookup (see the top of the file). Written with
// selects and arithmetic instead of branches so that it vectorizes.
OD_CLONES void EncodeBlock(const float* __restrict x, float factor, float scale, float lo,
                           const int32_t* __restrict entries, int32_t shift, int32_t first,
                           int32_t n, int block, uint8_t* __restrict codes) {
  const uint32_t low_mask = (1u << shift) - 1u;
  for (int i = 0; i < block; ++i) {
    const float v = (x[i] * factor) / scale;
    float y = v > lo ? v : lo;
    y = y < 1.0f ? y : 1.0f;
    y = v != v ? v : y;
    const uint32_t u = BitsOf(y);
    const int32_t neg = static_cast<int32_t>(u >> 31);
    const uint32_t mag = u & 0x7fffffffu;
    int32_t index = static_cast<int32_t>(mag >> shift) - first;
    index = index > 0 ? index : 0;
    index = index < n - 1 ? index : n - 1;
    const int32_t entry = entries[index + neg * n];
    const int32_t above = static_cast<int32_t>(static_cast<int32_t>(mag & low_mask) > (entry >> 8));
    // Above the decision point the code moves one step away from zero.
    codes[i] = static_cast<uint8_t>((entry & 0xff) + above - 2 * (above & neg));
  }
}

using EncodeFn = void (*)(const float*, float, float, float, const int32_t*, int32_t, int32_t,
                         int32_t, int, uint8_t*);

#if defined(OD_X86_AVX512)
// EncodeBlock with the table lookup written as an AVX-512 gather (16 lookups per
// instruction), the rest as it is, operation by operation (the same codes; the tests run
// both). The compiler decides by its tuning whether to gather: GCC 12 with generic tuning
// (what -mtune=native gives on CPUs it does not know, e.g. an Intel Xeon of family 6, model
// 207) emits 16 scalar loads with inserts and extracts per 16 elements instead: 1.19-1.38 ns
// per element on that Xeon against 0.43-0.59 for this (one core, in cache;
// benchmarks/encoder_speed.py, docs/memory.md).
OD_AVX512 void EncodeBlockAvx512(const float* x, float factor, float scale, float lo,
                                 const int32_t* entries, int32_t shift, int32_t first,
                                 int32_t n, int block, uint8_t* codes) {
  const __m512 f = _mm512_set1_ps(factor), s = _mm512_set1_ps(scale);
  const __m512 vlo = _mm512_set1_ps(lo), one = _mm512_set1_ps(1.0f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i low_mask = _mm512_set1_epi32(static_cast<int32_t>((1u << shift) - 1u));
  const __m512i vfirst = _mm512_set1_epi32(first), vlast = _mm512_set1_epi32(n - 1);
  const __m512i vn = _mm512_set1_epi32(n), zero = _mm512_setzero_si512();
  const __m512i step = _mm512_set1_epi32(1), minus_step = _mm512_set1_epi32(-1);
  const __m128i sh = _mm_cvtsi32_si128(shift);
  const int full = block - block % 16;
  for (int i = 0; i < full; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), f), s);
    // max_ps(a, b) is a > b ? a : b and min_ps(a, b) a < b ? a : b, so a NaN v comes
    // through both, as in EncodeBlock. The one other difference: v = -0.0 stays -0.0 where
    // EncodeBlock makes it +0.0 for the unsigned map (lo = 0); both get code 0 there (the
    // unsigned map's negative side holds only zero, and +0.0 is below its first decision
    // point).
    const __m512 y = _mm512_min_ps(one, _mm512_max_ps(vlo, v));
    const __m512i u = _mm512_castps_si512(y);
    const __mmask16 neg = _mm512_cmplt_epi32_mask(u, zero);  // the sign bit
    const __m512i mag = _mm512_and_si512(u, abs_mask);
    __m512i index = _mm512_sub_epi32(_mm512_srl_epi32(mag, sh), vfirst);
    index = _mm512_min_epi32(_mm512_max_epi32(index, zero), vlast);
    index = _mm512_mask_add_epi32(index, neg, index, vn);
    const __m512i entry = _mm512_i32gather_epi32(index, entries, 4);
    const __mmask16 above =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(mag, low_mask), _mm512_srai_epi32(entry, 8));
    // Above the decision point the code moves one step away from zero. The code is the
    // entry's low byte: the truncation to bytes gives (code +- 1) mod 256, as EncodeBlock's
    // cast does.
    const __m512i away = _mm512_mask_blend_epi32(neg, step, minus_step);
    const __m512i code = _mm512_mask_add_epi32(entry, above, entry, away);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
  if (full < block) {
    EncodeBlock(x + full, factor, scale, lo, entries, shift, first, n, block - full,
                codes + full);
  }
}

// The encoder again without a gather (AVX-512 VBMI and VBMI2): on CPUs whose gather is slow
// (Zen 4's 16-element gather took 0.38 of the AVX-512 encoder's 0.62 ns per element, one
// core, in cache) the table lookup is done by byte permutes, as the VBMI decode does it. The
// packed table above has thousands of entries; this one has at most 256 (ByteTable): the
// exponent of |y| picks its octave (where the octave's entries start and how many mantissa
// bits index them: as few as leave at most two decision points in each entry's interval, at
// most 7), and each entry holds five bytes, each in a plane of registers: the code at the
// interval's start and the 16 bits of each of its (at most two) decision points that follow
// the index bits. |y|'s own 16 bits there, compared with them as two bytes, give the code;
// where they equal a point's (|y| in the same 2^-16 of the interval as the point: 3 of
// 65,536 gradient-like values per map in benchmarks/encoder_speed), the 16 elements go
// through EncodeBlockAvx512 instead. The signed map's negative side is its positive side
// mirrored (code 254 - c, 0 at the far end), which BuildByteTable checks, so one table serves
// both. The codes are EncodeBlockAvx512's (tests/test_cpu_kernel.py, every float32 near every
// decision point); BuildByteTable refuses a table it cannot represent, and the caller then
// keeps EncodeBlockAvx512.
#define OD_AVX512_VBMI_ENC \
  __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2,avx512vl")))

struct ByteTable {
  alignas(64) uint8_t plane[5][256];  // code, point 1 high/low byte, point 2 high/low byte
  // By exponent mod 32, each octave's first entry, and how far its mantissa bits are shifted
  // right to give its index bits and key (7 - the index bits).
  alignas(64) uint16_t octave_first[32];
  alignas(64) uint16_t octave_shift[32];
  uint16_t below;  // every |y| of a smaller exponent reads this octave's (one entry: 0's code)
  int entries;
  bool ok;
  bool mirrored;  // signed: the negative side is the positive side's mirror image
};

// Encoder e's code for |y| = mag on one side (0: y >= 0, 1: y < 0), as EncodeBlock.
inline int FineCode(const Encoder& e, uint32_t mag, int side) {
  int32_t index = static_cast<int32_t>(mag >> e.shift) - e.first;
  index = std::min(std::max(index, 0), e.n - 1);
  const int32_t entry = e.entries[index + side * e.n];
  const uint32_t low_mask = (1u << e.shift) - 1u;
  const int above = static_cast<int32_t>(mag & low_mask) > (entry >> 8);
  return side ? ((entry & 0xff) - above) & 0xff : ((entry & 0xff) + above) & 0xff;
}

// ByteTable t's code for |y| = mag <= 1 (positive side), as EncodeBlockVbmi computes it, or
// -1 where its keys are equal and EncodeBlockAvx512 decides.
inline int ByteTableCode(const ByteTable& t, uint32_t mag) {
  const uint32_t octave = std::max<uint32_t>(mag >> 23, t.below) & 31;
  const uint32_t bits = (mag & 0x7fffffu) >> t.octave_shift[octave];
  const int index = t.octave_first[octave] + static_cast<int>(bits >> 16);
  const uint32_t key = bits & 0xffffu;
  int code = t.plane[0][index];
  for (int k = 0; k < 2; ++k) {
    const uint32_t point = (t.plane[1 + 2 * k][index] << 8) | t.plane[2 + 2 * k][index];
    if (key == point) return -1;
    code += key > point;
  }
  return code;
}

ByteTable BuildByteTable(const Encoder& e) {
  ByteTable t{};
  t.ok = false;
  const uint32_t never = 1u << e.shift;
  const uint32_t one = 0x3f800000u;  // |y| <= 1
  // The decision points of the positive side, as float32 bits, in increasing order.
  std::vector<uint32_t> points;
  for (int32_t i = 0; i < e.n; ++i) {
    const uint32_t low = static_cast<uint32_t>(e.entries[i] >> 8);
    if (low < never) points.push_back((static_cast<uint32_t>(e.first + i) << e.shift) + low);
  }
  const uint32_t lowest = static_cast<uint32_t>(e.first) << e.shift;
  const int32_t e0 = static_cast<int32_t>(lowest >> 23);  // the first octave with entries
  if (e0 < 127 - 31 || e0 > 127) return t;
  if (static_cast<uint32_t>(e.entries[0] >> 8) < never) return t;  // a point below `first`
  if (e.lo < 0.0f && static_cast<uint32_t>(e.entries[e.n] >> 8) < never) return t;
  if ((static_cast<uint64_t>(e.first + e.n) << e.shift) <= one) return t;  // entries end below 1
  // Below octave e0 every |y| has 0's code (checked next): its octave, e0 - 1, whose slot no
  // other octave uses (e0..127 take at most 31 of the 32), gets one entry with that code and
  // no decision point (keys of 0xffff: never below |y|'s, equal to it in 1 of 65,536, where
  // EncodeBlockAvx512 decides).
  if (e0 - 1 < 127 - 31) return t;
  int next = 0;
  auto add_entry = [&](int code, const uint32_t* at, int count, int shift) {
    t.plane[0][next] = static_cast<uint8_t>(code);
    for (int k = 0; k < 2; ++k) {
      const uint32_t key = k < count ? ((at[k] & ((1u << shift) - 1u)) >> (shift - 16)) : 0xffffu;
      t.plane[1 + 2 * k][next] = static_cast<uint8_t>(key >> 8);
      t.plane[2 + 2 * k][next] = static_cast<uint8_t>(key);
    }
    ++next;
  };
  if (FineCode(e, static_cast<uint32_t>(e0) << 23, 0) != FineCode(e, 0, 0)) return t;
  t.below = static_cast<uint16_t>(e0 - 1);
  t.octave_first[t.below & 31] = static_cast<uint16_t>(next);
  t.octave_shift[t.below & 31] = 7;  // no index bits: the interval is the whole octave
  add_entry(FineCode(e, 0, 0), nullptr, 0, 23);
  size_t p = 0;
  for (int32_t ex = e0; ex <= 127; ++ex) {
    const uint32_t start = static_cast<uint32_t>(ex) << 23, end = start + (1u << 23);
    const size_t begin = p;
    while (p < points.size() && points[p] < end) ++p;
    int bits = 0;
    for (; bits <= 7; ++bits) {  // the fewest index bits with <= 2 points per interval
      int most = 0;
      for (size_t a = begin, b = begin; a < p; a = b) {
        while (b < p && (points[b] >> (23 - bits)) == (points[a] >> (23 - bits))) ++b;
        most = std::max(most, static_cast<int>(b - a));
      }
      if (most <= 2) break;
    }
    if (bits > 7 || next + (1 << bits) > 256) return t;
    const int shift = 23 - bits;
    t.octave_first[ex & 31] = static_cast<uint16_t>(next);
    t.octave_shift[ex & 31] = static_cast<uint16_t>(shift - 16);
    for (uint32_t s = 0; s < (1u << bits); ++s) {
      const uint32_t lo = start + (s << shift), hi = lo + (1u << shift);
      size_t a = begin;
      while (a < p && points[a] < lo) ++a;
      size_t b = a;
      while (b < p && points[b] < hi) ++b;
      const int count = static_cast<int>(b - a);
      // The code at the interval's start; checked below against the packed table everywhere.
      add_entry(FineCode(e, lo, 0), count ? &points[a] : nullptr, count, shift);
    }
    if (ex == 127) break;
  }
  t.entries = next;  // NaN's exponent (255) reads octave 127's entry: EncodeBlockAvx512 redoes it
  // Both are step functions of |y|: the packed table's steps lie at its entries' bounds and
  // decision points, this table's at its intervals' bounds and around each point, where |y|
  // has the point's key (there the gather decides, ByteTableCode -1). Equal at each of those
  // bounds and just below it, they are equal for every |y| in [0, 1].
  std::vector<uint32_t> at = {0u, one};
  for (int32_t i = 0; i <= e.n; ++i) at.push_back(static_cast<uint32_t>(e.first + i) << e.shift);
  for (uint32_t q : points) {
    const uint32_t key_bits = t.octave_shift[(q >> 23) & 31];
    const uint32_t first_with_key = q & ~((1u << key_bits) - 1u);
    at.push_back(q + 1);
    at.push_back(first_with_key);
    at.push_back(first_with_key + (1u << key_bits));
  }
  for (int32_t ex = e0; ex <= 127; ++ex) {
    const int shift = t.octave_shift[ex & 31] + 16;
    for (uint32_t s = 0; s < (1u << (23 - shift)); ++s) {
      at.push_back((static_cast<uint32_t>(ex) << 23) + (s << shift));
    }
  }
  for (uint32_t m : at) {
    for (uint32_t mag : {m, m - 1u}) {
      const int code = mag <= one ? ByteTableCode(t, mag) : -1;
      if (code != -1 && code != FineCode(e, mag, 0)) return t;
    }
  }
  // The negative side: the signed map's mirror image (code 254 - c, saturating at 0), or
  // for the unsigned map only -0.0 (whose code is +0.0's). Each side's code is a step
  // function of |y| within each packed entry, so comparing at every step of either side and
  // at each entry's ends covers every |y|.
  if (e.lo < 0.0f) {
    for (int32_t i = 0; i < e.n; ++i) {
      const uint32_t lo = i == 0 ? 0u : (static_cast<uint32_t>(e.first + i) << e.shift);
      const uint32_t hi = (static_cast<uint32_t>(e.first + i + 1) << e.shift) - 1u;
      const uint32_t base = static_cast<uint32_t>(e.first + i) << e.shift;
      uint32_t at[6] = {lo, hi, hi, hi, hi, hi};
      int m = 2;
      for (int side = 0; side < 2; ++side) {
        const uint32_t low = static_cast<uint32_t>(e.entries[i + side * e.n] >> 8);
        if (low < never) {
          at[m++] = base + low;
          at[m++] = base + low + 1;
        }
      }
      for (int k = 0; k < m; ++k) {
        const uint32_t mag = std::min(at[k], one);
        if (FineCode(e, mag, 1) != std::max(254 - FineCode(e, mag, 0), 0)) return t;
      }
      if (lo > one) break;
    }
    t.mirrored = true;
  } else if (FineCode(e, 0, 1) != FineCode(e, 0, 0)) {
    return t;
  }
  t.ok = true;
  return t;
}

// BuildByteTable(e), built once per table (the kernel gets the same constant tables on
// every call) and kept for the life of the process.
const ByteTable* CachedByteTable(const Encoder& e) {
  static std::mutex mu;
  static std::vector<std::pair<std::vector<int32_t>, std::unique_ptr<ByteTable>>> cache;
  const int32_t header[4] = {e.shift, e.first, e.n, e.lo < 0.0f};
  const size_t n_entries = 2 * static_cast<size_t>(e.n);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& c : cache) {  // compared in place: no copy on the kernel's every call
    if (c.first.size() == 4 + n_entries && std::equal(header, header + 4, c.first.begin()) &&
        std::equal(e.entries, e.entries + n_entries, c.first.begin() + 4)) {
      return c.second.get();
    }
  }
  std::vector<int32_t> key(header, header + 4);
  key.insert(key.end(), e.entries, e.entries + n_entries);
  cache.emplace_back(std::move(key), std::make_unique<ByteTable>(BuildByteTable(e)));
  return cache.back().second.get();
}

struct ByteTableRegisters {
  __m512i p[5][4];
};

// |y|'s key (two bytes) above a decision point's key (hi, lo)? And equal to it?
OD_AVX512_VBMI_ENC inline __mmask64 KeyAbove(__m512i yh, __m512i yl, __m512i h, __m512i l,
                                             __mmask64* equal) {
  const __mmask64 eq_h = _mm512_cmpeq_epi8_mask(yh, h);
  const __mmask64 eq_l = _mm512_cmpeq_epi8_mask(yl, l);
  *equal |= eq_h & eq_l;
  return _mm512_cmpgt_epu8_mask(yh, h) | (eq_h & _mm512_cmpgt_epu8_mask(yl, l));
}

// Element j of the 64 in a group as 16-bit words: `kWordPick.hi` picks the high halves of
// two vectors of 16 int32 in element order (word 2j + 1), `lo` the low halves; as bytes,
// `even` the low byte of each of two vectors of 32 words, `odd` the high byte.
struct WordPicker {
  alignas(64) uint16_t hi[32];
  alignas(64) uint16_t lo[32];
  alignas(64) uint8_t even[64];
  alignas(64) uint8_t odd[64];
  WordPicker() {
    for (int j = 0; j < 32; ++j) {
      hi[j] = static_cast<uint16_t>(2 * j + 1);
      lo[j] = static_cast<uint16_t>(2 * j);
    }
    for (int j = 0; j < 64; ++j) {
      even[j] = static_cast<uint8_t>(2 * j);
      odd[j] = static_cast<uint8_t>(2 * j + 1);
    }
  }
};
const WordPicker kWordPick;

// The encoder, 64 elements at a time. After the division, the work is done on 16-bit halves
// of |y|, 32 to a register: the high half holds the exponent and the 7 leading mantissa bits,
// which are all the index bits an octave has, and the key is a funnel shift of both halves
// (VBMI2), as ByteTableCode computes them. The tables' byte planes are read with one byte
// permute of two registers where they have at most 128 entries (`small`), else two and a
// blend. An exponent below the table's octaves reads octave `below`, and a NaN, an infinity
// or anything else above 1 (or, for the unsigned map, below 0), which the other encoders
// clip, goes to EncodeBlockAvx512, as an element whose key equals a decision point's does.
// Without the clip a finite |y| above 1 cannot occur: |x| <= absmax in every block without a NaN (the division and the power-of-two
// factor keep the order), and in a block with a NaN (absmax NaN, scale 1) a value in
// (1, 1 + 2^-7), whose high half is 1's, reads octave 127's first entry, which is 1's code.
// (The encoder before this one, with 32-bit lanes, was 1.3-1.4x slower: docs/memory.md.)
template <bool small, bool is_signed, bool scaled>
OD_AVX512_VBMI_ENC void EncodeBlockVbmiT(const ByteTable& t, const float* x, float factor,
                                         float scale, float lo, const int32_t* entries,
                                         int32_t shift, int32_t first, int32_t n, int block,
                                         uint8_t* codes) {
  ByteTableRegisters r;
  for (int j = 0; j < 5; ++j)
    for (int h = 0; h < (small ? 2 : 4); ++h) r.p[j][h] = _mm512_load_si512(t.plane[j] + 64 * h);
  const __m512i octave_first = _mm512_load_si512(t.octave_first);
  const __m512i octave_shift = _mm512_load_si512(t.octave_shift);
  const __m512i pick_hi = _mm512_load_si512(kWordPick.hi);
  const __m512i pick_lo = _mm512_load_si512(kWordPick.lo);
  const __m512i pick_even = _mm512_load_si512(kWordPick.even);
  const __m512i pick_odd = _mm512_load_si512(kWordPick.odd);
  __mmask64 high = 0;
  __m512i idx;
  auto lookup = [&](int j) OD_AVX512_VBMI_ENC {
    return small ? _mm512_permutex2var_epi8(r.p[j][0], idx, r.p[j][1])
                 : Lookup256(r.p[j], idx, high);
  };
  const __m512 f = _mm512_set1_ps(factor), s = _mm512_set1_ps(scale);
  const __m512i abs_hi = _mm512_set1_epi16(0x7fff), one_hi = _mm512_set1_epi16(0x3f80);
  const __m512i mant_hi = _mm512_set1_epi16(0x7f);
  const __m512i below = _mm512_set1_epi16(static_cast<int16_t>(t.below));
  const __m512i ones = _mm512_set1_epi8(1), far = _mm512_set1_epi8(static_cast<char>(254));
  const int full = block - block % 64;
  for (int i = 0; i < full; i += 64) {
    __m512i y[4];
    for (int q = 0; q < 4; ++q) {
      const __m512 xq = _mm512_loadu_ps(x + i + 16 * q);
      y[q] = _mm512_castps_si512(_mm512_div_ps(scaled ? _mm512_mul_ps(xq, f) : xq, s));
    }
    __m512i index[2], key[2];
    __mmask32 odd[2], neg[2] = {0, 0};
    for (int w = 0; w < 2; ++w) {
      const __m512i hi = _mm512_permutex2var_epi16(y[2 * w], pick_hi, y[2 * w + 1]);
      const __m512i low = _mm512_permutex2var_epi16(y[2 * w], pick_lo, y[2 * w + 1]);
      if (is_signed) neg[w] = _mm512_movepi16_mask(hi);
      const __m512i mag = is_signed ? _mm512_and_si512(hi, abs_hi) : hi;
      odd[w] = _mm512_cmpgt_epu16_mask(mag, one_hi);  // NaN, +-inf, > 1; unsigned: < 0
      // The permutes read the octave's low 5 bits; below e0, the octave below it.
      const __m512i octave = _mm512_max_epu16(_mm512_srli_epi16(mag, 7), below);
      const __m512i sh = _mm512_permutexvar_epi16(octave, octave_shift);
      const __m512i m7 = _mm512_and_si512(hi, mant_hi);
      index[w] = _mm512_add_epi16(_mm512_permutexvar_epi16(octave, octave_first),
                                  _mm512_srlv_epi16(m7, sh));
      // Bits [sh, sh + 16) of y's 32 bits (hi:low), all mantissa bits (sh <= 7).
      key[w] = _mm512_shrdv_epi16(low, hi, sh);
    }
    idx = _mm512_permutex2var_epi8(index[0], pick_even, index[1]);
    if (!small) high = _mm512_movepi8_mask(idx);
    const __m512i yl = _mm512_permutex2var_epi8(key[0], pick_even, key[1]);
    const __m512i yh = _mm512_permutex2var_epi8(key[0], pick_odd, key[1]);
    __m512i code = lookup(0);
    __mmask64 equal = 0;
    const __mmask64 above1 = KeyAbove(yh, yl, lookup(1), lookup(2), &equal);
    const __mmask64 above2 = KeyAbove(yh, yl, lookup(3), lookup(4), &equal);
    code = _mm512_mask_add_epi8(code, above1, code, ones);
    code = _mm512_mask_add_epi8(code, above2, code, ones);
    if (is_signed) code = _mm512_mask_subs_epu8(code, _kunpackd_mask64(neg[1], neg[0]), far, code);
    _mm512_storeu_si512(codes + i, code);
    const uint64_t redo =
        static_cast<uint64_t>(equal) | static_cast<uint64_t>(_kunpackd_mask64(odd[1], odd[0]));
    if (redo != 0) {
      for (int q = 0; q < 4; ++q) {
        if ((redo >> (16 * q)) & 0xffffu) {
          EncodeBlockAvx512(x + i + 16 * q, factor, scale, lo, entries, shift, first, n, 16,
                            codes + i + 16 * q);
        }
      }
    }
  }
  if (full < block) {
    EncodeBlockAvx512(x + full, factor, scale, lo, entries, shift, first, n, block - full,
                      codes + full);
  }
}

// EncodeBlockVbmiT for t's table size and map, multiplying by `factor` where it is not 1.
void EncodeBlockVbmi(const ByteTable& t, const float* x, float factor, float scale, float lo,
                     const int32_t* entries, int32_t shift, int32_t first, int32_t n, int block,
                     uint8_t* codes) {
  using Fn = void (*)(const ByteTable&, const float*, float, float, float, const int32_t*,
                      int32_t, int32_t, int32_t, int, uint8_t*);
  static constexpr Fn kVariants[2][2][2] = {
      {{EncodeBlockVbmiT<false, false, false>, EncodeBlockVbmiT<false, false, true>},
       {EncodeBlockVbmiT<false, true, false>, EncodeBlockVbmiT<false, true, true>}},
      {{EncodeBlockVbmiT<true, false, false>, EncodeBlockVbmiT<true, false, true>},
       {EncodeBlockVbmiT<true, true, false>, EncodeBlockVbmiT<true, true, true>}}};
  kVariants[t.entries <= 128][t.mirrored][factor != 1.0f](t, x, factor, scale, lo, entries,
                                                           shift, first, n, block, codes);
}

#endif

#if defined(OD_X86_AVX512)
// The decode and the encoder again for CPUs with AVX2 but not AVX-512 (e.g. AMD Zen 2 and 3,
// Intel Haswell to Alder Lake; not Zen 1, below). Both look up 8 elements at a time with
// scalar loads and inserts, not AVX2 gathers, which were slower on a Zen 3 (docs/memory.md);
// the encoder's indices leave the register as four 64-bit extracts. As in the VBMI pass, the
// decode also copies the old codes (emit_old) and takes the block's max |value| while the
// values are in registers, instead of in two more passes over the block. The arithmetic is
// the portable loops', operation by operation, so the values are identical
// (tests/test_cpu_kernel.py runs both).
#define OD_AVX2 __attribute__((target("avx2")))

// Not on Zen 1 (AMD family 17h, models below 30h), which runs each 256-bit operation as two
// halves: there AVX2 encoders like this one took 2.04-2.19 ns per element against the
// compiler's 128-bit loop's 1.71 (docs/memory_log.md, fourth session), so it keeps that loop.
bool CpuHasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_is("znver1") == 0;
  }();
  return has;
}

OD_AVX2 inline __m256i AbsBits8(__m256 x) {
  return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

// qmap[codes[j]] for the 8 codes at `codes`: eight loads and inserts (a vgatherdps took
// longer on a Zen 3).
OD_AVX2 inline __m256 Decode8(const float* qmap, const uint8_t* codes) {
  const __m128 lo = _mm_setr_ps(qmap[codes[0]], qmap[codes[1]], qmap[codes[2]], qmap[codes[3]]);
  const __m128 hi = _mm_setr_ps(qmap[codes[4]], qmap[codes[5]], qmap[codes[6]], qmap[codes[7]]);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

// Over the 32-code groups of [0, full): copy the codes to `old_codes` (when not null), store
// value(old, i) for the 8 elements at i (old: the decoded moment times absmax) to `out`, and
// return their max |value| bits (AbsMaxBits' unsigned integer max).
template <typename Value>
OD_AVX2 inline uint32_t Avx2Pass(const uint8_t* codes, const float* qmap, float absmax,
                                 int full, float* out, uint8_t* old_codes, const Value& value) {
  const __m256 a = _mm256_set1_ps(absmax);
  __m256i top = _mm256_setzero_si256();
  for (int i = 0; i < full; i += 32) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    if (old_codes != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(old_codes + i), c);
    for (int q = 0; q < 4; ++q) {
      const __m256 m = Decode8(qmap, codes + i + 8 * q);
      const __m256 v = value(_mm256_mul_ps(m, a), i + 8 * q);
      _mm256_storeu_ps(out + i + 8 * q, v);
      top = _mm256_max_epu32(top, AbsBits8(v));
    }
  }
  const __m128i t4 = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  const __m128i t2 = _mm_max_epu32(t4, _mm_shuffle_epi32(t4, 0x4e));
  const __m128i t1 = _mm_max_epu32(t2, _mm_shuffle_epi32(t2, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(t1));
}

struct EmaValue8 {  // c_in * g^power + c_keep * old, as EmaBlock
  const float* g;
  __m256 cin, ckeep;
  int power;
  OD_AVX2 __m256 operator()(__m256 old, int i) const {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 src = power == 2 ? _mm256_mul_ps(gi, gi) : gi;
    const __m256 t1 = _mm256_mul_ps(cin, src);
    const __m256 t2 = _mm256_mul_ps(ckeep, old);
    return _mm256_add_ps(t1, t2);
  }
};

struct MaxValue8 {  // max(old, seen [/ divisor]), NaN-propagating, as MaxBlock
  const float* seen;
  __m256 d;
  int divide;
  OD_AVX2 __m256 operator()(__m256 old, int i) const {
    const __m256 si = _mm256_loadu_ps(seen + i);
    const __m256 s = divide ? _mm256_div_ps(si, d) : si;
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(old, s, _CMP_GT_OQ),
                                     _mm256_cmp_ps(old, old, _CMP_UNORD_Q));
    return _mm256_blendv_ps(s, old, keep);
  }
};

// StoresDenominator and StoresQuotient (the VBMI passes' AdamPart roles) for 8 elements. On
// the Zen 4, which runs this path only in tests and benchmarks, the per-block work took 1.3%
// less time than with AdamOutBlock's pass (benchmarks/kernel_pipeline.py --path avx2: the
// decode's scalar loads, not the divider, bound it); not measured on a CPU that runs it.
template <typename Value>
struct StoresDenominator8 {
  const Value& value;
  const AdamPart& part;
  OD_AVX2 __m256 operator()(__m256 old, int i) const {
    const __m256 v = value(old, i);
    const AdamCoefficients& a = part.a;
    const __m256 d = a.scale_den ? _mm256_mul_ps(v, _mm256_set1_ps(a.inv_bc2)) : v;
    const __m256 r = _mm256_sqrt_ps(_mm256_add_ps(d, _mm256_set1_ps(a.eps_root)));
    _mm256_storeu_ps(part.denominator + i, _mm256_add_ps(r, _mm256_set1_ps(a.eps)));
    return v;
  }
};

template <typename Value>
struct StoresQuotient8 {
  const Value& value;
  const AdamPart& part;
  OD_AVX2 __m256 operator()(__m256 old, int i) const {
    const __m256 m = value(old, i);
    const AdamCoefficients& a = part.a;
    const __m256 n = a.scale_num ? _mm256_mul_ps(m, _mm256_set1_ps(a.inv_bc1)) : m;
    _mm256_storeu_ps(part.out + i, _mm256_div_ps(n, _mm256_loadu_ps(part.denominator + i)));
    return m;
  }
};

template <typename Value>
struct StoresSign8 {
  const Value& value;
  const AdamPart& part;
  OD_AVX2 __m256 operator()(__m256 old, int i) const {
    const __m256 gi = _mm256_loadu_ps(part.g + i);
    const __m256 v = value(old, i);
    const __m256 t1 = _mm256_mul_ps(_mm256_set1_ps(part.c_g), gi);
    const __m256 t2 = _mm256_mul_ps(_mm256_set1_ps(part.c_mu), old);
    const __m256 t = _mm256_add_ps(t1, t2);
    const __m256 zero = _mm256_setzero_ps();
    __m256 sign = _mm256_blendv_ps(t, _mm256_set1_ps(1.0f), _mm256_cmp_ps(t, zero, _CMP_GT_OQ));
    sign = _mm256_blendv_ps(sign, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(t, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(part.out + i, sign);
    return v;
  }
};

template <typename Value>
OD_AVX2 inline uint32_t Avx2PassWith(const AdamPart& part, const uint8_t* codes,
                                     const float* qmap, float absmax, int full, float* out,
                                     uint8_t* old_codes, const Value& value) {
  switch (part.role) {
    case AdamPart::kDenominator:
      return Avx2Pass(codes, qmap, absmax, full, out, old_codes,
                      StoresDenominator8<Value>{value, part});
    case AdamPart::kQuotient:
      return Avx2Pass(codes, qmap, absmax, full, out, old_codes,
                      StoresQuotient8<Value>{value, part});
    case AdamPart::kLionSign:
      return Avx2Pass(codes, qmap, absmax, full, out, old_codes, StoresSign8<Value>{value, part});
    default:
      return Avx2Pass(codes, qmap, absmax, full, out, old_codes, value);
  }
}

// EmaBlock and MaxBlock as one pass each (above), with the old codes' copy and the block's
// max |value| bits; the rest of the block (`valid` not a multiple of 32, and the padding)
// through the portable function, AbsMaxBits and memcpy.
OD_AVX2 uint32_t EmaBlockAvx2(const float* g, const uint8_t* codes, const float* qmap,
                              float absmax, float c_in, float c_keep, int power, int valid,
                              int block, float* out, uint8_t* old_codes,
                              const AdamPart& part) {
  const int full = valid - valid % 32;
  const EmaValue8 value{g, _mm256_set1_ps(c_in), _mm256_set1_ps(c_keep), power};
  const uint32_t top = Avx2PassWith(part, codes, qmap, absmax, full, out, old_codes, value);
  if (full == block) return top;  // no tail, no calls
  EmaBlock(g + full, codes + full, qmap, absmax, c_in, c_keep, power, valid - full,
           block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

OD_AVX2 uint32_t MaxBlockAvx2(const float* seen, const uint8_t* codes, const float* qmap,
                              float absmax, int divide, float divisor, int valid, int block,
                              float* out, uint8_t* old_codes, const AdamPart& part) {
  const int full = valid - valid % 32;
  const MaxValue8 value{seen, _mm256_set1_ps(divisor), divide};
  const uint32_t top = Avx2PassWith(part, codes, qmap, absmax, full, out, old_codes, value);
  if (full == block) return top;  // no tail, no calls
  MaxBlock(seen + full, codes + full, qmap, absmax, divide, divisor, valid - full,
           block - full, out + full);
  PartTail(part, out, codes, qmap, absmax, full, valid);
  return PassTail(codes, full, block, out, old_codes, top);
}

// entries[index[j]] for the 8 indices (each in [0, 2 n)): the indices as four 64-bit extracts,
// then eight loads and inserts (a vpgatherdd took 70% of the encoder's time on a Zen 3, and
// this is 12-15% faster than it). The entries are moved as floats (vinsertps: one
// instruction each; a move changes no bits).
OD_AVX2 inline __m256i Lookup8(const int32_t* entries, __m256i index) {
  const __m128i i_lo = _mm256_castsi256_si128(index), i_hi = _mm256_extracti128_si256(index, 1);
  const uint64_t p0 = static_cast<uint64_t>(_mm_cvtsi128_si64(i_lo));
  const uint64_t p1 = static_cast<uint64_t>(_mm_extract_epi64(i_lo, 1));
  const uint64_t p2 = static_cast<uint64_t>(_mm_cvtsi128_si64(i_hi));
  const uint64_t p3 = static_cast<uint64_t>(_mm_extract_epi64(i_hi, 1));
  const float* e = reinterpret_cast<const float*>(entries);
  const __m128 lo = _mm_setr_ps(e[static_cast<uint32_t>(p0)], e[p0 >> 32],
                                e[static_cast<uint32_t>(p1)], e[p1 >> 32]);
  const __m128 hi = _mm_setr_ps(e[static_cast<uint32_t>(p2)], e[p2 >> 32],
                                e[static_cast<uint32_t>(p3)], e[p3 >> 32]);
  return _mm256_castps_si256(_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1));
}

// EncodeBlockAvx512 for AVX2, operation by operation (the same codes; the tests run both).
// 32 elements per iteration, so that their codes are packed to bytes by two rounds of
// saturating packs (exact: each code is masked to its low byte first, as EncodeBlock's cast
// truncates) and one permute.
OD_AVX2 void EncodeBlockAvx2(const float* x, float factor, float scale, float lo,
                             const int32_t* entries, int32_t shift, int32_t first, int32_t n,
                             int block, uint8_t* codes) {
  const __m256 f = _mm256_set1_ps(factor), s = _mm256_set1_ps(scale);
  const __m256 vlo = _mm256_set1_ps(lo), one = _mm256_set1_ps(1.0f);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i low_mask = _mm256_set1_epi32(static_cast<int32_t>((1u << shift) - 1u));
  const __m256i vfirst = _mm256_set1_epi32(first), vlast = _mm256_set1_epi32(n - 1);
  const __m256i vn = _mm256_set1_epi32(n), zero = _mm256_setzero_si256();
  const __m256i step = _mm256_set1_epi32(1), byte = _mm256_set1_epi32(0xff);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m128i sh = _mm_cvtsi32_si128(shift);
  const bool scaled = factor != 1.0f;  // x * 1 is x: skip the multiply, as EncodeBlockVbmiT
  const int full = block - block % 32;
  for (int i = 0; i < full; i += 32) {
    __m256i code[4];
    for (int q = 0; q < 4; ++q) {
      const __m256 xq = _mm256_loadu_ps(x + i + 8 * q);
      const __m256 v = _mm256_div_ps(scaled ? _mm256_mul_ps(xq, f) : xq, s);
      // As in EncodeBlockAvx512: max_ps and min_ps pass a NaN v through; v = -0.0 stays -0.0
      // for the unsigned map, with code 0 as EncodeBlock gives +0.0.
      const __m256 y = _mm256_min_ps(one, _mm256_max_ps(vlo, v));
      const __m256i u = _mm256_castps_si256(y);
      const __m256i neg = _mm256_srai_epi32(u, 31);  // -1 where the sign bit is set, else 0
      const __m256i mag = _mm256_and_si256(u, abs_mask);
      __m256i index = _mm256_sub_epi32(_mm256_srl_epi32(mag, sh), vfirst);
      index = _mm256_min_epi32(_mm256_max_epi32(index, zero), vlast);
      index = _mm256_add_epi32(index, _mm256_and_si256(neg, vn));
      const __m256i entry = Lookup8(entries, index);
      const __m256i above =
          _mm256_cmpgt_epi32(_mm256_and_si256(mag, low_mask), _mm256_srai_epi32(entry, 8));
      // Above the decision point the code moves one step away from zero (neg | 1: -1 or 1).
      const __m256i away = _mm256_and_si256(above, _mm256_or_si256(neg, step));
      code[q] = _mm256_and_si256(_mm256_add_epi32(entry, away), byte);
    }
    const __m256i words01 = _mm256_packus_epi32(code[0], code[1]);
    const __m256i words23 = _mm256_packus_epi32(code[2], code[3]);
    const __m256i bytes = _mm256_packus_epi16(words01, words23);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  if (full < block) {
    EncodeBlock(x + full, factor, scale, lo, entries, shift, first, n, block - full,
                codes + full);
  }
}
#else
bool CpuHasAvx2() { return false; }
#endif

inline float AdamOutValue(float mu, float den, int scale_num, float inv_bc1, int scale_den,
                          float inv_bc2, float eps, float eps_root) {
  const AdamCoefficients a{scale_num, inv_bc1, scale_den, inv_bc2, eps, eps_root};
  return AdamQuotient(a, mu, AdamDenominator(a, den));
}

OD_CLONES void AdamOutBlock(const float* __restrict mu, const float* __restrict den,
                            int scale_num, float inv_bc1, int scale_den, float inv_bc2,
                            float eps, float eps_root, int valid, float* __restrict out) {
  for (int i = 0; i < valid; ++i) {
    out[i] = AdamOutValue(mu[i], den[i], scale_num, inv_bc1, scale_den, inv_bc2, eps, eps_root);
  }
}

constexpr float kF32Max = 3.4028234663852886e38f;

// Quantizes one block of float32 values x: absmax as jnp.max(jnp.abs(x)) saturated at
// float32.max, the power-of-two rescaling of quantization._scales, nearest codes.
// With `byte_table` (a ByteTable that BuildByteTable accepted; only on x86-64) the VBMI
// encoder runs instead of `encode`.
void QuantizeBlock(const float* x, const Encoder& e, int block, uint8_t* codes,
                   float* absmax_out, uint32_t absmax_bits, EncodeFn encode,
                   const ByteTable* byte_table) {
  float a = FloatOf(absmax_bits);
  a = (a != a) ? a : std::min(a, kF32Max);
  const float factor = a > 0x1p100f ? 0x1p-64f : (a < 0x1p-100f ? 0x1p64f : 1.0f);
  const float scale = a > 0.0f ? a * factor : 1.0f;
  *absmax_out = a;
#if defined(OD_X86_AVX512)
  if (byte_table != nullptr) {
    EncodeBlockVbmi(*byte_table, x, factor, scale, e.lo,
                    e.entries, e.shift, e.first, e.n, block, codes);
    return;
  }
#endif
  encode(x, factor, scale, e.lo, e.entries, e.shift, e.first, e.n, block, codes);
}

// Asks Linux for transparent huge pages for the whole pages inside [p, p + n), when
// n is at least kHugePageMin. The copy of the old codes (emit_old) lives in XLA's block of
// temporaries, which glibc maps afresh on every step once it exceeds 32 MiB; filling it then
// takes a page fault per 4 KiB from the kernel's threads (24,800 per step at 5e7 parameters),
// and the step was 3% slower than with XLA's own copy. With huge pages (THP in "madvise"
// mode, the common default) it is 12-19% faster instead (docs/memory.md). The same goes
// for the output where it has a buffer of its own rather than g's (out_mode, the gradient
// an argument of the program): with the advice, bfloat16 Adam's update step at 1e7 and 5e7
// parameters was faster with it than with the copy of the old moments, without it slower
// (docs/memory_log.md, eighteenth session). Only these buffers are advised, never memory outside them; elsewhere,
// or where THP is off, nothing changes. (The
// advice stays on the range after XLA frees the block: where the allocator keeps it, as with
// the docs' GLIBC_TUNABLES setting, the next step's block, at the same place, has it anyway.)
constexpr size_t kHugePageMin = size_t{4} << 20;

void AdviseHugePages(void* p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (n < kHugePageMin) return;
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return;
  const uintptr_t kPage = static_cast<uintptr_t>(page_size);
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(kPage - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)n;
#endif
}

// Runs work(task) for task in [0, n_tasks) on the caller and the pool's threads. The
// caller takes tasks too, so the call finishes even if no pool thread is free; tasks
// scheduled after all work is claimed return at once (they only touch `shared`).
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n_tasks, F work) {
  if (n_tasks <= 0) return;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min<int64_t>(threads, n_tasks) - 1;
  if (helpers <= 0) {
    for (int64_t t = 0; t < n_tasks; ++t) work(t);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  // Helpers call `work` only for tasks they claim before all are claimed, and the caller
  // waits until every claimed task is done, so `work` outlives every call of it.
  auto run = [shared, n_tasks, &work]() {
    for (;;) {
      const int64_t t = shared->next.fetch_add(1);
      if (t >= n_tasks) return;
      work(t);
      if (shared->done.fetch_add(1) + 1 == n_tasks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([run]() { run(); });
  run();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n_tasks; });
}

// XLA:CPU runs its programs with denormal inputs and results flushed to zero; so do both
// kernels, on whichever thread a task runs (x86: the MXCSR's DAZ and FTZ bits), so that no
// result depends on the thread that computed it.
class ScopedFlushDenormals {
 public:
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~ScopedFlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Both handlers' checks of their attributes: the moment layout (one or two moving averages
// of g or g*g, a running max after two) and the output (out_mode: 0 none, 1 Adam's from
// moment out_den, 1 nu or 2 nu_max, 2 Lion's; four output coefficients).
bool MomentLayoutValid(int64_t n_ema, int64_t has_max, int64_t power0, int64_t power1) {
  return n_ema >= 1 && n_ema <= 2 && has_max >= 0 && has_max <= 1 && !(has_max && n_ema != 2) &&
         power0 >= 1 && power0 <= 2 && power1 >= 1 && power1 <= 2;
}

bool OutputLayoutValid(int64_t out_mode, int64_t out_den, int64_t n_ema, int64_t n_moments,
                       const ffi::Buffer<ffi::F32>& ocoef) {
  return out_mode >= 0 && out_mode <= 2 &&
         !(out_mode == 1 && (n_ema != 2 || out_den < 1 || out_den >= n_moments)) &&
         !(out_mode == 2 && n_ema != 1) && ocoef.element_count() == 4;
}

// The output result (the last of n_rets), which must be shaped like g (size elements); null
// where it is not.
float* OutputBuffer(ffi::RemainingRets& rets, int64_t n_rets, int64_t size) {
  auto out = rets.get<ffi::Buffer<ffi::F32>>(n_rets - 1);
  if (!out.has_value() || static_cast<int64_t>((*out)->element_count()) != size) return nullptr;
  return (*out)->typed_data();
}

constexpr int64_t kTaskElements = 1 << 16;

ffi::Error RequantizeEmaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g,
                             ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::F32> ocoef,
                             ffi::RemainingArgs rest, ffi::RemainingRets rets, int64_t n_ema,
                             int64_t has_max, int64_t max_divide, int64_t power0,
                             int64_t power1, int64_t decode_limit, int64_t emit_old,
                             int64_t out_mode, int64_t out_den, int64_t out_scale_num,
                             int64_t out_scale_den, int64_t n_after) {
  const int64_t n_moments = n_ema + has_max;
  if (!MomentLayoutValid(n_ema, has_max, power0, power1)) {
    return ffi::Error::InvalidArgument("requantize_ema: unsupported moment layout");
  }
  if (!OutputLayoutValid(out_mode, out_den, n_ema, n_moments, ocoef)) {
    return ffi::Error::InvalidArgument("requantize_ema: unsupported output");
  }
  const int64_t n_rets = 2 * n_moments * (emit_old ? 2 : 1) + (out_mode ? 1 : 0);
  if ((n_after != 0 && n_after != 1) ||
      rest.size() != static_cast<size_t>(4 * n_moments + n_after) ||
      rets.size() != static_cast<size_t>(n_rets)) {
    return ffi::Error::InvalidArgument("requantize_ema: wrong number of operands");
  }
  std::vector<Encoder> enc(n_moments);
  std::vector<const uint8_t*> codes_in(n_moments);
  std::vector<const float*> absmax_in(n_moments);
  std::vector<uint8_t*> codes_out(n_moments);
  std::vector<float*> absmax_out(n_moments);
  std::vector<uint8_t*> old_codes_out(n_moments, nullptr);
  std::vector<float*> old_absmax_out(n_moments, nullptr);
  int64_t n_blocks = -1, block = -1;
  for (int64_t k = 0; k < n_moments; ++k) {
    auto qmap = rest.get<ffi::Buffer<ffi::F32>>(4 * k);
    auto table = rest.get<ffi::Buffer<ffi::S32>>(4 * k + 1);
    auto codes = rest.get<ffi::Buffer<ffi::U8>>(4 * k + 2);
    auto absmax = rest.get<ffi::Buffer<ffi::F32>>(4 * k + 3);
    auto codes_o = rets.get<ffi::Buffer<ffi::U8>>(2 * k);
    auto absmax_o = rets.get<ffi::Buffer<ffi::F32>>(2 * k + 1);
    if (!qmap.has_value() || !table.has_value() || !codes.has_value() || !absmax.has_value() ||
        !codes_o.has_value() || !absmax_o.has_value()) {
      return ffi::Error::InvalidArgument("requantize_ema: operand of the wrong type");
    }
    const auto dims = codes->dimensions();
    if (dims.size() != 2) return ffi::Error::InvalidArgument("codes must be (n_blocks, B)");
    if (k == 0) {
      n_blocks = dims[0];
      block = dims[1];
    } else if (dims[0] != n_blocks || dims[1] != block) {
      return ffi::Error::InvalidArgument("requantize_ema: moments differ in block layout");
    }
    if (static_cast<int64_t>(absmax->element_count()) != n_blocks ||
        static_cast<int64_t>((*codes_o)->element_count()) != n_blocks * block ||
        static_cast<int64_t>((*absmax_o)->element_count()) != n_blocks) {
      return ffi::Error::InvalidArgument("requantize_ema: absmax must be (n_blocks,)");
    }
    if (qmap->element_count() != 256 || table->element_count() < kHeader) {
      return ffi::Error::InvalidArgument("requantize_ema: bad encoder table");
    }
    const int32_t* t = table->typed_data();
    enc[k].qmap = qmap->typed_data();
    enc[k].shift = t[0];
    enc[k].first = t[1];
    enc[k].n = t[2];
    enc[k].lo = t[3] ? -1.0f : 0.0f;
    enc[k].entries = t + kHeader;
    if (enc[k].shift < 1 || enc[k].shift > 23 || enc[k].n < 1 ||
        table->element_count() != static_cast<size_t>(kHeader + 2 * enc[k].n)) {
      return ffi::Error::InvalidArgument("requantize_ema: bad encoder table");
    }
    codes_in[k] = codes->typed_data();
    absmax_in[k] = absmax->typed_data();
    codes_out[k] = (*codes_o)->typed_data();
    absmax_out[k] = (*absmax_o)->typed_data();
    if (emit_old) {
      auto old_codes_o = rets.get<ffi::Buffer<ffi::U8>>(2 * n_moments + 2 * k);
      auto old_absmax_o = rets.get<ffi::Buffer<ffi::F32>>(2 * n_moments + 2 * k + 1);
      if (!old_codes_o.has_value() || !old_absmax_o.has_value()) {
        return ffi::Error::InvalidArgument("requantize_ema: operand of the wrong type");
      }
      if (static_cast<int64_t>((*old_codes_o)->element_count()) != n_blocks * block ||
          static_cast<int64_t>((*old_absmax_o)->element_count()) != n_blocks) {
        return ffi::Error::InvalidArgument("requantize_ema: old copies must match the codes");
      }
      old_codes_out[k] = (*old_codes_o)->typed_data();
      old_absmax_out[k] = (*old_absmax_o)->typed_data();
    }
  }
  const int64_t size = static_cast<int64_t>(g.element_count());
  if (size > n_blocks * block || size <= (n_blocks - 1) * block) {
    return ffi::Error::InvalidArgument("requantize_ema: gradient size does not fit the blocks");
  }
  if (coef.element_count() != 5) {
    return ffi::Error::InvalidArgument("requantize_ema: coef must have 5 entries");
  }
  const float* c = coef.typed_data();
  const float* gd = g.typed_data();
  // The transform's output (out_mode), possibly g's own buffer.
  float* const out_d = out_mode ? OutputBuffer(rets, n_rets, size) : nullptr;
  if (out_mode && out_d == nullptr) {
    return ffi::Error::InvalidArgument("requantize_ema: output must be shaped like g");
  }
  const float* oc = ocoef.typed_data();
  const float inv_bc1 = 1.0f / oc[0], inv_bc2 = 1.0f / oc[1];
  const int powers[2] = {static_cast<int>(power0), static_cast<int>(power1)};
  const int64_t blocks_per_task = std::max<int64_t>(1, kTaskElements / block);
  const int64_t n_tasks = (n_blocks + blocks_per_task - 1) / blocks_per_task;
  const int b = static_cast<int>(block);
  // The decode: the best the CPU has (AVX-512 VBMI byte permutes, AVX-512F register
  // permutes, the AVX2 loads, the portable compiler-vectorized loops), at most `decode_limit`
  // (0: any, 1: no VBMI, 2: no AVX-512, 3: portable only; tests run all four). The AVX-512
  // encoder goes with either AVX-512 decode, the AVX2 one with the AVX2 decode. All but the
  // portable decode also copy the old codes and take each block's max |value| (`fused`).
  EncodeFn encode = EncodeBlock;
  bool vbmi = false, avx512 = false, avx2 = false;
#if defined(OD_X86_AVX512)
  avx512 = decode_limit < 2 && CpuHasAvx512();
  if (avx512) encode = EncodeBlockAvx512;
  vbmi = decode_limit < 1 && CpuHasAvx512Vbmi();
  avx2 = !avx512 && decode_limit < 3 && CpuHasAvx2();
  if (avx2) encode = EncodeBlockAvx2;
  std::vector<MapPlanes> planes;
  for (int64_t k = 0; k < n_moments && vbmi; ++k) planes.push_back(PlanesOf(enc[k].qmap));
#endif
  // The VBMI encoder goes with the VBMI decode, for each map whose table it can hold.
  std::vector<const ByteTable*> byte_tables(n_moments, nullptr);
#if defined(OD_X86_AVX512)
  for (int64_t k = 0; k < n_moments && vbmi; ++k) {
    const ByteTable* t = CachedByteTable(enc[k]);
    if (t->ok) byte_tables[k] = t;
  }
#endif
  const bool fused = vbmi || avx512 || avx2;

  // Adam's output in the moments' passes (AdamPart) where they are fused: its denominator's
  // pass first, mu's last.
  const bool split_out = fused && out_mode == 1;
  // Lion's sign in its moment's pass, from the old moment that pass decodes.
  const bool lion_in_pass = fused && out_mode == 2;
  const AdamCoefficients adam{static_cast<int>(out_scale_num), inv_bc1,
                              static_cast<int>(out_scale_den), inv_bc2, oc[2], oc[3]};
  const float lion_c[2] = {oc[0], oc[1]};  // c_g, c_mu

  auto work = [&](int64_t task) {
    ScopedFlushDenormals flush;
    // The moments' values, then (split_out) the output's denominators.
    std::vector<float> values(static_cast<size_t>((n_moments + 1) * block));
    const int64_t first = task * blocks_per_task;
    const int64_t last = std::min(n_blocks, first + blocks_per_task);
    uint32_t top[3];  // each moment's max |value| bits, when its decode computed it
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t off = blk * block;
      const int valid = static_cast<int>(std::min<int64_t>(block, size - off));
      // A copy of the old codes and scales, for the transform's output (emit_old), is written
      // before the new ones, which may replace them in place: by the VBMI decode as it reads
      // the codes, else here.
      auto old_codes = [&](int64_t k) { return emit_old ? old_codes_out[k] + off : nullptr; };
      // The role of moment k's pass in Adam's output, and the order of the passes.
      [[maybe_unused]] auto part = [&](int64_t k) {
        AdamPart::Role role = AdamPart::kNone;
        if (split_out && k == 0) role = AdamPart::kQuotient;
        if (split_out && k == out_den) role = AdamPart::kDenominator;
        if (lion_in_pass && k == 0) role = AdamPart::kLionSign;
        return AdamPart{role, adam, values.data() + n_moments * block, out_d + off, gd + off,
                        lion_c[0], lion_c[1]};
      };
      auto ema_pass = [&](int64_t k) {
        float* out = values.data() + k * block;
#if defined(OD_X86_AVX512)
        if (vbmi) {
          top[k] = EmaBlockVbmi(gd + off, codes_in[k] + off, enc[k].qmap, planes[k],
                                absmax_in[k][blk], c[2 * k], c[2 * k + 1], powers[k], valid, b,
                                out, old_codes(k), part(k));
          return;
        }
        if (avx512) {
          top[k] = EmaBlockAvx512Pass(gd + off, codes_in[k] + off, enc[k].qmap,
                                      absmax_in[k][blk], c[2 * k], c[2 * k + 1], powers[k],
                                      valid, b, out, old_codes(k), part(k));
          return;
        }
        if (avx2) {
          top[k] = EmaBlockAvx2(gd + off, codes_in[k] + off, enc[k].qmap, absmax_in[k][blk],
                                c[2 * k], c[2 * k + 1], powers[k], valid, b, out, old_codes(k),
                                part(k));
          return;
        }
#endif
        EmaBlock(gd + off, codes_in[k] + off, enc[k].qmap, absmax_in[k][blk], c[2 * k],
                 c[2 * k + 1], powers[k], valid, b, out);
      };
      auto max_pass = [&]() {
        const int divide = static_cast<int>(max_divide);
        float* out = values.data() + 2 * block;
#if defined(OD_X86_AVX512)
        if (vbmi) {
          top[2] = MaxBlockVbmi(values.data() + block, codes_in[2] + off, enc[2].qmap,
                                planes[2], absmax_in[2][blk], divide, c[4], valid, b, out,
                                old_codes(2), part(2));
          return;
        }
        if (avx512) {
          top[2] = MaxBlockAvx512Pass(values.data() + block, codes_in[2] + off, enc[2].qmap,
                                      absmax_in[2][blk], divide, c[4], valid, b, out,
                                      old_codes(2), part(2));
          return;
        }
        if (avx2) {
          top[2] = MaxBlockAvx2(values.data() + block, codes_in[2] + off, enc[2].qmap,
                                absmax_in[2][blk], divide, c[4], valid, b, out, old_codes(2),
                                part(2));
          return;
        }
#endif
        MaxBlock(values.data() + block, codes_in[2] + off, enc[2].qmap, absmax_in[2][blk],
                 divide, c[4], valid, b, out);
      };
      if (split_out) {  // nu, nu_max, then mu, whose pass writes the output
        ema_pass(1);
        if (has_max) max_pass();
        ema_pass(0);
      } else {
        for (int64_t k = 0; k < n_ema; ++k) ema_pass(k);
        if (has_max) max_pass();
      }
      // The output, after every read of g (it may be written in g's place) and before the
      // new codes replace the old (Lion's reads those).
      if (out_mode == 1 && !split_out) {
        AdamOutBlock(values.data(), values.data() + out_den * block,
                     static_cast<int>(out_scale_num), inv_bc1, static_cast<int>(out_scale_den),
                     inv_bc2, oc[2], oc[3], valid, out_d + off);
      } else if (out_mode == 2 && !lion_in_pass) {
        LionOutBlock(gd + off, codes_in[0] + off, enc[0].qmap, absmax_in[0][blk], oc[0], oc[1],
                     valid, out_d + off);
      }
      for (int64_t k = 0; k < n_moments; ++k) {
        if (!fused) {
          top[k] = AbsMaxBits(values.data() + k * block, b);
          if (emit_old) {
            std::memcpy(old_codes(k), codes_in[k] + off, static_cast<size_t>(block));
          }
        }
        if (emit_old) old_absmax_out[k][blk] = absmax_in[k][blk];
      }
      // All inputs of this block are read before any output is written, so the outputs
      // may alias the inputs (the new state written in place of the old).
      for (int64_t k = 0; k < n_moments; ++k) {
        QuantizeBlock(values.data() + k * block, enc[k], b, codes_out[k] + off,
                      absmax_out[k] + blk, top[k], encode, byte_tables[k]);
      }
    }
  };
  for (int64_t k = 0; k < n_moments && emit_old; ++k) {
    AdviseHugePages(old_codes_out[k], static_cast<size_t>(n_blocks * block));
  }
  if (out_d != nullptr && out_d != gd) AdviseHugePages(out_d, static_cast<size_t>(size) * 4);
  ParallelFor(pool, n_tasks, work);
  return ffi::Error::Success();
}


// --- bfloat16 moments ---------------------------------------------------------------------
//
// The same moving averages (and running max) on moments stored in bfloat16, computed in
// float32 as jnp computes them: widen each stored value (exact), update (each multiply and
// add rounded, denormals flushed to zero as XLA:CPU does), and round the new value to
// bfloat16, nearest-even, as XLA converts (a NaN stays a quiet NaN). XLA:CPU itself writes
// the new moments and the transform's output in two loops and copies the old moments first
// (docs/memory.md); this reads each element once, writes the new moments in place and, with
// emit_old, a copy of the old ones for the output.


inline float Bf16ToF32(uint16_t h) { return FloatOf(static_cast<uint32_t>(h) << 16); }

inline uint16_t F32ToBf16(float x) {
  const uint32_t u = BitsOf(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// MurmurHash3's 32-bit finalizer, as storage._mix32 computes it (wrapping arithmetic).
inline uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Stochastic rounding to bfloat16 as storage.stochastic_round_bfloat16 computes it: 16 bits
// hashed from the element's row-major index and the moment's seed (storage._stochastic_seed,
// from the step count and the moment's stream) added below the bfloat16 mantissa, then
// truncated; infinities and NaN as F32ToBf16 rounds them (jnp's astype of the unchanged
// bits). A finite value above the largest bfloat16 may carry into infinity, as there.
inline uint16_t F32ToBf16Stochastic(float x, uint16_t noise) {
  const uint32_t u = BitsOf(x);
  const bool finite = (u & 0x7f800000u) != 0x7f800000u;
  return finite ? static_cast<uint16_t>((u + noise) >> 16) : F32ToBf16(x);
}

// Elements per block of random bits (three moments' bits on the stack: 12 KiB).
constexpr int64_t kNoiseBlock = 2048;

// The 16 random bits of elements [begin, begin + n) for a moment's seed, in a loop of its
// own over each block while the block's data is fetched (EmaBf16Range). Measured on 1e7
// elements with Adam's output (model-167 Xeon): the hash inside the moments' loop took
// 1.5-1.8x the time of rounding to nearest (its long loop body left fewer loads in flight);
// bits hashed per block without prefetching, about as long; with the block prefetched first,
// 1.2-1.35x (blocks of 1024-4096 alike).
inline void StochasticNoise(uint32_t seed, int64_t begin, int64_t n, uint16_t* noise) {
  const uint32_t first = static_cast<uint32_t>(begin);
  for (uint32_t j = 0; j < static_cast<uint32_t>(n); ++j) {
    noise[j] = static_cast<uint16_t>(Mix32(((first + j) * 0x27D4EB2Fu) ^ seed));
  }
}

// The rounding of a new moment k at element i: to nearest, or stochastically with the bits
// noise[k][i - first].
template <bool kStochastic>
inline uint16_t RoundBf16(float x, const uint16_t (*noise)[kNoiseBlock], int64_t first, int k,
                          int64_t i) {
  if constexpr (kStochastic) {
    return F32ToBf16Stochastic(x, noise[k][i - first]);
  } else {
    (void)noise;
    (void)first;
    (void)k;
    (void)i;
    return F32ToBf16(x);
  }
}

struct Bf16Args {
  const float* g;
  const uint16_t* in[3];
  uint16_t* out[3];
  uint16_t* old[3];  // null without emit_old
  float c_in[2], c_keep[2], divisor;
  int power[2];
  int n_ema, has_max, divide;
  // The transform's output (out_mode, as in RequantizeEmaImpl): null without it; it may be
  // g's own buffer. Adam's from moment 0 and moment `den`; Lion's from the old moment 0.
  float* u;
  int den, scale_num, scale_den;
  float inv_bc1, inv_bc2, eps, eps_root;  // Adam
  float c_g, c_mu;                        // Lion
  // Stochastic rounding: one seed per stored moment (storage._stochastic_seed), else null.
  const uint32_t* seed;
};

// Adam's output from the new float32 moments, as AdamOutBlock computes it.
inline float AdamOut(const Bf16Args& a, float mu, float den) {
  return AdamOutValue(mu, den, a.scale_num, a.inv_bc1, a.scale_den, a.inv_bc2, a.eps,
                      a.eps_root);
}

// A denormal as the signed zero that DAZ makes of it in arithmetic (a value that is only
// compared and selected, like the running max's previous value, keeps its bits otherwise).
inline float FlushDenormal(float x) {
  const uint32_t u = BitsOf(x);
  return (u & 0x7f800000u) != 0 ? x : FloatOf(u & 0x80000000u);
}

// Elements [begin, end). Each moment is read and written through one pointer, `out`: the
// outputs are the inputs in place (emit_old, what the transforms use), or are first filled
// with the inputs here; every value of an element is read before it is written.
template <bool kSr>
__attribute__((always_inline)) inline void EmaBf16RangeFor(
    const Bf16Args& a, int64_t begin, int64_t end, const uint16_t (*noise)[kNoiseBlock]) {
  const float* __restrict g = a.g;
  const size_t bytes = static_cast<size_t>(end - begin) * 2;
  for (int k = 0; k < a.n_ema + a.has_max; ++k) {
    if (a.old[k] != nullptr) std::memcpy(a.old[k] + begin, a.in[k] + begin, bytes);
    if (a.out[k] != a.in[k]) std::memcpy(a.out[k] + begin, a.in[k] + begin, bytes);
  }
  if (a.n_ema == 1) {
    uint16_t* __restrict m0 = a.out[0];
    const float ci = a.c_in[0], ck = a.c_keep[0];
    const bool sq = a.power[0] == 2;
    if (a.u != nullptr) {  // Lion's sign from the old momentum (u may be g's buffer)
      const float cg = a.c_g, cm = a.c_mu;
      for (int64_t i = begin; i < end; ++i) {
        const float gi = a.g[i], m = Bf16ToF32(m0[i]);
        const float src = sq ? gi * gi : gi;
        const float v = ci * src + ck * m;
        const float t = cg * gi + cm * m;
        m0[i] = RoundBf16<kSr>(v, noise, begin, 0, i);
        a.u[i] = SignOf(t);
      }
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const float src = sq ? g[i] * g[i] : g[i];
      const float t1 = ci * src;
      const float t2 = ck * Bf16ToF32(m0[i]);
      m0[i] = RoundBf16<kSr>(t1 + t2, noise, begin, 0, i);
    }
    return;
  }
  uint16_t* __restrict m0 = a.out[0];
  uint16_t* __restrict m1 = a.out[1];
  const float ci0 = a.c_in[0], ck0 = a.c_keep[0], ci1 = a.c_in[1], ck1 = a.c_keep[1];
  const bool sq0 = a.power[0] == 2, sq1 = a.power[1] == 2;
  if (!a.has_max) {
    if (a.u != nullptr) {  // Adam's output (u may be g's buffer)
      for (int64_t i = begin; i < end; ++i) {
        const float gi = a.g[i], gg = gi * gi;
        const float v0 = ci0 * (sq0 ? gg : gi) + ck0 * Bf16ToF32(m0[i]);
        const float v1 = ci1 * (sq1 ? gg : gi) + ck1 * Bf16ToF32(m1[i]);
        m0[i] = RoundBf16<kSr>(v0, noise, begin, 0, i);
        m1[i] = RoundBf16<kSr>(v1, noise, begin, 1, i);
        a.u[i] = AdamOut(a, v0, v1);
      }
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const float gi = g[i], gg = gi * gi;
      const float v0 = ci0 * (sq0 ? gg : gi) + ck0 * Bf16ToF32(m0[i]);
      const float v1 = ci1 * (sq1 ? gg : gi) + ck1 * Bf16ToF32(m1[i]);
      m0[i] = RoundBf16<kSr>(v0, noise, begin, 0, i);
      m1[i] = RoundBf16<kSr>(v1, noise, begin, 1, i);
    }
    return;
  }
  // The running max (AMSGrad), with and without the output in loops of their own: a store
  // under a condition (the output's) in the loop kept the compiler from vectorizing it
  // (AMSGrad's bfloat16 steps took 2.4-3.6x float32's where Adam's took 1.1-1.6x; the
  // twenty-first session, docs/memory_log.md). The divisor's quotient is taken and selected.
  uint16_t* __restrict m2 = a.out[2];
  const float d = a.divisor;
  const bool divide = a.divide != 0;
  auto moments = [&](int64_t i, float gi, float& v0, float& v1, float& v2) {
    const float gg = gi * gi;
    v0 = ci0 * (sq0 ? gg : gi) + ck0 * Bf16ToF32(m0[i]);
    v1 = ci1 * (sq1 ? gg : gi) + ck1 * Bf16ToF32(m1[i]);
    const float q = v1 / d;
    const float seen = divide ? q : v1;
    const float prev = FlushDenormal(Bf16ToF32(m2[i]));
    v2 = (prev > seen || prev != prev) ? prev : seen;
    m0[i] = RoundBf16<kSr>(v0, noise, begin, 0, i);
    m1[i] = RoundBf16<kSr>(v1, noise, begin, 1, i);
    m2[i] = RoundBf16<kSr>(v2, noise, begin, 2, i);
  };
  if (a.u != nullptr) {  // Adam's output from nu_max (den 2) or nu (u may be g's buffer)
    const bool from_nu = a.den == 1;
    for (int64_t i = begin; i < end; ++i) {
      float v0, v1, v2;
      moments(i, a.g[i], v0, v1, v2);
      a.u[i] = AdamOut(a, v0, from_nu ? v1 : v2);
    }
    return;
  }
  for (int64_t i = begin; i < end; ++i) {
    float v0, v1, v2;
    moments(i, g[i], v0, v1, v2);
  }
}

// Elements [begin, end), each rounding in loops of its own (compiled per CPU target); with
// stochastic rounding in blocks of kNoiseBlock: the block's data prefetched, its random bits
// hashed meanwhile, then the moments' loop.
OD_CLONES void EmaBf16Range(const Bf16Args& a, int64_t begin, int64_t end) {
  if (a.seed == nullptr) {
    EmaBf16RangeFor<false>(a, begin, end, nullptr);
    return;
  }
  const int n_moments = a.n_ema + a.has_max;
  uint16_t noise[3][kNoiseBlock];
  for (int64_t b = begin; b < end; b += kNoiseBlock) {
    const int64_t e = std::min(end, b + kNoiseBlock);
    for (int64_t j = b; j < e; j += 16) __builtin_prefetch(a.g + j);
    for (int k = 0; k < n_moments; ++k) {
      for (int64_t j = b; j < e; j += 32) __builtin_prefetch(a.in[k] + j);
    }
    for (int k = 0; k < n_moments; ++k) StochasticNoise(a.seed[k], b, e - b, noise[k]);
    EmaBf16RangeFor<true>(a, b, e, noise);
  }
}

ffi::Error EmaBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> coef,
                       ffi::Buffer<ffi::F32> ocoef, ffi::RemainingArgs rest,
                       ffi::RemainingRets rets, int64_t n_ema, int64_t has_max,
                       int64_t max_divide, int64_t power0, int64_t power1, int64_t emit_old,
                       int64_t out_mode, int64_t out_den, int64_t out_scale_num,
                       int64_t out_scale_den, int64_t n_after, int64_t stochastic) {
  const int64_t n_moments = n_ema + has_max;
  if (!MomentLayoutValid(n_ema, has_max, power0, power1)) {
    return ffi::Error::InvalidArgument("ema_bf16: unsupported moment layout");
  }
  if (!OutputLayoutValid(out_mode, out_den, n_ema, n_moments, ocoef) || (out_mode && emit_old)) {
    return ffi::Error::InvalidArgument("ema_bf16: unsupported output");
  }
  const size_t n_rets = static_cast<size_t>(n_moments * (emit_old ? 2 : 1) + (out_mode ? 1 : 0));
  if ((n_after != 0 && n_after != 1) || (stochastic != 0 && stochastic != 1) ||
      rest.size() != static_cast<size_t>(n_moments + stochastic + n_after) ||
      rets.size() != n_rets) {
    return ffi::Error::InvalidArgument("ema_bf16: wrong number of operands");
  }
  if (coef.element_count() != 5) {
    return ffi::Error::InvalidArgument("ema_bf16: coef must have 5 entries");
  }
  const int64_t size = static_cast<int64_t>(g.element_count());
  Bf16Args a{};
  a.g = g.typed_data();
  for (int64_t k = 0; k < n_moments; ++k) {
    auto in = rest.get<ffi::Buffer<ffi::BF16>>(k);
    auto out = rets.get<ffi::Buffer<ffi::BF16>>(k);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("ema_bf16: operand of the wrong type");
    }
    if (static_cast<int64_t>(in->element_count()) != size ||
        static_cast<int64_t>((*out)->element_count()) != size) {
      return ffi::Error::InvalidArgument("ema_bf16: moments must have the gradient's size");
    }
    a.in[k] = reinterpret_cast<const uint16_t*>(in->untyped_data());
    a.out[k] = reinterpret_cast<uint16_t*>((*out)->untyped_data());
    a.old[k] = nullptr;
    if (emit_old) {
      auto old = rets.get<ffi::Buffer<ffi::BF16>>(n_moments + k);
      if (!old.has_value() || static_cast<int64_t>((*old)->element_count()) != size) {
        return ffi::Error::InvalidArgument("ema_bf16: operand of the wrong type");
      }
      a.old[k] = reinterpret_cast<uint16_t*>((*old)->untyped_data());
    }
  }
  a.seed = nullptr;
  if (stochastic) {  // the seeds follow the moments
    auto seeds = rest.get<ffi::Buffer<ffi::U32>>(n_moments);
    if (!seeds.has_value() || static_cast<int64_t>(seeds->element_count()) != n_moments) {
      return ffi::Error::InvalidArgument("ema_bf16: seeds must be uint32, one per moment");
    }
    a.seed = seeds->typed_data();
  }
  const float* c = coef.typed_data();
  a.c_in[0] = c[0];
  a.c_keep[0] = c[1];
  a.c_in[1] = c[2];
  a.c_keep[1] = c[3];
  a.divisor = c[4];
  a.power[0] = static_cast<int>(power0);
  a.power[1] = static_cast<int>(power1);
  a.n_ema = static_cast<int>(n_ema);
  a.has_max = static_cast<int>(has_max);
  a.divide = static_cast<int>(max_divide);
  a.u = out_mode ? OutputBuffer(rets, static_cast<int64_t>(n_rets), size) : nullptr;
  if (out_mode && a.u == nullptr) {
    return ffi::Error::InvalidArgument("ema_bf16: output must be shaped like g");
  }
  if (out_mode) {
    const float* oc = ocoef.typed_data();
    a.den = static_cast<int>(out_den);
    a.scale_num = static_cast<int>(out_scale_num);
    a.scale_den = static_cast<int>(out_scale_den);
    a.inv_bc1 = 1.0f / oc[0];
    a.inv_bc2 = 1.0f / oc[1];
    a.eps = oc[2];
    a.eps_root = oc[3];
    a.c_g = oc[0];
    a.c_mu = oc[1];
  }
  for (int64_t k = 0; k < n_moments && emit_old; ++k) {
    AdviseHugePages(a.old[k], static_cast<size_t>(size) * 2);
  }
  if (a.u != nullptr && a.u != a.g) AdviseHugePages(a.u, static_cast<size_t>(size) * 4);
  constexpr int64_t kChunk = 1 << 14;
  const int64_t n_tasks = (size + kChunk - 1) / kChunk;
  ParallelFor(pool, n_tasks, [&](int64_t task) {
    ScopedFlushDenormals flush;
    EmaBf16Range(a, task * kChunk, std::min(size, (task + 1) * kChunk));
  });
  return ffi::Error::Success();
}

}  // namespace

// The exported symbols (the library is built with hidden visibility): the handler, and
// whether it decodes with AVX-512 on this CPU (unless a call asks for the portable loops).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* OdRequantizeEma(
    XLA_FFI_CallFrame* call_frame);

// The XLA FFI API version of the headers this library was compiled against, as
// major * 1000 + minor: a jaxlib older than those headers refuses the handlers when its CPU
// backend starts, which would take the whole backend down, so the loader checks first.
extern "C" __attribute__((visibility("default"))) int OdFfiApiVersion() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

// The SHA-256 of this file as setup.py built it (cpu_kernel.source_matches_build); the
// benchmarks' harnesses, which include the file, leave it unknown.
#ifndef OD_SOURCE_SHA256
#define OD_SOURCE_SHA256 "unknown"
#endif
extern "C" __attribute__((visibility("default"))) const char* OdSourceSha256() {
  return OD_SOURCE_SHA256;
}

extern "C" __attribute__((visibility("default"))) int OdUsesAvx512() {
  return CpuHasAvx512() ? 1 : 0;
}

extern "C" __attribute__((visibility("default"))) int OdUsesAvx512Vbmi() {
  return CpuHasAvx512Vbmi() ? 1 : 0;
}

// Whether the kernel's best decode and encoder on this CPU are the AVX2 ones (AVX2 without
// AVX-512).
extern "C" __attribute__((visibility("default"))) int OdUsesAvx2() {
  return CpuHasAvx2() && !CpuHasAvx512() ? 1 : 0;
}

// Whether the VBMI encoder can hold the packed encoder table `table` (cpu_kernel.encoder_table,
// `size` int32s): 1 yes, 0 no, -1 where the library has no AVX-512 code (not x86-64). For the
// tests: the kernel silently keeps the gather encoder for a table it cannot hold.
extern "C" __attribute__((visibility("default"))) int OdByteTableAccepted(const int32_t* table,
                                                                          int64_t size) {
#if defined(OD_X86_AVX512)
  if (size < kHeader || table[2] < 1 || size != kHeader + 2 * static_cast<int64_t>(table[2])) {
    return 0;
  }
  const Encoder e{nullptr, table + kHeader, table[0], table[1], table[2], table[3] ? -1.0f : 0.0f};
  return BuildByteTable(e).ok ? 1 : 0;
#else
  (void)table;
  (void)size;
  return -1;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdRequantizeEma, RequantizeEmaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gradient, any shape
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients
                                  .Arg<ffi::Buffer<ffi::F32>>()  // output coefficients
                                  .RemainingArgs()  // (map, table, codes, absmax)... [after]
                                  // (codes, absmax)... [old (codes, absmax)...] [output]
                                  .RemainingRets()
                                  .Attr<int64_t>("n_ema")
                                  .Attr<int64_t>("has_max")
                                  .Attr<int64_t>("max_divide")
                                  .Attr<int64_t>("power0")
                                  .Attr<int64_t>("power1")
                                  .Attr<int64_t>("decode_limit")
                                  .Attr<int64_t>("emit_old")
                                  .Attr<int64_t>("out_mode")
                                  .Attr<int64_t>("out_den")
                                  .Attr<int64_t>("out_scale_num")
                                  .Attr<int64_t>("out_scale_den")
                                  .Attr<int64_t>("n_after"));

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* OdEmaBf16(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(OdEmaBf16, EmaBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gradient, any shape
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients
                                  .Arg<ffi::Buffer<ffi::F32>>()  // output coefficients
                                  .RemainingArgs()  // stored moments [, seeds] [, after]
                                  .RemainingRets()  // new moments [, old copies] [, output]
                                  .Attr<int64_t>("n_ema")
                                  .Attr<int64_t>("has_max")
                                  .Attr<int64_t>("max_divide")
                                  .Attr<int64_t>("power0")
                                  .Attr<int64_t>("power1")
                                  .Attr<int64_t>("emit_old")
                                  .Attr<int64_t>("out_mode")
                                  .Attr<int64_t>("out_den")
                                  .Attr<int64_t>("out_scale_num")
                                  .Attr<int64_t>("out_scale_den")
                                  .Attr<int64_t>("n_after")
                                  .Attr<int64_t>("stochastic"));
