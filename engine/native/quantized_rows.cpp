// Products of a few rows against MLX's affine-quantized weights, on the CPU.
//
// A decode step multiplies 1 to a few rows (one token, a verify window of K+1,
// a batch of streams) by every weight matrix. MLX's CPU quantized_matmul is a
// plain loop: one 4-bit 576x1536 row took ~890 us against ~100 us in float32,
// and four rows cost four times one. Here each group of 32 weights is unpacked
// once into floats (q * scale + bias, in registers) and multiplied into every
// row of x, so a window costs about what one row costs: the time goes to
// reading the packed weights, a quarter (4-bit) or a half (8-bit) of the bytes
// of float32. AVX-512 and AVX2 paths are chosen at run time; a portable loop
// serves everywhere else.
//
// Layout (MLX's affine format, transposed product x @ W^T):
//   x       [..., K] float32
//   w       [N, K * bits / 32] uint32: value k of row n sits at bits
//           (k % (32 / bits)) * bits of word k / (32 / bits), little-endian
//   scales, biases [N, K / group] float32: w_hat = scale * q + bias
//   out     [..., N] float32
// Bits 4 and 8, groups that are multiples of 32.
//
// The product is a Primitive, so it stays in MLX's lazy graph (and inside
// mx.compile'd functions) like any other op; engine/quantized_rows.py loads it.
// The module also holds a softmax (below) whose exp is vectorized: MLX's CPU exp
// is ~6x slower, and attention and sampling spend their time in it.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>


#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MTPLXD_X86 1
#endif

#ifndef MTPLXD_STANDALONE
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;
#endif

namespace {

constexpr int CHUNK = 32;    // values unpacked at once: one group-32 scale
constexpr int ROW_BLOCK = 8; // rows of x multiplied per pass over the weights

struct Problem {
  const float* x; // [m, k]; for the vector paths see vector_x
  const uint8_t* w; // [n, k * bits / 8]
  const float* scales; // [n, k / group]
  const float* biases;
  float* out; // [m, n], rows `ld` apart
  int m, n, k, group, bits, ld;
  const float* xsum = nullptr; // one row through the factored path (below): x's sum per group

  size_t row_bytes() const { return size_t(k) * bits / 8; }
  int groups() const { return k / group; }
};

// ---- portable -------------------------------------------------------------

float unpack(const uint8_t* row, int index, int bits) {
  if (bits == 8) return float(row[index]);
  uint8_t byte = row[index / 2];
  return float((index & 1) ? (byte >> 4) : (byte & 0x0F));
}

void rows_portable(const Problem& p, int r0, int rows) {
  std::vector<double> acc(rows);
  for (int j = 0; j < p.n; ++j) {
    const uint8_t* row = p.w + j * p.row_bytes();
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int g = 0; g < p.groups(); ++g) {
      float s = p.scales[j * p.groups() + g], b = p.biases[j * p.groups() + g];
      for (int c = g * p.group; c < (g + 1) * p.group; ++c) {
        float w = s * unpack(row, c, p.bits) + b;
        for (int i = 0; i < rows; ++i) acc[i] += w * p.x[(r0 + i) * p.k + c];
      }
    }
    for (int i = 0; i < rows; ++i) p.out[(r0 + i) * p.ld + j] = float(acc[i]);
  }
}

#ifdef MTPLXD_X86

// Ask for the cache lines of [from, from + bytes): a hint, which never faults, so the
// rows past a matrix's end are asked for harmlessly.
inline void prefetch(const void* from, size_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(from) & ~uintptr_t(63), end = reinterpret_cast<uintptr_t>(from) + bytes;
  for (uintptr_t line = start; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

// ---- AVX-512 --------------------------------------------------------------

// One chunk of 32 weights of one row, as two vectors in x's order. A 4-bit value
// has 16 possible weights in a group: they are computed once (`table`, q * s + b)
// and a chunk's values only look them up, which spares the float unit the
// conversions and the multiply-adds of unpacking.
__attribute__((target("avx512f")))
inline void chunk512(const uint8_t* bytes, int bits, __m512 table, __m512 s, __m512 b, __m512& w0, __m512& w1) {
  if (bits == 4) {
    // One byte a lane, then its two nibbles: values 0, 2, ..., 30 and 1, 3, ..., 31. The
    // lookup reads only an index's low 4 bits, so the low nibble needs no mask.
    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    w0 = _mm512_permutexvar_ps(packed, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), table);
    return;
  }
  __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
  w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, b);
  w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, b);
}

// R rows of W at a time, each multiplied into M rows of x: R * M independent
// accumulators keep the multiply-adds from waiting on each other's latency when
// x has a single row, and the weights of a chunk are unpacked once for all M (and
// each chunk of x loaded once for R rows of W, when there are several).
//
// x comes chunk-major (`vector_x`): chunk c of the M rows lies at x + c * M * CHUNK, so one
// pointer reaches every row's chunk at fixed offsets. With x row-major and the loop split
// by groups, a group-32 matrix (every GGUF import's) ran one chunk a group, and the eight
// rows' addresses, the scales and the loop's own bookkeeping took more instructions than
// its 32 multiply-adds: 32-34 GMAC/s a core at 8 rows, against ~86 the core can multiply
// (docs/performance.md).
//
// The hardware prefetcher does not keep up with these reads: the 8-bit LM head
// (49,152 x 576, 28 MB) streamed at ~4.5 GB/s against ~15 from memory. So each
// chunk also asks for the same share of the next R rows (they follow these in
// memory): ~3x faster for that matrix, ~2x for a 4-bit one of one row from memory
// (harness figures in docs/performance.md).
template <int BITS, int M, int R>
__attribute__((target("avx512f")))
void rows512(const Problem& p, const float* x, int j0, int r0) {
  constexpr int CHUNK_BYTES = CHUNK * BITS / 8;
  const size_t row_bytes = p.row_bytes(), groups = p.groups();
  const int chunks = p.k / CHUNK, per_group = p.group / CHUNK;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* w = p.w + size_t(j0) * row_bytes;
  const float* scales = p.scales + size_t(j0) * groups;
  const float* biases = p.biases + size_t(j0) * groups;
  const char* next = reinterpret_cast<const char*>(w + R * row_bytes);
  prefetch(scales + R * groups, R * groups * sizeof(float));
  prefetch(biases + R * groups, R * groups * sizeof(float));
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int c = 0, g = 0, in_group = 0; c < chunks; ++c) {
    __m512 w0[R], w1[R];
    for (int r = 0; r < R; ++r) {
      if (c % (64 / CHUNK_BYTES) == 0) _mm_prefetch(next + r * row_bytes + c * CHUNK_BYTES, _MM_HINT_T0);
      const __m512 s = _mm512_set1_ps(scales[r * groups + g]), b = _mm512_set1_ps(biases[r * groups + g]);
      const __m512 table = BITS == 4 ? _mm512_fmadd_ps(iota, s, b) : s;
      chunk512(w + r * row_bytes + c * CHUNK_BYTES, BITS, table, s, b, w0[r], w1[r]);
    }
    const float* xc = x + size_t(c) * M * CHUNK;
    for (int i = 0; i < M; ++i) {
      __m512 x0 = _mm512_load_ps(xc + i * CHUNK), x1 = _mm512_load_ps(xc + i * CHUNK + 16);
      // Loaded once for the R rows of W: left alone, the compiler reads x again in each
      // multiply-add, and at 8 rows of x those loads bound the loop.
      if constexpr (R > 1) asm("" : "+v"(x0), "+v"(x1));
      for (int r = 0; r < R; ++r) {
        acc[r][i] = _mm512_fmadd_ps(w0[r], x0, acc[r][i]);
        acc[r][i] = _mm512_fmadd_ps(w1[r], x1, acc[r][i]);
      }
    }
    if (++in_group == per_group) in_group = 0, ++g;
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) p.out[size_t(r0 + i) * p.ld + j0 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int M>
__attribute__((target("avx512f")))
void block512(const Problem& p, int r0) {
  // Four weight rows share each load of x up to four rows of x, two beyond (the registers
  // hold 4 x 4 sums, not 4 x 8): in the harness 2 and 4 rows took 10-13% less than with two
  // weight rows (a verify window, a small batch), 8 rows the same.
  constexpr int R = M <= 4 ? 4 : 2;
  const float* x = p.x + size_t(r0) * p.k; // this block's rows, chunk-major
  int j = 0;
  if (p.bits == 4) {
    for (; j + R <= p.n; j += R) rows512<4, M, R>(p, x, j, r0);
    for (; j < p.n; ++j) rows512<4, M, 1>(p, x, j, r0);
  } else {
    for (; j + R <= p.n; j += R) rows512<8, M, R>(p, x, j, r0);
    for (; j < p.n; ++j) rows512<8, M, 1>(p, x, j, r0);
  }
}

// ---- one row: the product factored ---------------------------------------------------
//
// One row of x (a decode step, a draft) is bound by unpacking, not by the multiply-adds:
// the lookups above cost three shuffles (a widening and two permutes) a chunk of 32
// 4-bit weights beside two multiply-adds, and 8 bits two widenings, two conversions and
// two multiply-adds more. Here the group's affine form comes out of the sum,
//   x . w = sum_g s_g (sum_{i in g} q_i x_i) + sum_g b_g xsum_g,
// xsum_g being the group's sum of x, once per x for every row of W. And a value becomes a
// float without moving it: OR-ed into the mantissa of 1.0 where it lies in its 32-bit
// word, (1 + q 2^(p-23)) - 1 = q 2^(p-23) exactly (p its bit position), and x comes
// multiplied by 2^(23-p) (exact too), so each product is q x. A value that would reach
// bit 23 (the exponent) comes from the word shifted right (by 12 at 4 bits, 16 at 8). So
// 16 weights cost a bitwise select, a subtraction and a multiply-add, no shuffle: in the
// harness 1.15-1.2x the lookups for SmolLM2's 4-bit matrices and its 8-bit LM head
// (docs/performance.md). Rows of several x gain nothing (their multiply-adds are the
// bound, and the block sums add some), so they keep the lookups.
//
// 64 bytes (16 words) are a block: 128 values at 4 bits, 64 at 8. Lane l of the block's
// vector v holds value (32 / bits) l + v, so x is laid out in that order (`factored_x`).
// Where k % 128 == 64 at 4 bits, two rows of W, contiguous with their scales and biases,
// are one row of 2k: the pair's middle block holds the first row's last 64 values in its
// low lanes and the second's first 64 in its high lanes, and x is laid out twice over.

constexpr int BLOCK_BYTES = 64;

constexpr int block_values(int bits) { return BLOCK_BYTES * 8 / bits; }

bool factored(const Problem& p) {
  if (p.m != 1 || (p.bits != 4 && p.bits != 8) || !(p.group == 32 || p.group == 64 || p.group == 128)) return false;
  const int values = block_values(p.bits);
  return p.k % values == 0 || (p.bits == 4 && p.k % values == values / 2 && p.group <= values / 2);
}

// Blocks of x's layout: k's own, or twice k's where two rows of W make one.
int factored_blocks(int k, int bits) { return (k % block_values(bits) ? 2 * k : k) / block_values(bits); }

// The shift that brings a word's upper values below bit 20, and where vector v finds its value.
constexpr int high_shift(int bits) { return bits == 4 ? 12 : 16; }
constexpr bool from_high(int bits, int v) { return bits * (v + 1) > 23; }
constexpr int value_position(int bits, int v) { return bits * v - (from_high(bits, v) ? high_shift(bits) : 0); }

// x's one row in the blocks' order, scaled per vector, and its sums per group (zeros up to
// a multiple of 16 groups, which the bias products read). `twice` has room for 2k floats:
// x twice over, where two rows of W make one.
__attribute__((target("avx512f")))
void factored_x(const float* x, int k, int group, int bits, float* out, float* sums, float* twice) {
  const int values = block_values(bits), per_word = 32 / bits;
  const float* from_x = x;
  if (k % values) {
    std::memcpy(twice, x, k * sizeof(float));
    std::memcpy(twice + k, x, k * sizeof(float));
    from_x = twice;
  }
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(per_word));
  for (int b = 0; b < factored_blocks(k, bits); ++b)
    for (int v = 0; v < per_word; ++v) {
      const __m512 scale = _mm512_set1_ps(float(1 << (23 - value_position(bits, v)))); // a power of two: exact
      const __m512 from = _mm512_i32gather_ps(lanes, from_x + (b * values) % k + v, 4);
      _mm512_store_ps(out + b * values + v * 16, _mm512_mul_ps(from, scale));
    }
  const int groups = k / group;
  for (int g = 0; g < (groups + 15) / 16 * 16; ++g) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; g < groups && i < group; i += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(x + g * group + i));
    sums[g] = _mm512_reduce_add_ps(sum);
  }
}

// One vector v of a block: acc += (q 2^(p-23)) * (x 2^(23-p)), q the value at bit p.
template <int BITS, int V>
__attribute__((target("avx512f")))
inline __m512 factored_term(__m512i words, __m512i high, const float* x, __m512 acc) {
  const __m512i value = _mm512_set1_epi32(((1 << BITS) - 1) << value_position(BITS, V));
  const __m512i one_bits = _mm512_set1_epi32(0x3F800000);
  const __m512i bits = _mm512_ternarylogic_epi32(from_high(BITS, V) ? high : words, value, one_bits, 0xEA); // (w & value) | 1.0
  return _mm512_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.0f)), _mm512_load_ps(x + 16 * V), acc);
}

// A block's vectors of one (virtual) row, summed.
template <int BITS>
__attribute__((target("avx512f")))
inline __m512 factored_block(__m512i words, const float* x) {
  const __m512i high = _mm512_srli_epi32(words, high_shift(BITS));
  __m512 acc = factored_term<BITS, 0>(words, high, x, _mm512_setzero_ps());
  acc = factored_term<BITS, 1>(words, high, x, acc);
  acc = factored_term<BITS, 2>(words, high, x, acc);
  acc = factored_term<BITS, 3>(words, high, x, acc);
  if constexpr (BITS == 4) {
    acc = factored_term<BITS, 4>(words, high, x, acc);
    acc = factored_term<BITS, 5>(words, high, x, acc);
    acc = factored_term<BITS, 6>(words, high, x, acc);
    acc = factored_term<BITS, 7>(words, high, x, acc);
  }
  return acc;
}

// R virtual rows from j0: pairs of rows where k % 128 == 64 at 4 bits (PAIRED), rows
// otherwise; a lone row of such a matrix (an odd n's last) reads its last block masked.
// `spread`: the group of each lane of a block, counted from the block's first.
template <int BITS, int R, bool PAIRED>
__attribute__((target("avx512f")))
void rows_factored(const Problem& p, int j0, __m512i spread) {
  constexpr int ROWS = PAIRED ? 2 * R : R, VALUES = block_values(BITS);
  const size_t row_bytes = p.row_bytes();
  const int groups = p.groups(), per_block = std::max(1, VALUES / p.group);
  const int blocks = PAIRED ? 2 * p.k / VALUES : (p.k + VALUES - 1) / VALUES, middle = p.k / VALUES;
  const char* next = reinterpret_cast<const char*>(p.w + size_t(j0 + ROWS) * row_bytes);
  prefetch(p.scales + size_t(j0 + ROWS) * groups, ROWS * groups * sizeof(float));
  prefetch(p.biases + size_t(j0 + ROWS) * groups, ROWS * groups * sizeof(float));
  __m512 total[ROWS];
  for (int r = 0; r < ROWS; ++r) total[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    prefetch(next + b * R * BLOCK_BYTES, R * BLOCK_BYTES);
    const bool whole = PAIRED || (b + 1) * VALUES <= p.k;
    const int g0 = b * VALUES / p.group, here = whole ? per_block : per_block / 2;
    for (int r = 0; r < R; ++r) {
      const size_t row = size_t(j0) + (PAIRED ? 2 * r : r);
      const uint8_t* at = p.w + row * row_bytes + b * BLOCK_BYTES;
      const __m512i words = whole ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi32(0x00FF, at);
      const __m512 sums = factored_block<BITS>(words, p.x + size_t(b) * VALUES);
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(__mmask16((1u << here) - 1), p.scales + row * groups + g0));
      if (!PAIRED || b < middle) total[PAIRED ? 2 * r : r] = _mm512_fmadd_ps(sums, s, total[PAIRED ? 2 * r : r]);
      else if (b > middle) total[2 * r + 1] = _mm512_fmadd_ps(sums, s, total[2 * r + 1]);
      else {
        total[2 * r] = _mm512_mask3_fmadd_ps(sums, s, total[2 * r], 0x00FF);
        total[2 * r + 1] = _mm512_mask3_fmadd_ps(sums, s, total[2 * r + 1], 0xFF00);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const float* biases = p.biases + size_t(j0 + r) * groups;
    for (int g = 0; g < groups; g += 16) {
      const __mmask16 valid = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      total[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(valid, biases + g), _mm512_load_ps(p.xsum + g), total[r]);
    }
    p.out[j0 + r] = _mm512_reduce_add_ps(total[r]);
  }
}

template <int BITS>
__attribute__((target("avx512f")))
void factored512(const Problem& p) {
  alignas(64) int lane_group[16];
  for (int l = 0; l < 16; ++l) lane_group[l] = l * (32 / BITS) / p.group;
  const __m512i spread = _mm512_load_si512(lane_group);
  int j = 0;
  if (p.k % block_values(BITS) == 0) {
    for (; j + 4 <= p.n; j += 4) rows_factored<BITS, 4, false>(p, j, spread);
  } else {
    for (; j + 4 <= p.n; j += 4) rows_factored<BITS, 2, true>(p, j, spread);
    for (; j + 2 <= p.n; j += 2) rows_factored<BITS, 1, true>(p, j, spread);
  }
  for (; j < p.n; ++j) rows_factored<BITS, 1, false>(p, j, spread);
}

// ---- AVX2 -----------------------------------------------------------------

__attribute__((target("avx2,fma")))
inline __m256 widen(__m128i bytes, __m256 s, __m256 b) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), s, b);
}

__attribute__((target("avx2,fma")))
inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 0x55));
  return _mm_cvtss_f32(x);
}

// One row of W at a time into M rows of x, chunk-major as on the AVX-512 path (rows512):
// the chunks walked in one loop, whatever the group size.
template <int BITS, int M>
__attribute__((target("avx2,fma")))
void block256(const Problem& p, int r0) {
  constexpr int CHUNK_BYTES = CHUNK * BITS / 8;
  const int chunks = p.k / CHUNK, per_group = p.group / CHUNK, groups = p.groups();
  const float* x = p.x + size_t(r0) * p.k; // this block's rows, chunk-major
  for (int j = 0; j < p.n; ++j) {
    const uint8_t* row = p.w + j * p.row_bytes();
    const float* sj = p.scales + j * groups;
    const float* bj = p.biases + j * groups;
    const uint8_t* ahead = row + 2 * p.row_bytes();
    for (size_t off = 0; off < p.row_bytes(); off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    __m256 acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int c = 0, g = 0, in_group = 0; c < chunks; ++c) {
      const __m256 s = _mm256_set1_ps(sj[g]), b = _mm256_set1_ps(bj[g]);
      const uint8_t* bytes = row + c * CHUNK_BYTES;
      __m128i lo, hi;
      if constexpr (BITS == 4) {
        __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
        __m128i nibble = _mm_set1_epi8(0x0F);
        lo = _mm_and_si128(packed, nibble);
        hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
      } else {
        lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
        hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16));
      }
      __m256 w[4] = {widen(lo, s, b), widen(_mm_srli_si128(lo, 8), s, b),
                     widen(hi, s, b), widen(_mm_srli_si128(hi, 8), s, b)};
      const float* xc = x + size_t(c) * M * CHUNK;
      for (int i = 0; i < M; ++i)
        for (int q = 0; q < 4; ++q)
          acc[i][q & 1] = _mm256_fmadd_ps(w[q], _mm256_load_ps(xc + i * CHUNK + 8 * q), acc[i][q & 1]);
      if (++in_group == per_group) in_group = 0, ++g;
    }
    for (int i = 0; i < M; ++i) p.out[size_t(r0 + i) * p.ld + j] = hsum256(_mm256_add_ps(acc[i][0], acc[i][1]));
  }
}

#endif // MTPLXD_X86

// ---- helper threads ----------------------------------------------------------
// A product may be split over the calling thread (MLX's CPU worker) and a few helpers
// (engine/quantized_rows.py asks for one where there are two cores). Products of a decode
// step take tens of microseconds, about what waking a sleeping thread costs, so after each
// one the helpers keep watching for the next for SPIN (yielding their core to any thread
// that wants it) before they sleep: within a step, where products follow each other
// closely, they are awake.
//
// The work comes in pieces that every thread takes from one counter, the caller first.
// A helper whose core is busy elsewhere (the daemon's HTTP thread, its clients, a build)
// then takes fewer pieces or none, and the product waits only for the pieces a helper has
// begun, never for a helper to wake: with fixed equal slices, a step of 8 SmolLM2 rows took
// 2.3x its time while one other process kept a core busy. Each piece writes its own outputs
// in the same order whichever thread runs it, so results do not depend on who took what.

constexpr size_t PARALLEL_MIN_MACS = size_t(1) << 19; // smaller products stay on one thread
constexpr int PIECES_PER_THREAD = 4; // a product's pieces: enough that a late helper costs little
constexpr auto SPIN = std::chrono::microseconds(300);

class Helpers {
 public:
  int size() const { return count_; }

  // Threads in all, the caller included; started on the next product.
  void set_threads(int threads) {
    stop();
    count_ = std::max(threads, 1) - 1;
  }

  // piece(0 .. pieces - 1), each once, here and on the helpers; returns once all have run.
  void run(int pieces, const std::function<void(int)>& piece) {
    if (count_ == 0 || pieces < 2) {
      for (int i = 0; i < pieces; ++i) piece(i);
      return;
    }
    if (threads_.size() != size_t(count_)) start();
    piece_ = &piece;
    pieces_ = pieces;
    next_.store(0, std::memory_order_relaxed);
    open_.store(true);  // seq_cst, after the job: a helper that sees it open sees the job
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    take();
    // Every piece is taken; wait for the helpers inside the job (running a piece), and
    // close it so that one waking now leaves without touching it.
    open_.store(false);
    while (inside_.load() > 0) std::this_thread::yield();
  }

 private:
  void take() {
    for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < pieces_;) (*piece_)(i);
  }

  void start() {
    stop();
    stopping_ = false;
    uint64_t now = generation_.load();  // read here: a helper that read it itself could miss the first product
    for (int i = 0; i < count_; ++i) threads_.emplace_back([this, now] { work(now); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  void work(uint64_t seen) {
    for (;;) {
      auto until = std::chrono::steady_clock::now() + SPIN;
      while (generation_.load(std::memory_order_acquire) == seen && !stopping_ &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen || stopping_; });
        if (stopping_) return;
        seen = generation_.load();
      }
      // In, then look (both seq_cst, against the caller's close, then look): either this
      // helper sees the job closed, or the caller sees it inside and waits for it.
      inside_.fetch_add(1);
      if (open_.load()) take();
      inside_.fetch_sub(1);
    }
  }

  // No helpers until asked (set_threads, which the engine calls at load).
  int count_ = 0;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void(int)>* piece_ = nullptr;
  int pieces_ = 0;
  std::atomic<int> next_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> inside_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
};

Helpers& helpers = *new Helpers();

// ---- choosing a path --------------------------------------------------------

enum Level { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

Level detected() {
#ifdef MTPLXD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return PORTABLE;
}

const Level best = detected();
Level level = best; // tests lower it to check every path on one machine

#ifdef MTPLXD_X86
template <int M>
void block(const Problem& p, int r0) {
  if (level == AVX512) block512<M>(p, r0);
  else if (p.bits == 4) block256<4, M>(p, r0);
  else block256<8, M>(p, r0);
}

void rows_vector(const Problem& p, int r0, int rows) {
  switch (rows) {
    case 1: return block<1>(p, r0);
    case 2: return block<2>(p, r0);
    case 3: return block<3>(p, r0);
    case 4: return block<4>(p, r0);
    case 5: return block<5>(p, r0);
    case 6: return block<6>(p, r0);
    case 7: return block<7>(p, r0);
    default: return block<8>(p, r0);
  }
}
#endif

// The first 64-byte boundary in `storage` (which has 16 floats to spare for it).
float* aligned64(std::vector<float>& storage) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
}

// x as the vector paths read it: 64-byte aligned (they load it aligned; misaligned
// loads cost 15% at 4-8 rows), for 4 bits each chunk in the order of its nibbles
// [even values..., odd values...], and each block of ROW_BLOCK rows chunk-major
// (rows512, block256): the block from row r0 starts at r0 * k, and its chunk c of row
// i at (c * rows + i) * CHUNK from there, `rows` the block's rows.
const float* vector_x(const float* x, int m, int k, int bits, std::vector<float>& storage) {
  // One row is its own chunk-major layout: it moves only to be aligned, or for 4 bits.
  if (bits != 4 && m == 1 && reinterpret_cast<uintptr_t>(x) % 64 == 0) return x;
  storage.resize(size_t(m) * k + 16);
  float* out = aligned64(storage);
  for (int r0 = 0; r0 < m; r0 += ROW_BLOCK) {
    const int rows = std::min(ROW_BLOCK, m - r0);
    for (int i = 0; i < rows; ++i)
      for (int c = 0; c < k / CHUNK; ++c) {
        const float* from = x + size_t(r0 + i) * k + c * CHUNK;
        float* to = out + size_t(r0) * k + (size_t(c) * rows + i) * CHUNK;
        for (int v = 0; v < CHUNK; ++v) to[bits == 4 ? (v % 2) * (CHUNK / 2) + v / 2 : v] = from[v];
      }
  }
  return out;
}

#ifdef MTPLXD_X86
// One row of x laid out for the factored path, per group size and bit width (a step's
// products share x).
struct Factored {
  std::vector<std::pair<int, std::vector<float>>> prepared; // layout -> x's blocks, then its sums

  static int layout(const Problem& p) { return p.group * 16 + p.bits; }

  void prepare(Problem& p) {
    const size_t length = size_t(factored_blocks(p.k, p.bits)) * block_values(p.bits), sums = (p.k / p.group + 15) / 16 * 16;
    auto found = std::find_if(prepared.begin(), prepared.end(), [&](const auto& e) { return e.first == layout(p); });
    if (found == prepared.end()) {
      prepared.emplace_back(layout(p), std::vector<float>(length + sums + 2 * p.k + 16));
      found = prepared.end() - 1;
      float* start = aligned64(found->second);
      factored_x(p.x, p.k, p.group, p.bits, start, start + length, start + length + sums);
    }
    p.x = aligned64(found->second);
    p.xsum = p.x + length;
  }
};
#endif

// The weight rows [j0, j1) of the product: a slice of the output's columns.
Problem columns(Problem p, int j0, int j1) {
  p.w += size_t(j0) * p.row_bytes();
  p.scales += size_t(j0) * p.groups();
  p.biases += size_t(j0) * p.groups();
  p.out += j0;
  p.n = j1 - j0;
  return p;
}

void compute_columns(const Problem& p) {
#ifdef MTPLXD_X86
  if (p.xsum) return p.bits == 4 ? factored512<4>(p) : factored512<8>(p);
#endif
  for (int r0 = 0; r0 < p.m; r0 += ROW_BLOCK) {
    int rows = std::min(ROW_BLOCK, p.m - r0);
#ifdef MTPLXD_X86
    if (level != PORTABLE) {
      rows_vector(p, r0, rows);
      continue;
    }
#endif
    rows_portable(p, r0, rows);
  }
}

// Products of one x by several matrices (a block's q, k and v; its gate and up), split
// over the helper threads together: each thread takes the same share of every matrix's
// weight rows, so the three small products of q, k and v, each under PARALLEL_MIN_MACS,
// share the cores as one large product does. Every problem's x must be the same rows.
void compute_all(std::vector<Problem> ps) {
  std::vector<float> storage[2];
  const float* prepared[2] = {nullptr, nullptr}; // x as the vector paths read it, per bit width
#ifdef MTPLXD_X86
  Factored one_row; // or as the factored path reads it
#endif
  size_t macs = 0;
  for (Problem& p : ps) {
    macs += size_t(p.m) * p.n * p.k;
    if (level == PORTABLE) continue;
#ifdef MTPLXD_X86
    if (level == AVX512 && factored(p)) {
      one_row.prepare(p);
      continue;
    }
#endif
    const float*& x = prepared[p.bits == 4];
    if (!x) x = vector_x(p.x, p.m, p.k, p.bits, storage[p.bits == 4]);
    p.x = x;
  }
  if (macs < PARALLEL_MIN_MACS || helpers.size() == 0) {
    for (const Problem& p : ps) compute_columns(p);
    return;
  }
  // Pieces of whole groups of 4 weight rows (as the vector paths take them), about
  // PIECES_PER_THREAD a thread over all the problems.
  const int threads = helpers.size() + 1;
  int all_rows = 0;
  for (const Problem& p : ps) all_rows += p.n;
  const int width = std::max(4, (all_rows / (threads * PIECES_PER_THREAD) + 3) / 4 * 4);
  std::vector<Problem> pieces;
  for (const Problem& p : ps)
    for (int j0 = 0; j0 < p.n; j0 += width) pieces.push_back(columns(p, j0, std::min(p.n, j0 + width)));
  helpers.run(int(pieces.size()), [&](int i) { compute_columns(pieces[i]); });
}

void compute(const Problem& p) { compute_all({p}); }

const char* level_name(Level l) {
  return l == AVX512 ? "avx512" : l == AVX2 ? "avx2" : "portable";
}

// ---- unpacking, for prompts ------------------------------------------------------
//
// A prompt's chunk (hundreds of rows) multiplies faster with BLAS on float32 weights
// unpacked for the one product than in the kernel above; MLX's CPU dequantize takes
// ~1.5 ms for a 576 x 1536 matrix, a sixth of a 512-row product. Here: the group's
// 16 possible 4-bit weights looked up as in the kernel, then put back in order.

void dequantize_portable(const Problem& p, float* out) {
  for (int j = 0; j < p.n; ++j) {
    const uint8_t* row = p.w + j * p.row_bytes();
    for (int g = 0; g < p.groups(); ++g) {
      float s = p.scales[j * p.groups() + g], b = p.biases[j * p.groups() + g];
      for (int c = g * p.group; c < (g + 1) * p.group; ++c) out[size_t(j) * p.k + c] = s * unpack(row, c, p.bits) + b;
    }
  }
}

#ifdef MTPLXD_X86
__attribute__((target("avx512f")))
void dequantize512(const Problem& p, float* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // chunk512 gives a chunk's values as [even..., odd...]: these put them back in order
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const size_t chunk_bytes = CHUNK * p.bits / 8;
  for (int j = 0; j < p.n; ++j) {
    const uint8_t* row = p.w + j * p.row_bytes();
    float* o = out + size_t(j) * p.k;
    for (int g = 0, c = 0; g < p.groups(); ++g) {
      __m512 s = _mm512_set1_ps(p.scales[j * p.groups() + g]), b = _mm512_set1_ps(p.biases[j * p.groups() + g]);
      __m512 table = _mm512_fmadd_ps(iota, s, b);
      for (int end = c + p.group / CHUNK; c < end; ++c) {
        __m512 w0, w1;
        chunk512(row + c * chunk_bytes, p.bits, table, s, b, w0, w1);
        if (p.bits == 4) {
          _mm512_storeu_ps(o + c * CHUNK, _mm512_permutex2var_ps(w0, first, w1));
          _mm512_storeu_ps(o + c * CHUNK + 16, _mm512_permutex2var_ps(w0, second, w1));
        } else {
          _mm512_storeu_ps(o + c * CHUNK, w0);
          _mm512_storeu_ps(o + c * CHUNK + 16, w1);
        }
      }
    }
  }
}
#endif

void dequantize(const Problem& p, float* out) {
#ifdef MTPLXD_X86
  if (level == AVX512) return dequantize512(p, out);
#endif
  dequantize_portable(p, out);  // AVX2 too: the compiler vectorizes the plain loop well enough
}

// ---- softmax ----------------------------------------------------------------
//
// MLX's CPU exp costs ~19 ns an element (numpy's: ~1): attention over a long prompt
// spends seconds in it, and every decode step's attention and sampling some of a
// millisecond. A row's softmax here: its max, then exp(x - max) with the sum, then a
// scale by 1 / sum. exp(r) for r <= 0: r = n ln2 + f, |f| <= ln2 / 2, e^f by its
// degree-7 Taylor polynomial (error under 3e-9, below float32's rounding), times 2^n.
// Results below 2^-126 (x < -87.3) are 0: after the division by a sum >= 1 that is
// an error under 1.2e-38. -inf (a masked position) gives exactly 0.

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f; // ln 2 = HI + LO, HI exact in few bits
constexpr float EXP_MIN = -87.3f;

float exp_portable(float x) { return x < EXP_MIN ? 0.0f : std::exp(x); }

#ifdef MTPLXD_X86
__attribute__((target("avx512f")))
inline __m512 exp512(__m512 x) {
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~tiny, p, _mm512_castsi512_ps(two_n));  // NaN stays NaN
}

__attribute__((target("avx512f")))
float softmax_row512(const float* x, float* out, int n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 16 <= n; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  float m = _mm512_reduce_max_ps(top);
  for (; i < n; ++i) m = std::max(m, x[i]);
  __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= n; i += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift));
    _mm512_storeu_ps(out + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {  // the tail, masked: one more vector
    __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    __m512 e = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(shift, tail, x + i), shift));
    e = _mm512_maskz_mov_ps(tail, e);
    _mm512_mask_storeu_ps(out + i, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
  __m512 scale = _mm512_set1_ps(1.0f / total);
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), scale));
  for (; i < n; ++i) out[i] *= _mm512_cvtss_f32(scale);
  return total;
}

__attribute__((target("avx2,fma")))
inline __m256 exp256(__m256 x) {
  __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_LT_OQ);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), f);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

__attribute__((target("avx2,fma")))
float softmax_row256(const float* x, float* out, int n) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 8 <= n; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(x + i));
  float lanes[8], m = -INFINITY;
  _mm256_storeu_ps(lanes, top);
  for (float v : lanes) m = std::max(m, v);
  for (; i < n; ++i) m = std::max(m, x[i]);
  __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(m);
  float tail_sum = 0.0f;
  for (i = 0; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
    _mm256_storeu_ps(out + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  for (; i < n; ++i) tail_sum += out[i] = exp_portable(x[i] - m);
  const float total = hsum256(sum) + tail_sum, scale = 1.0f / total;
  for (i = 0; i < n; ++i) out[i] *= scale;
  return total;
}
#endif

// silu(gate) * x = gate / (1 + e^-gate) * x, the MLP activation of SwiGLU blocks: every
// decode step's MLPs and, over a prompt's chunk, millions of elements a layer.
constexpr float EXP_MAX = 88.0f; // e^88 is still finite: gate / (1 + e^88) is ~0, as it should be

void swiglu_portable(const float* gate, const float* x, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(std::min(-gate[i], EXP_MAX))) * x[i];
}

#ifdef MTPLXD_X86
__attribute__((target("avx512f")))
void swiglu512(const float* gate, const float* x, float* out, size_t n) {
  size_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f), top = _mm512_set1_ps(EXP_MAX);
  for (; i + 16 <= n; i += 16) {
    __m512 g = _mm512_loadu_ps(gate + i);
    __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), top));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(x + i)));
  }
  swiglu_portable(gate + i, x + i, out + i, n - i);
}

__attribute__((target("avx2,fma")))
void swiglu256(const float* gate, const float* x, float* out, size_t n) {
  size_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(EXP_MAX);
  for (; i + 8 <= n; i += 8) {
    __m256 g = _mm256_loadu_ps(gate + i);
    __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), top));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(x + i)));
  }
  swiglu_portable(gate + i, x + i, out + i, n - i);
}
#endif

void swiglu(const float* gate, const float* x, float* out, size_t n) {
#ifdef MTPLXD_X86
  if (level == AVX512) return swiglu512(gate, x, out, n);
  if (level == AVX2) return swiglu256(gate, x, out, n);
#endif
  swiglu_portable(gate, x, out, n);
}

float softmax_row_portable(const float* x, float* out, int n) {
  float m = -INFINITY;
  double sum = 0.0;  // a long row's sum, one term at a time, would drift in float32
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  for (int i = 0; i < n; ++i) sum += out[i] = exp_portable(x[i] - m);
  float scale = float(1.0 / sum);
  for (int i = 0; i < n; ++i) out[i] *= scale;
  return float(sum);
}

// The softmax of x[0 .. n) into out; returns the sum of exp(x - max x) it divided by.
float softmax_row(const float* x, float* out, int n) {
#ifdef MTPLXD_X86
  if (level == AVX512) return softmax_row512(x, out, n);
  if (level == AVX2) return softmax_row256(x, out, n);
#endif
  return softmax_row_portable(x, out, n);
}

// Rows of n scores. With `causal` > 0 the rows are attention scores of `causal` new
// positions after `offset` cached ones, repeated (heads): row r's query reads the
// first offset + r % causal + 1 keys, and the rest of its row is 0. No mask to build
// or read, and the masked scores are never exponentiated.
//
// A prompt chunk's scores (9 million a SmolLM2 layer for 512 tokens after 1,500) are split
// by rows over the helper threads; each row is one thread's, so the result is the same.
constexpr size_t SOFTMAX_PARALLEL_MIN = size_t(1) << 16; // scores; a sampling row stays on one thread

void softmax_rows(const float* x, float* out, size_t rows, int n, int causal, int offset) {
  auto rows_from = [=](size_t first, size_t end) {
    for (size_t r = first; r < end; ++r) {
      int reads = causal > 0 ? std::min(n, offset + int(r % causal) + 1) : n;
      softmax_row(x + r * n, out + r * n, reads);
      std::fill(out + r * n + reads, out + (r + 1) * n, 0.0f);
    }
  };
  const size_t threads = size_t(helpers.size()) + 1;
  if (threads == 1 || rows < 2 * threads || rows * size_t(n) < SOFTMAX_PARALLEL_MIN) return rows_from(0, rows);
  const size_t pieces = std::min(rows, threads * PIECES_PER_THREAD);
  helpers.run(int(pieces), [&](int i) { rows_from(i * rows / pieces, (i + 1) * rows / pieces); });
}

// ---- attention over a few new positions ---------------------------------------------
//
// A decode step's attention (one position, a verify window, a batch of rows) as one
// operation: scores against the cached keys, softmax, the weighted sum of the values.
// Built from MLX's operations it took seven a layer (reshapes, two products, the
// softmax), each with its dispatch cost, ~5 ms of a ~15 ms SmolLM2 token over 30 layers.
// The keys and values are read where the KV cache keeps them (a view of its buffer).

struct Attention {
  const float* q; // [B, H, L, D], already scaled
  const float* k; // [B, H_kv, T, D]
  const float* v;
  const uint8_t* mask; // bool [B or 1, 1, G * L, T] (row g * L + l: query head h * G + g), or null
  float* out; // [B, H, L, D]
  int64_t q_strides[3], k_strides[3], v_strides[3], mask_batch; // elements; the last axis is contiguous
  int batch, heads, kv_heads, length, keys, dim;
  bool causal; // query l reads keys 0 .. T - L + l (with no mask)
};

float dot_portable(const float* a, const float* b, int n) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void add_scaled_portable(float w, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

#ifdef MTPLXD_X86
__attribute__((target("avx512f")))
float dot512(const float* a, const float* b, int n) {
  __m512 sum = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
  return _mm512_reduce_add_ps(sum) + dot_portable(a + i, b + i, n - i);
}

__attribute__((target("avx512f")))
void add_scaled512(float w, const float* x, float* y, int n) {
  const __m512 scale = _mm512_set1_ps(w);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  add_scaled_portable(w, x + i, y + i, n - i);
}

__attribute__((target("avx2,fma")))
float dot256(const float* a, const float* b, int n) {
  __m256 sum = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
  return hsum256(sum) + dot_portable(a + i, b + i, n - i);
}

__attribute__((target("avx2,fma")))
void add_scaled256(float w, const float* x, float* y, int n) {
  const __m256 scale = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  add_scaled_portable(w, x + i, y + i, n - i);
}
#endif

float dot(const float* a, const float* b, int n) {
#ifdef MTPLXD_X86
  if (level == AVX512) return dot512(a, b, n);
  if (level == AVX2) return dot256(a, b, n);
#endif
  return dot_portable(a, b, n);
}

void add_scaled(float w, const float* x, float* y, int n) {
#ifdef MTPLXD_X86
  if (level == AVX512) return add_scaled512(w, x, y, n);
  if (level == AVX2) return add_scaled256(w, x, y, n);
#endif
  add_scaled_portable(w, x, y, n);
}

// One (batch row, KV head) unit: its G * L query rows (row g * L + l: query head kv * G + g
// at new position l, as the mask orders them), where each row's output goes and how many
// keys it reads.
struct Unit {
  const float* keys;
  const float* values;
  std::vector<const float*> query;
  std::vector<const uint8_t*> allowed;
  std::vector<float*> out;
  std::vector<int> reads;
};

Unit unit_of(const Attention& a, int b, int kv) {
  const int group = a.heads / a.kv_heads, rows = group * a.length;
  Unit u{a.k + b * a.k_strides[0] + kv * a.k_strides[1], a.v + b * a.v_strides[0] + kv * a.v_strides[1], {}, {}, {}, {}};
  for (int i = 0; i < rows; ++i) {
    const int g = i / a.length, l = i % a.length, head = kv * group + g;
    u.query.push_back(a.q + b * a.q_strides[0] + head * a.q_strides[1] + l * a.q_strides[2]);
    u.allowed.push_back(a.mask ? a.mask + b * a.mask_batch + int64_t(i) * a.keys : nullptr);
    u.out.push_back(a.out + ((int64_t(b) * a.heads + head) * a.length + l) * a.dim);
    u.reads.push_back(a.causal ? a.keys - a.length + l + 1 : a.keys);
  }
  return u;
}

#ifdef MTPLXD_X86
// The dot products of one query with 16 keys (`stride` apart), as one vector: 16 partial
// vectors, then folded pairwise (halves, quarters, pairs, neighbours) so that their 16
// horizontal sums take 15 additions and a permutation instead of 16 reductions.
__attribute__((target("avx512f")))
__m512 dots16(const float* q, const float* keys, int64_t stride, int dim) {
  __m512 p[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int k = 0; k < 16; ++k) p[k] = _mm512_mul_ps(q0, _mm512_loadu_ps(keys + k * stride));
  for (int d = 16; d < dim; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int k = 0; k < 16; ++k) p[k] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(keys + k * stride + d), p[k]);
  }
  __m512 s[8], r[4], u[2];
  for (int i = 0; i < 8; ++i) // keys 2i, 2i + 1: 8 partials each
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44), _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i) // keys 4i .. 4i + 3, one 128-bit lane each: 4 partials
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88), _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
  // f[4l + j] is key 4j + l
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

// The scores of q against keys[0 .. n) in blocks of 16 into row; returns how many it took.
__attribute__((target("avx512f")))
int scores512(const float* q, const float* keys, int64_t stride, int dim, int n, float* row) {
  int t = 0;
  for (; t + 16 <= n; t += 16) _mm512_storeu_ps(row + t, dots16(q, keys + t * stride, stride, dim));
  return t;
}

// out[i] = sum over t < keys of weights[i][t] * values[t], for `rows` rows (at most 4) and
// V vectors of 16 values from d0: the rows' sums stay in registers while each value is
// read once for all of them.
template <int V>
__attribute__((target("avx512f")))
void weighted_values512(const float* const* weights, int rows, int keys, const float* values, int64_t stride, int d0,
                        float* const* out) {
  __m512 acc[4][V];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < V; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int t = 0; t < keys; ++t) {
    __m512 v[V];
    for (int c = 0; c < V; ++c) v[c] = _mm512_loadu_ps(values + t * stride + d0 + 16 * c);
    for (int i = 0; i < rows; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i][t]);
      for (int c = 0; c < V; ++c) acc[i][c] = _mm512_fmadd_ps(w, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out[i] + d0 + 16 * c, acc[i][c]);
}
#endif

// The scores of row i against keys t0 .. t0 + n into `row`, masked ones -inf.
void scores_of(const Attention& a, const Unit& u, int i, int t0, int n, float* row) {
  const float* keys = u.keys + t0 * a.k_strides[2];
  int t = 0;
#ifdef MTPLXD_X86
  if (level == AVX512 && a.dim % 16 == 0) t = scores512(u.query[i], keys, a.k_strides[2], a.dim, n, row);
#endif
  for (; t < n; ++t) row[t] = dot(u.query[i], keys + t * a.k_strides[2], a.dim);
  if (u.allowed[i])
    for (t = 0; t < n; ++t)
      if (!u.allowed[i][t0 + t]) row[t] = -INFINITY;
}

// The unit's rows against keys [t0, t1): each row's softmax over the keys it reads among
// them, and its weighted values into out[i] (normalized over these keys); the largest
// score into maxes[i] and the sum of exp(score - max) into sums[i] (0 where the row reads
// none of them or all are masked: out[i] is then 0). The keys and values are read once
// for all the rows (each key and value while it sits in L1), not once per query head.
void attend_keys(const Attention& a, const Unit& u, int t0, int t1, float* const* out, float* maxes, float* sums,
                 std::vector<float>& scores) {
  const int rows = int(u.query.size()), width = t1 - t0;
  scores.assign(size_t(rows) * width, 0.0f);
  std::vector<const float*> weights(rows);
  int read = 0; // the most keys any row reads here
  for (int i = 0; i < rows; ++i) {
    float* row = scores.data() + size_t(i) * width;
    const int n = std::clamp(u.reads[i] - t0, 0, width);
    weights[i] = row;
    scores_of(a, u, i, t0, n, row);
    maxes[i] = n ? *std::max_element(row, row + n) : -INFINITY;
    sums[i] = maxes[i] == -INFINITY ? 0.0f : softmax_row(row, row, n);
    if (sums[i] == 0.0f) std::fill(row, row + n, 0.0f);
    read = std::max(read, n);
  }
  const float* values = u.values + t0 * a.v_strides[2];
#ifdef MTPLXD_X86
  if (level == AVX512 && a.dim % 16 == 0) {
    for (int i0 = 0; i0 < rows; i0 += 4) {
      const int block = std::min(4, rows - i0);
      int d0 = 0;
      for (; d0 + 64 <= a.dim; d0 += 64) weighted_values512<4>(&weights[i0], block, read, values, a.v_strides[2], d0, &out[i0]);
      for (; d0 < a.dim; d0 += 16) weighted_values512<1>(&weights[i0], block, read, values, a.v_strides[2], d0, &out[i0]);
    }
    return;
  }
#endif
  for (int i = 0; i < rows; ++i) std::fill(out[i], out[i] + a.dim, 0.0f);
  for (int t = 0; t < read; ++t)
    for (int i = 0; i < rows; ++i) add_scaled(weights[i][t], values + t * a.v_strides[2], out[i], a.dim);
}

// A long cache is attended in chunks of keys, each a separate piece of work, so that the
// helper thread can take half of one row's keys: one thread streams the keys and values
// from memory at ~10 GB/s here, two at about twice that, and after 2,000 tokens a SmolLM2
// token's attention reads 92 MB. Each chunk gives its rows' softmax over its keys; the
// chunks are then merged in order (the flash-decoding form: weights exp(max_c - max) *
// sum_c), so the result does not depend on how many threads took them.
constexpr int ATTENTION_CHUNK = 512;

// A step with this many multiply-adds and at least two pieces of work a thread is split over
// the helper threads (a step of several rows by (row, KV head), a long cache by chunks too).
// Measured on SmolLM2 (3 KV heads, 2 cores, alternated): 8 rows after 300 tokens decoded at
// 186 against 165 tok/s split, and one row after 300 tokens, which has three pieces, lost
// 10-13% when they were split 2:1 (68 against 75 tok/s); one row in chunks gained at 2^19
// (after 1,000 tokens 73 -> 89 tok/s, after 1,500 60 -> 69, medians of four runs against 2^20).
constexpr size_t ATTENTION_PARALLEL_MIN_MACS = size_t(1) << 19;

void merge_chunks(const Attention& a, const Unit& u, int chunks, const float* partial, const float* maxes,
                  const float* sums) {
  const int rows = int(u.query.size());
  for (int i = 0; i < rows; ++i) {
    float top = -INFINITY, total = 0.0f;
    for (int c = 0; c < chunks; ++c)
      if (sums[c * rows + i] > 0.0f) top = std::max(top, maxes[c * rows + i]);
    std::vector<float> weight(chunks, 0.0f);
    for (int c = 0; c < chunks; ++c)
      if (sums[c * rows + i] > 0.0f) total += weight[c] = sums[c * rows + i] * exp_portable(maxes[c * rows + i] - top);
    std::fill(u.out[i], u.out[i] + a.dim, 0.0f);
    for (int c = 0; c < chunks; ++c)
      if (weight[c] > 0.0f) add_scaled(weight[c] / total, partial + (size_t(c) * rows + i) * a.dim, u.out[i], a.dim);
  }
}

void attend(const Attention& a) {
  const int units = a.batch * a.kv_heads, rows = a.heads / a.kv_heads * a.length;
  const int chunks = std::max(1, (a.keys + ATTENTION_CHUNK - 1) / ATTENTION_CHUNK), pieces = units * chunks;
  const size_t macs = size_t(a.batch) * a.heads * a.length * a.keys * a.dim;
  const int helpers_too = helpers.size() + 1;
  const int threads = macs >= ATTENTION_PARALLEL_MIN_MACS && pieces >= 2 * helpers_too ? helpers_too : 1;
  // Chunks' results per piece: rows x dim values, then each row's max and sum.
  std::vector<float> partial(chunks > 1 ? size_t(pieces) * rows * a.dim : 0), maxes(size_t(pieces) * rows),
      sums(size_t(pieces) * rows);
  std::vector<Unit> all;
  for (int unit = 0; unit < units; ++unit) all.push_back(unit_of(a, unit / a.kv_heads, unit % a.kv_heads));
  auto run = [&](int piece) {
    thread_local std::vector<float> scores;
    thread_local std::vector<float*> out;
    out.resize(rows);
    const int unit = piece / chunks, c = piece % chunks;
    const Unit& u = all[unit];
    for (int i = 0; i < rows; ++i) out[i] = chunks == 1 ? u.out[i] : partial.data() + (size_t(piece) * rows + i) * a.dim;
    attend_keys(a, u, c * ATTENTION_CHUNK, std::min(a.keys, (c + 1) * ATTENTION_CHUNK), out.data(),
                maxes.data() + size_t(piece) * rows, sums.data() + size_t(piece) * rows, scores);
  };
  if (threads == 1)
    for (int piece = 0; piece < pieces; ++piece) run(piece);
  else
    helpers.run(pieces, run);
  if (chunks == 1) return;
  for (int unit = 0; unit < units; ++unit) {
    const size_t first = size_t(unit) * chunks * rows;
    merge_chunks(a, all[unit], chunks, partial.data() + first * a.dim,
                 maxes.data() + first, sums.data() + first);
  }
}

// ---- a decoder block around its attention, for decode steps ---------------------------
//
// A step of SmolLM2 was ~1,300 of MLX's operations a token, 43 a layer: the norms, the
// rotary embedding's slices, negations and concatenations, reshapes and transposes, the
// residual additions, beside the seven products. Each costs MLX's dispatch on the Python
// thread and on the CPU worker whatever its size, and on two cores the Python thread
// (~6 ms a token) took the core the kernel's helper would have used. So a Llama-style
// block (RMSNorm, q/k/v without biases, half-split rotary, SwiGLU MLP) is two operations
// here: its input half (norm, q, k and v, rotary, q's scale) up to the KV cache, and its
// output half (o, residual, norm, gate and up, SwiGLU, down, residual) after the
// attention. The arithmetic is the unfused graph's, in float32.

struct Linear {
  const uint8_t* w;
  const float* scales;
  const float* biases;
  const float* bias; // added to every output row, or null
  int n, k, group, bits;

  Problem times(const float* x, int m, float* out) const { return Problem{x, w, scales, biases, out, m, n, k, group, bits, n}; }

  void add_bias(float* out, int m) const {
    if (bias)
      for (int r = 0; r < m; ++r)
        for (int j = 0; j < n; ++j) out[size_t(r) * n + j] += bias[j];
  }
};

// MLX's RMSNorm, a row at a time: x / sqrt(mean(x^2) + eps) * weight.
void rms_norm_rows(const float* x, const float* weight, float eps, float* out, int rows, int d) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + size_t(r) * d;
    float* o = out + size_t(r) * d;
    const float scale = 1.0f / std::sqrt(dot(xr, xr, d) / d + eps);
    for (int i = 0; i < d; ++i) o[i] = xr[i] * scale * weight[i];
  }
}

struct BlockIn {
  const float *x, *norm, *cos, *sin; // x [B * L, D] rows; cos, sin [L or B * L, head_dim]
  const float *q_norm, *k_norm; // RMSNorm weights [head_dim] of each head of q and k (Qwen3), or null
  Linear q, k, v;
  float eps, head_eps, scale;
  int batch, length, heads, kv_heads, dim, rope_rows;
  float *q_out, *k_out, *v_out; // [B, heads, L, dim] and [B, kv_heads, L, dim]
};

// Rows [B * L, heads * dim] -> [B, heads, L, dim], rotated by the half-split rotary
// embedding (x * cos + rotate_half(x) * sin) when `rotate`, then times `scale`.
void to_heads(const BlockIn& a, const float* rows, int heads, bool rotate, float scale, float* out) {
  const int half = a.dim / 2;
  for (int b = 0; b < a.batch; ++b)
    for (int l = 0; l < a.length; ++l) {
      const int r = b * a.length + l, at = a.rope_rows == a.length ? l : r;
      const float *cos = a.cos + size_t(at) * a.dim, *sin = a.sin + size_t(at) * a.dim;
      for (int h = 0; h < heads; ++h) {
        const float* x = rows + (size_t(r) * heads + h) * a.dim;
        float* o = out + ((size_t(b) * heads + h) * a.length + l) * a.dim;
        if (!rotate) {
          std::memcpy(o, x, a.dim * sizeof(float));
          continue;
        }
        for (int i = 0; i < a.dim; ++i) {
          const float turned = i < half ? -x[i + half] : x[i - half];
          o[i] = (x[i] * cos[i] + turned * sin[i]) * scale;
        }
      }
    }
}

void block_in(const BlockIn& a) {
  const int rows = a.batch * a.length;
  std::vector<float> normed(size_t(rows) * a.q.k), q(size_t(rows) * a.q.n), k(size_t(rows) * a.k.n), v(size_t(rows) * a.v.n);
  rms_norm_rows(a.x, a.norm, a.eps, normed.data(), rows, a.q.k);
  compute_all({a.q.times(normed.data(), rows, q.data()), a.k.times(normed.data(), rows, k.data()),
               a.v.times(normed.data(), rows, v.data())});
  a.q.add_bias(q.data(), rows), a.k.add_bias(k.data(), rows), a.v.add_bias(v.data(), rows);
  if (a.q_norm) { // each head of q and k normed before the rotary (in place: a row's scale comes first)
    rms_norm_rows(q.data(), a.q_norm, a.head_eps, q.data(), rows * a.heads, a.dim);
    rms_norm_rows(k.data(), a.k_norm, a.head_eps, k.data(), rows * a.kv_heads, a.dim);
  }
  to_heads(a, q.data(), a.heads, true, a.scale, a.q_out);
  to_heads(a, k.data(), a.kv_heads, true, 1.0f, a.k_out);
  to_heads(a, v.data(), a.kv_heads, false, 1.0f, a.v_out);
}

struct BlockOut {
  const float *x, *attended, *norm; // x [B * L, D]; attended [B, heads, L, dim]
  Linear o, gate, up, down;
  float eps;
  int batch, length, heads, dim;
  float* out; // [B * L, D]
};

void block_out(const BlockOut& a) {
  const int rows = a.batch * a.length, width = a.heads * a.dim, d = a.o.n, hidden = a.gate.n;
  std::vector<float> joined(size_t(rows) * width), h(size_t(rows) * d), normed(size_t(rows) * d);
  std::vector<float> gate(size_t(rows) * hidden), up(size_t(rows) * hidden);
  for (int b = 0; b < a.batch; ++b) // [B, heads, L, dim] -> rows [B * L, heads * dim]
    for (int head = 0; head < a.heads; ++head)
      for (int l = 0; l < a.length; ++l)
        std::memcpy(joined.data() + (size_t(b * a.length + l) * a.heads + head) * a.dim,
                    a.attended + ((size_t(b) * a.heads + head) * a.length + l) * a.dim, a.dim * sizeof(float));
  compute(a.o.times(joined.data(), rows, h.data()));
  a.o.add_bias(h.data(), rows);
  for (size_t i = 0; i < h.size(); ++i) h[i] += a.x[i];
  rms_norm_rows(h.data(), a.norm, a.eps, normed.data(), rows, d);
  compute_all({a.gate.times(normed.data(), rows, gate.data()), a.up.times(normed.data(), rows, up.data())});
  a.gate.add_bias(gate.data(), rows), a.up.add_bias(up.data(), rows);
  swiglu(gate.data(), up.data(), gate.data(), gate.size());
  compute(a.down.times(gate.data(), rows, a.out));
  a.down.add_bias(a.out, rows);
  for (size_t i = 0; i < size_t(rows) * d; ++i) a.out[i] += h[i];
}

// ---- a block's step, its KV cache included ---------------------------------------------
//
// With each block as the two operations above, a SmolLM2 token was still ~8 of MLX's
// operations a layer: block_in, the cache's two slice updates and two slices (mlx-lm's
// update_and_fetch), the attention and block_out. Each costs its dispatch on the Python
// thread and on MLX's worker, and on two cores the Python thread's ~3 ms a token came out of
// the kernel's helper. So a block's decode step is one operation: its input half, its new
// keys and values written into its cache's buffer at `offset`, the attention over the
// cache, its output half. The arithmetic is that of the halves and the attention, so the
// results are theirs bit for bit.

struct CacheBuffer {
  float *keys, *values; // [B, kv_heads, capacity, dim]
  int capacity;
};

// k or v [B, kv_heads, L, dim] into positions offset .. offset + L of a cache buffer.
void store_positions(const BlockIn& a, const float* from, float* buffer, int capacity, int offset) {
  const size_t run = size_t(a.length) * a.dim;
  for (int unit = 0; unit < a.batch * a.kv_heads; ++unit)
    std::memcpy(buffer + (size_t(unit) * capacity + offset) * a.dim, from + unit * run, run * sizeof(float));
}

// The attention of q [B, heads, L, dim] over a cache's first offset + L positions: causal, or
// as `mask` allows (bool [B or 1, 1, G * L, offset + L], `mask_batch` elements a row of the
// batch, 0 for one mask for all).
Attention cached_attention(const BlockIn& a, const CacheBuffer& cache, int offset, const float* q, float* out,
                           const uint8_t* mask, int64_t mask_batch) {
  Attention at{};
  at.q = q, at.k = cache.keys, at.v = cache.values, at.out = out;
  at.q_strides[0] = int64_t(a.heads) * a.length * a.dim, at.q_strides[1] = int64_t(a.length) * a.dim;
  at.k_strides[0] = int64_t(a.kv_heads) * cache.capacity * a.dim, at.k_strides[1] = int64_t(cache.capacity) * a.dim;
  at.q_strides[2] = at.k_strides[2] = a.dim;
  std::copy(at.k_strides, at.k_strides + 3, at.v_strides);
  at.batch = a.batch, at.heads = a.heads, at.kv_heads = a.kv_heads, at.length = a.length;
  at.keys = offset + a.length, at.dim = a.dim, at.causal = !mask && a.length > 1;
  at.mask = mask, at.mask_batch = mask_batch;
  return at;
}

// The block's rows in `in.x`, out in `out.out`; the cache written at `offset`; `mask` as for
// cached_attention.
void block_step(BlockIn in, BlockOut out, const CacheBuffer& cache, int offset, const uint8_t* mask,
                int64_t mask_batch) {
  const size_t rows = size_t(in.batch) * in.length;
  std::vector<float> q(rows * in.q.n), k(rows * in.k.n), v(rows * in.v.n), attended(q.size());
  in.q_out = q.data(), in.k_out = k.data(), in.v_out = v.data();
  block_in(in);
  store_positions(in, k.data(), cache.keys, cache.capacity, offset);
  store_positions(in, v.data(), cache.values, cache.capacity, offset);
  attend(cached_attention(in, cache, offset, q.data(), attended.data(), mask, mask_batch));
  out.x = in.x, out.attended = attended.data();
  block_out(out);
}

// ---- the k largest values of each row -------------------------------------------
//
// Top-p sampling seeks its cut among a row's 512 most probable tokens (engine/sampling.py);
// MLX's CPU topk partitions the whole row and took ~0.6 ms of a 49,152-token row, two thirds
// of the filter. Here each value gets an unsigned key in the same order (its bits, the
// sign's meaning turned around), a histogram of the keys' top 12 bits finds the bucket that
// holds the k-th largest, the buckets above it are taken whole, and the bucket itself gives
// the rest by a partial selection: two passes over the row and a few values sorted.

constexpr int TOP_BUCKET_SHIFT = 20; // 4,096 buckets

inline uint32_t order_key(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// The k largest of row[0 .. n) into out[0 .. k), in no particular order (k <= n).
void top_values_row(const float* row, int n, int k, float* out, std::vector<float>& boundary) {
  std::vector<int> counts(size_t(1) << (32 - TOP_BUCKET_SHIFT), 0);
  for (int i = 0; i < n; ++i) ++counts[order_key(row[i]) >> TOP_BUCKET_SHIFT];
  int bucket = int(counts.size()) - 1, above = 0;
  for (; above + counts[bucket] < k; --bucket) above += counts[bucket];
  boundary.clear();
  int taken = 0;
  for (int i = 0; i < n; ++i) {
    const int b = int(order_key(row[i]) >> TOP_BUCKET_SHIFT);
    if (b > bucket) out[taken++] = row[i];
    else if (b == bucket) boundary.push_back(row[i]);
  }
  const int rest = k - above;
  std::nth_element(boundary.begin(), boundary.begin() + (rest - 1), boundary.end(),
                   [](float a, float b) { return order_key(a) > order_key(b); });
  std::copy(boundary.begin(), boundary.begin() + rest, out + taken);
}

#ifndef MTPLXD_STANDALONE
// ---- the MLX primitive ------------------------------------------------------

// The elements of `a` in row-major order: its own buffer when it is laid out so, else a
// copy into `copy`. Weights are; an input may be a view (a transposed x, a cache's buffer
// cut to its positions). Copying here rather than adding MLX's `contiguous` to the graph
// spares four operations a product, each with its dispatch cost. The copy goes a run of
// the last axis at a time (one memcpy where that axis is contiguous, as in a cut buffer):
// element by element, the first step after a batch's row left took 430 ms, not 30.
template <class T>
const T* row_major(const mx::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  copy.resize(a.size());
  const T* source = a.data<T>();
  const int outer = int(a.ndim()) - 1;
  const int64_t run = a.shape(outer), stride = a.strides()[outer];
  std::vector<int> index(outer, 0);
  for (size_t i = 0; i < a.size(); i += run) {
    int64_t offset = 0;
    for (int d = 0; d < outer; ++d) offset += int64_t(index[d]) * a.strides()[d];
    if (stride == 1)
      std::memcpy(copy.data() + i, source + offset, size_t(run) * sizeof(T));
    else
      for (int64_t v = 0; v < run; ++v) copy[i + v] = source[offset + v * stride];
    for (int d = outer - 1; d >= 0 && ++index[d] == a.shape(d); --d) index[d] = 0;
  }
  return copy.data();
}

// What the module's primitives share: they run on the CPU only, each as one task on
// MLX's CPU thread. Their inputs are computed by earlier tasks, so the task reads them
// (copied to row-major order where strided), and its copies of the arrays keep their
// buffers alive until it has run.
using Data = std::vector<const void*>;

// The first `count` arrays' elements (all where none is given) in row-major order (4-byte
// elements): their own buffers, or copies kept in `copies` for strided ones.
Data row_major_data(const std::vector<mx::array>& arrays, std::vector<std::vector<uint32_t>>& copies,
                    size_t count = SIZE_MAX) {
  count = std::min(count, arrays.size());
  copies.resize(count);
  Data data(count);
  for (size_t i = 0; i < count; ++i) data[i] = row_major(arrays[i], copies[i]);
  return data;
}

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  // Allocates the outputs (but those given an input's buffer) and queues task(inputs, outputs):
  // a task that reads the arrays itself.
  template <class Task>
  void dispatch_arrays(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Task task) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    std::vector<mx::array> outs;
    for (auto& out : outputs) {
      if (!out.data_shared_ptr()) out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    encoder.dispatch([inputs, outs, task = std::move(task)]() mutable { task(inputs, outs); });
  }

  // Allocates the one output and queues task(the inputs' row-major data, out).
  template <class Task>
  void dispatch(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Task task) {
    dispatch_arrays(inputs, outputs, [task = std::move(task)](const std::vector<mx::array>& arrays,
                                                             std::vector<mx::array>& out) mutable {
      std::vector<std::vector<uint32_t>> copies;
      task(row_major_data(arrays, copies), out[0]);
    });
  }
};

class QuantizedRows : public CpuPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group, int bits) : CpuPrimitive(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    int k = inputs[0].shape(-1), n = inputs[1].shape(0);
    Problem p{nullptr, nullptr, nullptr, nullptr, nullptr, int(inputs[0].size() / k), n, k, group_, bits_, n};
    dispatch(inputs, outputs, [p](const Data& data, mx::array& out) mutable {
      p.x = static_cast<const float*>(data[0]);
      p.w = static_cast<const uint8_t*>(data[1]);
      p.scales = static_cast<const float*>(data[2]);
      p.biases = static_cast<const float*>(data[3]);
      p.out = out.data<float>();
      compute(p);
    });
  }

  const char* name() const override { return "QuantizedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedRows&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_, bits_;
};

class Dequantize : public CpuPrimitive {
 public:
  Dequantize(mx::Stream stream, int group, int bits) : CpuPrimitive(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    Problem p{nullptr, nullptr, nullptr, nullptr, nullptr, 0, outputs[0].shape(0), outputs[0].shape(1), group_, bits_, 0};
    dispatch(inputs, outputs, [p](const Data& data, mx::array& out) mutable {
      p.w = static_cast<const uint8_t*>(data[0]);
      p.scales = static_cast<const float*>(data[1]);
      p.biases = static_cast<const float*>(data[2]);
      dequantize(p, out.data<float>());
    });
  }

  const char* name() const override { return "DequantizeRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Dequantize&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), int(inputs[0].shape(1) * 32 / bits_)}};
  }

 private:
  int group_, bits_;
};

class SwiGLU : public CpuPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [](const Data& data, mx::array& out) {
      swiglu(static_cast<const float*>(data[0]), static_cast<const float*>(data[1]), out.data<float>(), out.size());
    });
  }

  const char* name() const override { return "SwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

mx::array swiglu_op(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape())
    throw std::invalid_argument("swiglu: gate and x must be float32 arrays of one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(mx::default_stream(mx::Device::cpu)),
                   std::vector<mx::array>{gate, x});
}

class Softmax : public CpuPrimitive {
 public:
  Softmax(mx::Stream stream, int causal, int offset) : CpuPrimitive(stream), causal_(causal), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    int n = inputs[0].shape(-1);
    size_t rows = n ? inputs[0].size() / n : 0;
    dispatch(inputs, outputs, [n, rows, causal = causal_, offset = offset_](const Data& data, mx::array& out) {
      softmax_rows(static_cast<const float*>(data[0]), out.data<float>(), rows, n, causal, offset);
    });
  }

  const char* name() const override { return "Softmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Softmax&>(other);
    return causal_ == o.causal_ && offset_ == o.offset_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int causal_, offset_;
};

mx::array softmax(const mx::array& x, int causal, int offset) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || (causal > 0 && x.ndim() < 2))
    throw std::invalid_argument("softmax: x must be float32 [..., N]");
  if (causal < 0 || offset < 0 || (causal > 0 && x.shape(-2) % causal != 0))
    throw std::invalid_argument("softmax: causal rows must divide the rows, offset must be >= 0");
  auto primitive = std::make_shared<Softmax>(mx::default_stream(mx::Device::cpu), causal, offset);
  return mx::array(x.shape(), mx::float32, primitive, std::vector<mx::array>{x});
}

class TopValues : public CpuPrimitive {
 public:
  TopValues(mx::Stream stream, int k) : CpuPrimitive(stream), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int n = inputs[0].shape(-1);
    const size_t rows = inputs[0].size() / n;
    dispatch(inputs, outputs, [n, rows, k = k_](const Data& data, mx::array& out) {
      std::vector<float> boundary;
      for (size_t r = 0; r < rows; ++r)
        top_values_row(static_cast<const float*>(data[0]) + r * n, n, k, out.data<float>() + r * k, boundary);
    });
  }

  const char* name() const override { return "TopValues"; }
  bool is_equivalent(const mx::Primitive& other) const override { return k_ == static_cast<const TopValues&>(other).k_; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = k_;
    return {shape};
  }

 private:
  int k_;
};

mx::array top_values(const mx::array& x, int k) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.size() == 0)
    throw std::invalid_argument("top_values: x must be a non-empty float32 array [..., N]");
  if (k < 1 || k > x.shape(-1)) throw std::invalid_argument("top_values: k must be in 1 .. N");
  mx::Shape shape = x.shape();
  shape.back() = k;
  return mx::array(shape, mx::float32, std::make_shared<TopValues>(mx::default_stream(mx::Device::cpu), k),
                   std::vector<mx::array>{x});
}

// q, k, v as `attend` reads them: where the last axis is contiguous (a view of the KV
// cache's buffer is) the array's own data and strides, else a row-major copy.
const float* attention_view(const mx::array& a, int64_t strides[3], std::vector<float>& copy) {
  if (a.strides().back() == 1) {
    for (int d = 0; d < 3; ++d) strides[d] = a.strides()[d];
    return a.data<float>();
  }
  const float* data = row_major(a, copy);
  strides[2] = a.shape(3);
  strides[1] = strides[2] * a.shape(2);
  strides[0] = strides[1] * a.shape(1);
  return data;
}

class AttentionPrimitive : public CpuPrimitive {
 public:
  AttentionPrimitive(mx::Stream stream, bool causal) : CpuPrimitive(stream), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_arrays(inputs, outputs, [causal = causal_](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
      mx::array& out = outs[0];
      const mx::array &q = in[0], &k = in[1];
      std::vector<float> copies[3];
      std::vector<uint8_t> mask_copy;
      Attention a{};
      a.q = attention_view(q, a.q_strides, copies[0]);
      a.k = attention_view(k, a.k_strides, copies[1]);
      a.v = attention_view(in[2], a.v_strides, copies[2]);
      a.out = out.data<float>();
      a.batch = q.shape(0), a.heads = q.shape(1), a.length = q.shape(2), a.dim = q.shape(3);
      a.kv_heads = k.shape(1), a.keys = k.shape(2), a.causal = causal;
      if (in.size() > 3) {
        const mx::array& mask = in[3];
        a.mask = reinterpret_cast<const uint8_t*>(row_major(mask, mask_copy));
        a.mask_batch = mask.ndim() == 4 && mask.shape(0) > 1 ? int64_t(mask.size() / mask.shape(0)) : 0;
      }
      attend(a);
    });
  }

  const char* name() const override { return "Attention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return causal_ == static_cast<const AttentionPrimitive&>(other).causal_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  bool causal_;
};

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, std::optional<mx::array> mask,
                    bool causal) {
  auto fail = [](const std::string& message) { throw std::invalid_argument("attention: " + message); };
  for (const mx::array* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4) fail("q, k and v must be float32 [B, heads, positions, D]");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || q.shape(1) % k.shape(1) != 0)
    fail("k and v must be [B, kv_heads, T, D] with kv_heads dividing q's heads");
  if (q.shape(2) > k.shape(2)) fail("more new positions than keys");
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    int rows = q.shape(1) / k.shape(1) * q.shape(2);
    bool shaped = (mask->ndim() == 2 && mask->shape(0) == rows)
                  || (mask->ndim() == 4 && (mask->shape(0) == 1 || mask->shape(0) == q.shape(0))
                      && mask->shape(1) == 1 && mask->shape(2) == rows);
    if (mask->dtype() != mx::bool_ || !shaped || mask->shape(-1) != k.shape(2))
      fail("the mask must be bool [G * L, T] or [B, 1, G * L, T]");
    if (causal) fail("a mask or causal, not both");
    inputs.push_back(*mask);
  }
  auto primitive = std::make_shared<AttentionPrimitive>(mx::default_stream(mx::Device::cpu), causal);
  return mx::array(q.shape(), mx::float32, primitive, std::move(inputs));
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("quantized_rows: " + message);
}

void require_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                     int bits) {
  require(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  require(group_size > 0 && group_size % CHUNK == 0, "group_size must be a multiple of 32");
  require(scales.dtype() == mx::float32 && biases.dtype() == mx::float32, "scales and biases must be float32");
  require(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be uint32 [N, K * bits / 32]");
  int n = w.shape(0), k = w.shape(1) * 32 / bits;
  require(k % group_size == 0, "K must be a multiple of group_size");
  mx::Shape groups{n, k / group_size};
  require(scales.shape() == groups && biases.shape() == groups, "scales and biases must be [N, K / group_size]");
}

// A block operation's products, in order: each is w, scales, biases and, where its layout
// says so, an added bias, among the inputs from `next` on; layouts: group size, bits and
// whether there is a bias, three ints a product.
constexpr int LAYOUT = 3;

std::vector<Linear> linears_of(const std::vector<mx::array>& arrays, const Data& data, size_t next,
                               const std::vector<int>& layouts) {
  std::vector<Linear> linears;
  for (size_t i = 0; i < layouts.size(); i += LAYOUT) {
    const int group = layouts[i], bits = layouts[i + 1];
    const mx::array& w = arrays[next];
    linears.push_back(Linear{static_cast<const uint8_t*>(data[next]), static_cast<const float*>(data[next + 1]),
                             static_cast<const float*>(data[next + 2]),
                             layouts[i + 2] ? static_cast<const float*>(data[next + 3]) : nullptr, w.shape(0),
                             int(w.shape(1) * 32 / bits), group, bits});
    next += layouts[i + 2] ? 4 : 3;
  }
  return linears;
}

// Inputs: x, norm, cos, sin, the head norms of q and k where there are (Qwen3), then the weights of q, k and v
// (linears_of).
class BlockInPrimitive : public CpuPrimitive {
 public:
  BlockInPrimitive(mx::Stream stream, float eps, float scale, int length, std::vector<int> layouts, bool head_norms,
                   float head_eps)
      : CpuPrimitive(stream), eps_(eps), scale_(scale), length_(length), layouts_(std::move(layouts)),
        head_norms_(head_norms), head_eps_(head_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_arrays(inputs, outputs, [eps = eps_, scale = scale_, length = length_, layouts = layouts_,
                                      head_norms = head_norms_, head_eps = head_eps_](
                                                    const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<std::vector<uint32_t>> copies;
      const Data data = row_major_data(in, copies);
      BlockIn a{};
      a.x = static_cast<const float*>(data[0]);
      a.norm = static_cast<const float*>(data[1]);
      a.cos = static_cast<const float*>(data[2]);
      a.sin = static_cast<const float*>(data[3]);
      if (head_norms) {
        a.q_norm = static_cast<const float*>(data[4]);
        a.k_norm = static_cast<const float*>(data[5]);
      }
      const std::vector<Linear> linears = linears_of(in, data, head_norms ? 6 : 4, layouts);
      a.q = linears[0], a.k = linears[1], a.v = linears[2];
      a.eps = eps, a.head_eps = head_eps, a.scale = scale, a.length = length, a.batch = out[0].shape(0);
      a.heads = out[0].shape(1), a.kv_heads = out[1].shape(1), a.dim = out[0].shape(3), a.rope_rows = in[2].shape(0);
      a.q_out = out[0].data<float>(), a.k_out = out[1].data<float>(), a.v_out = out[2].data<float>();
      block_in(a);
    });
  }

  const char* name() const override { return "BlockIn"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const BlockInPrimitive&>(other);
    return eps_ == o.eps_ && scale_ == o.scale_ && length_ == o.length_ && layouts_ == o.layouts_ &&
           head_norms_ == o.head_norms_ && head_eps_ == o.head_eps_;
  }

 private:
  float eps_, scale_;
  int length_;
  std::vector<int> layouts_;
  bool head_norms_;
  float head_eps_;
};

// Inputs: x, attended, norm, then the weights of o, gate, up and down (linears_of).
class BlockOutPrimitive : public CpuPrimitive {
 public:
  BlockOutPrimitive(mx::Stream stream, float eps, std::vector<int> layouts)
      : CpuPrimitive(stream), eps_(eps), layouts_(std::move(layouts)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_arrays(inputs, outputs, [eps = eps_, layouts = layouts_](const std::vector<mx::array>& in,
                                                                                 std::vector<mx::array>& out) {
      std::vector<std::vector<uint32_t>> copies;
      const Data data = row_major_data(in, copies);
      const mx::array& attended = in[1];
      BlockOut a{};
      a.x = static_cast<const float*>(data[0]);
      a.attended = static_cast<const float*>(data[1]);
      a.norm = static_cast<const float*>(data[2]);
      const std::vector<Linear> linears = linears_of(in, data, 3, layouts);
      a.o = linears[0], a.gate = linears[1], a.up = linears[2], a.down = linears[3];
      a.eps = eps, a.batch = attended.shape(0), a.heads = attended.shape(1), a.length = attended.shape(2);
      a.dim = attended.shape(3), a.out = out[0].data<float>();
      block_out(a);
    });
  }

  const char* name() const override { return "BlockOut"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const BlockOutPrimitive&>(other);
    return eps_ == o.eps_ && layouts_ == o.layouts_;
  }

 private:
  float eps_;
  std::vector<int> layouts_;
};

void require_block(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("block: " + message);
}

// Each of `count` products' weights checked against its layout; returns the index of
// each product's w in `weights`.
std::vector<size_t> check_block_weights(const std::vector<mx::array>& weights, const std::vector<int>& layouts,
                                        size_t count) {
  require_block(layouts.size() == LAYOUT * count,
                "layouts must be group size, bits and 0 or 1 (a bias follows) for each product");
  std::vector<size_t> first;
  size_t next = 0;
  for (size_t i = 0; i < count; ++i) {
    const int group = layouts[LAYOUT * i], bits = layouts[LAYOUT * i + 1], bias = layouts[LAYOUT * i + 2];
    require_block(next + (bias ? 4 : 3) <= weights.size(), "fewer weights than the layouts say");
    require_weights(weights[next], weights[next + 1], weights[next + 2], group, bits);
    if (bias)
      require_block(weights[next + 3].dtype() == mx::float32 && weights[next + 3].shape() == mx::Shape{weights[next].shape(0)},
                    "a bias must be float32 [N]");
    first.push_back(next);
    next += bias ? 4 : 3;
  }
  require_block(next == weights.size(), "more weights than the layouts say");
  return first;
}

int columns_of(const mx::array& w, int bits) { return int(w.shape(1) * 32 / bits); }

// block_in's inputs checked; returns head_dim.
int check_block_in(const mx::array& x, const mx::array& norm, const std::vector<mx::array>& weights,
                   const std::vector<int>& layouts, const mx::array& cos, const mx::array& sin, int heads, int kv_heads,
                   int length, const std::vector<mx::array>& head_norms) {
  const std::vector<size_t> at = check_block_weights(weights, layouts, 3);
  const mx::array &wq = weights[at[0]], &wk = weights[at[1]], &wv = weights[at[2]];
  require_block(x.dtype() == mx::float32 && x.ndim() == 2 && length > 0 && x.shape(0) % length == 0,
                "x must be float32 rows [B * L, D]");
  const int d = x.shape(1);
  for (int i = 0; i < 3; ++i)
    require_block(columns_of(weights[at[i]], layouts[LAYOUT * i + 1]) == d, "q, k and v must take the rows' width");
  require_block(heads > 0 && kv_heads > 0 && wq.shape(0) % heads == 0, "heads must divide q's width");
  const int dim = wq.shape(0) / heads;
  require_block(dim % 2 == 0 && wk.shape(0) == kv_heads * dim && wv.shape(0) == kv_heads * dim,
                "k and v must be kv_heads x head_dim wide");
  require_block(norm.dtype() == mx::float32 && norm.shape() == mx::Shape{d}, "norm must be float32 [D]");
  for (const mx::array* t : {&cos, &sin})
    require_block(t->dtype() == mx::float32 && t->ndim() == 2 && t->shape(1) == dim
                      && (t->shape(0) == length || t->shape(0) == x.shape(0)),
                  "cos and sin must be float32 [L or B * L, head_dim]");
  require_block(head_norms.empty() || head_norms.size() == 2, "head_norms must be none, or q's and k's");
  for (const mx::array& n : head_norms)
    require_block(n.dtype() == mx::float32 && n.shape() == mx::Shape{dim}, "a head norm must be float32 [head_dim]");
  return dim;
}

// block_out's weights checked for rows of width d and attended rows of width `width`.
void check_block_out(int d, int width, const mx::array& norm, const std::vector<mx::array>& weights,
                     const std::vector<int>& layouts) {
  const std::vector<size_t> at = check_block_weights(weights, layouts, 4);
  const mx::array &wo = weights[at[0]], &wg = weights[at[1]], &wu = weights[at[2]], &wd = weights[at[3]];
  auto columns = [&](const mx::array& w, int i) { return columns_of(w, layouts[LAYOUT * i + 1]); };
  require_block(columns(wo, 0) == width && wo.shape(0) == d, "o must take heads x head_dim to D");
  require_block(columns(wg, 1) == d && columns(wu, 2) == d && wg.shape(0) == wu.shape(0),
                "gate and up must take D to one width");
  require_block(columns(wd, 3) == wg.shape(0) && wd.shape(0) == d, "down must take that width back to D");
  require_block(norm.dtype() == mx::float32 && norm.shape() == mx::Shape{d}, "norm must be float32 [D]");
}

std::vector<mx::array> block_in_op(const mx::array& x, const mx::array& norm, float eps, const std::vector<mx::array>& weights,
                                   const std::vector<int>& layouts, const mx::array& cos, const mx::array& sin, int heads,
                                   int kv_heads, int length, float scale, const std::vector<mx::array>& head_norms,
                                   float head_eps) {
  const int dim = check_block_in(x, norm, weights, layouts, cos, sin, heads, kv_heads, length, head_norms);
  const int batch = x.shape(0) / length;
  std::vector<mx::array> inputs{x, norm, cos, sin};
  inputs.insert(inputs.end(), head_norms.begin(), head_norms.end());
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  auto primitive = std::make_shared<BlockInPrimitive>(mx::default_stream(mx::Device::cpu), eps, scale, length, layouts,
                                                      !head_norms.empty(), head_eps);
  return mx::array::make_arrays({{batch, heads, length, dim}, {batch, kv_heads, length, dim}, {batch, kv_heads, length, dim}},
                                {mx::float32, mx::float32, mx::float32}, primitive, inputs);
}

mx::array block_out_op(const mx::array& x, const mx::array& attended, const mx::array& norm, float eps,
                       const std::vector<mx::array>& weights, const std::vector<int>& layouts) {
  require_block(x.dtype() == mx::float32 && x.ndim() == 2, "x must be float32 rows [B * L, D]");
  require_block(attended.dtype() == mx::float32 && attended.ndim() == 4
                    && attended.shape(0) * attended.shape(2) == x.shape(0),
                "attended must be float32 [B, heads, L, head_dim] with B * L rows of x");
  check_block_out(x.shape(1), attended.shape(1) * attended.shape(3), norm, weights, layouts);
  std::vector<mx::array> inputs{x, attended, norm};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  auto primitive = std::make_shared<BlockOutPrimitive>(mx::default_stream(mx::Device::cpu), eps, layouts);
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}

// A block's settings for block_step_op (engine/backends/decode_ops.py passes them as a tuple); its
// arrays are, in order: the input norm, q's and k's head norms where `head_norms`, the weights of
// q, k and v, the output norm, the weights of o, gate, up and down.
struct BlockPlan {
  int heads, kv_heads;
  float scale, eps_in, eps_out, head_eps;
  bool head_norms;
  std::vector<int> layouts_in, layouts_out;

  size_t arrays() const { return 2 + (head_norms ? 2 : 0) + weights(layouts_in) + weights(layouts_out); }

  static size_t weights(const std::vector<int>& layouts) {
    size_t count = 0;
    for (size_t i = 0; i + LAYOUT <= layouts.size(); i += LAYOUT) count += layouts[i + 2] ? 4 : 3;
    return count;
  }

  using Tuple = std::tuple<int, int, float, float, float, float, bool, std::vector<int>, std::vector<int>>;

  static BlockPlan of(const Tuple& t) {
    return BlockPlan{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
                     std::get<5>(t), std::get<6>(t), std::get<7>(t), std::get<8>(t)};
  }

  bool operator==(const BlockPlan& o) const {
    return heads == o.heads && kv_heads == o.kv_heads && scale == o.scale && eps_in == o.eps_in &&
           eps_out == o.eps_out && head_eps == o.head_eps && head_norms == o.head_norms &&
           layouts_in == o.layouts_in && layouts_out == o.layouts_out;
  }
};

// Inputs: x, cos, sin, the block's arrays (BlockPlan), its keys and values, then the mask where
// there is one. Outputs: the rows, then the keys and values: the cache's buffers with the
// step's positions written, in place where nothing else holds them (as MLX's slice update
// does), else into a copy.
class BlockStepPrimitive : public CpuPrimitive {
 public:
  BlockStepPrimitive(mx::Stream stream, BlockPlan plan, int offset, int length, bool masked)
      : CpuPrimitive(stream), plan_(std::move(plan)), offset_(offset), length_(length), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Each output holds its own copy of the inputs (MLX's make_arrays), which would keep the
    // cache's buffers from being donated; the outputs other than the one evaluated drop theirs
    // now, as MLX drops them all once the step has run (array::detach).
    for (auto& out : outputs)
      if (&out.inputs() != &inputs) out.inputs().clear();
    const size_t cache = inputs.size() - 2 - masked_;
    bool donated[2];
    for (int i = 0; i < 2; ++i) {
      const mx::array& old = inputs[cache + i];
      donated[i] = old.is_donatable() && old.flags().row_contiguous;
      if (donated[i]) outputs[1 + i].copy_shared_buffer(old);
    }
    dispatch_arrays(inputs, outputs, [plan = plan_, offset = offset_, length = length_, cache, masked = masked_,
                                      copy = std::vector<bool>{!donated[0], !donated[1]}](
                                         const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<std::vector<uint32_t>> copies;
      const Data data = row_major_data(in, copies, cache + 2);
      std::vector<uint8_t> mask_copy;
      const uint8_t* mask = masked ? row_major(in.back(), mask_copy) : nullptr;
      const int64_t mask_batch = masked && in.back().shape(0) > 1 ? int64_t(in.back().size() / in.back().shape(0)) : 0;
      for (int i = 0; i < 2; ++i)
        if (copy[i]) std::memcpy(out[1 + i].data<float>(), data[cache + i], out[1 + i].nbytes());
      size_t next = 3;
      BlockIn a = block_in_of(plan, in, data, next, length);
      BlockOut o = block_out_of(plan, in, data, next, a);
      o.out = out[0].data<float>();
      block_step(a, o, CacheBuffer{out[1].data<float>(), out[2].data<float>(), out[1].shape(2)}, offset, mask,
                 mask_batch);
    });
  }

  const char* name() const override { return "BlockStep"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const BlockStepPrimitive&>(other);
    return plan_ == o.plan_ && offset_ == o.offset_ && length_ == o.length_ && masked_ == o.masked_;
  }

 private:
  // The block's input half from its arrays at `next` on; moves `next` past the arrays it read.
  static BlockIn block_in_of(const BlockPlan& p, const std::vector<mx::array>& in, const Data& data, size_t& next,
                             int length) {
    BlockIn a{};
    a.x = static_cast<const float*>(data[0]);
    a.cos = static_cast<const float*>(data[1]), a.sin = static_cast<const float*>(data[2]), a.rope_rows = in[1].shape(0);
    a.norm = static_cast<const float*>(data[next++]);
    if (p.head_norms) {
      a.q_norm = static_cast<const float*>(data[next++]);
      a.k_norm = static_cast<const float*>(data[next++]);
    }
    const std::vector<Linear> linears = linears_of(in, data, next, p.layouts_in);
    next += BlockPlan::weights(p.layouts_in);
    a.q = linears[0], a.k = linears[1], a.v = linears[2];
    a.eps = p.eps_in, a.head_eps = p.head_eps, a.scale = p.scale, a.length = length;
    a.batch = in[0].shape(0) / length, a.heads = p.heads, a.kv_heads = p.kv_heads, a.dim = a.q.n / p.heads;
    return a;
  }

  static BlockOut block_out_of(const BlockPlan& p, const std::vector<mx::array>& in, const Data& data, size_t& next,
                               const BlockIn& a) {
    BlockOut o{};
    o.norm = static_cast<const float*>(data[next++]);
    const std::vector<Linear> linears = linears_of(in, data, next, p.layouts_out);
    o.o = linears[0], o.gate = linears[1], o.up = linears[2], o.down = linears[3];
    o.eps = p.eps_out, o.batch = a.batch, o.length = a.length, o.heads = a.heads, o.dim = a.dim;
    return o;
  }

  BlockPlan plan_;
  int offset_, length_;
  bool masked_;
};

// Rows x [B * L, D] through a block at positions offset .. offset + L - 1 of its cache's buffers
// [B, kv_heads, capacity, head_dim], its keys and values written there (cos and sin [L or B * L,
// head_dim]: each row's own positions, for a batch of rows); the attention causal, or as `mask`
// allows (bool [B or 1, 1, G * L, offset + L]: a batch's rows, left-padded). Returns the rows,
// the new keys and values.
std::vector<mx::array> block_step_op(const mx::array& x, const mx::array& cos, const mx::array& sin, int offset,
                                     const BlockPlan::Tuple& settings, const std::vector<mx::array>& arrays,
                                     const mx::array& keys, const mx::array& values, std::optional<mx::array> mask) {
  const BlockPlan plan = BlockPlan::of(settings);
  require_block(x.ndim() == 2 && keys.ndim() == 4 && keys.shape(0) > 0 && x.shape(0) % keys.shape(0) == 0 && offset >= 0,
                "x must be rows [B * L, D] for keys [B, kv_heads, capacity, head_dim], offset >= 0");
  const int length = x.shape(0) / keys.shape(0);
  require_block(arrays.size() == plan.arrays(),
                "the block has " + std::to_string(arrays.size()) + " arrays, its plan takes " + std::to_string(plan.arrays()));
  const size_t first_in = plan.head_norms ? 3 : 1, out_norm = first_in + BlockPlan::weights(plan.layouts_in);
  const std::vector<mx::array> head_norms(arrays.begin() + 1, arrays.begin() + first_in),
      weights_in(arrays.begin() + first_in, arrays.begin() + out_norm), weights_out(arrays.begin() + out_norm + 1, arrays.end());
  const int dim = check_block_in(x, arrays[0], weights_in, plan.layouts_in, cos, sin, plan.heads, plan.kv_heads, length,
                                 head_norms);
  check_block_out(x.shape(1), plan.heads * dim, arrays[out_norm], weights_out, plan.layouts_out);
  for (const mx::array* c : {&keys, &values})
    require_block(c->dtype() == mx::float32 && c->shape(0) * length == x.shape(0) && c->shape(1) == plan.kv_heads
                      && c->shape(3) == dim && offset + length <= c->shape(2),
                  "keys and values must be float32 [B, kv_heads, capacity, head_dim] with room for the step");
  if (mask)
    require_block(mask->dtype() == mx::bool_ && mask->ndim() == 4 && (mask->shape(0) == 1 || mask->shape(0) == keys.shape(0))
                      && mask->shape(1) == 1 && mask->shape(2) == plan.heads / plan.kv_heads * length
                      && mask->shape(3) == offset + length,
                  "the mask must be bool [B or 1, 1, G * L, offset + L]");
  std::vector<mx::array> inputs{x, cos, sin};
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  inputs.push_back(keys), inputs.push_back(values);
  if (mask) inputs.push_back(*mask);
  auto primitive = std::make_shared<BlockStepPrimitive>(mx::default_stream(mx::Device::cpu), plan, offset, length,
                                                        mask.has_value());
  return mx::array::make_arrays({x.shape(), keys.shape(), values.shape()}, {mx::float32, mx::float32, mx::float32},
                                primitive, inputs);
}

// ---- a batch cache's rows laid out anew ---------------------------------------

// Where output row r of each array comes from: row `row` of source set `set`, its columns
// start .. start + count - 1, written at column `at`; the output's other columns are 0.
struct RowPlace {
  int set, row, start, count, at;
};

// Inputs: `sets` sets of `arrays` float32 arrays [B, H, C, D] each (a batch cache's layers'
// keys and values; a joining row's). Outputs: per array, [rows, H, width, D], row r as
// places[r] says. One task over the helpers, a memcpy a row and head: as MLX operations a
// row joining 7 SmolLM2 rows was 64 copies (pad, concatenate) of 1-4 GB/s on one thread.
class RowsLaidOutPrimitive : public CpuPrimitive {
 public:
  RowsLaidOutPrimitive(mx::Stream stream, std::vector<RowPlace> places, int arrays, int width)
      : CpuPrimitive(stream), places_(std::move(places)), arrays_(arrays), width_(width) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_arrays(inputs, outputs, [places = places_, arrays = arrays_, width = width_](
                                         const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<std::vector<uint32_t>> copies;
      const Data data = row_major_data(in, copies);
      const int rows = int(places.size());
      helpers.run(int(out.size()) * rows, [&](int piece) {
        const int i = piece / rows;
        const RowPlace& p = places[piece % rows];
        const mx::array& source = in[size_t(p.set) * arrays + i];
        const int64_t heads = source.shape(1), columns = source.shape(2), dim = source.shape(3);
        const float* from = static_cast<const float*>(data[size_t(p.set) * arrays + i]) + p.row * heads * columns * dim;
        float* to = out[i].data<float>() + (piece % rows) * heads * width * dim;
        for (int64_t h = 0; h < heads; ++h, to += width * dim) {
          std::memset(to, 0, size_t(p.at * dim) * sizeof(float));
          std::memcpy(to + p.at * dim, from + (h * columns + p.start) * dim, size_t(p.count * dim) * sizeof(float));
          std::memset(to + (p.at + p.count) * dim, 0, size_t((width - p.at - p.count) * dim) * sizeof(float));
        }
      });
    });
  }

  const char* name() const override { return "RowsLaidOut"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RowsLaidOutPrimitive&>(other);
    return arrays_ == o.arrays_ && width_ == o.width_ && places_.size() == o.places_.size()
           && std::equal(places_.begin(), places_.end(), o.places_.begin(), [](const RowPlace& a, const RowPlace& b) {
                return a.set == b.set && a.row == b.row && a.start == b.start && a.count == b.count && a.at == b.at;
              });
  }

 private:
  std::vector<RowPlace> places_;
  int arrays_, width_;
};

std::vector<mx::array> rows_laid_out(const std::vector<std::vector<mx::array>>& sets,
                                     const std::vector<std::tuple<int, int, int, int, int>>& places, int width) {
  require(!sets.empty() && !sets[0].empty() && !places.empty() && width > 0, "nothing to lay out");
  const size_t arrays = sets[0].size();
  std::vector<mx::array> inputs;
  for (const auto& set : sets) {
    require(set.size() == arrays, "every set must hold as many arrays");
    for (size_t i = 0; i < arrays; ++i) {
      const mx::array& a = set[i];
      require(a.dtype() == mx::float32 && a.ndim() == 4 && a.shape(1) == sets[0][i].shape(1)
                  && a.shape(3) == sets[0][i].shape(3),
              "array " + std::to_string(i) + " of every set must be float32 [B, H, C, D] with the first set's H and D");
      inputs.push_back(a);
    }
  }
  std::vector<RowPlace> placed;
  for (const auto& [set, row, start, count, at] : places) {
    require(set >= 0 && size_t(set) < sets.size(), "a place names a set that is not there");
    for (const auto& a : sets[set])
      require(row >= 0 && row < a.shape(0) && start >= 0 && count >= 0 && start + count <= a.shape(2) && at >= 0
                  && at + count <= width,
              "a place reads outside its source or writes outside the width");
    placed.push_back(RowPlace{set, row, start, count, at});
  }
  std::vector<mx::Shape> shapes;
  for (const auto& a : sets[0]) shapes.push_back({int(places.size()), a.shape(1), width, a.shape(3)});
  auto primitive = std::make_shared<RowsLaidOutPrimitive>(mx::default_stream(mx::Device::cpu), std::move(placed),
                                                          int(arrays), width);
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(arrays, mx::float32), primitive, inputs);
}

mx::array dequantize_rows(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                          int bits) {
  require_weights(w, scales, biases, group_size, bits);
  mx::Shape shape{w.shape(0), int(w.shape(1) * 32 / bits)};
  return mx::array(shape, mx::float32,
                   std::make_shared<Dequantize>(mx::default_stream(mx::Device::cpu), group_size, bits),
                   std::vector<mx::array>{w, scales, biases});
}

mx::array quantized_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits) {
  require_weights(w, scales, biases, group_size, bits);
  require(x.dtype() == mx::float32 && x.ndim() >= 1, "x must be float32");
  int n = w.shape(0), k = w.shape(1) * 32 / bits;
  require(x.shape(-1) == k, "x has " + std::to_string(x.shape(-1)) + " columns, w holds " + std::to_string(k));
  auto stream = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = n;
  return mx::array(shape, mx::float32, std::make_shared<QuantizedRows>(stream, group_size, bits),
                   std::vector<mx::array>{x, w, scales, biases});
}

#endif
} // namespace

#ifndef MTPLXD_STANDALONE
NB_MODULE(_mtplxd_quantized_rows, m) {
  nb::module_::import_("mlx.core");
  m.def("quantized_rows", &quantized_rows, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"),
        "x [..., K] @ dequantize(w, scales, biases)^T on the CPU, for MLX's affine 4- and 8-bit weights.");
  m.def("dequantize", &dequantize_rows, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"), "MLX's affine 4- and 8-bit weights unpacked to float32 [N, K], on the CPU.");
  m.def("swiglu", &swiglu_op, nb::arg("gate"), nb::arg("x"),
        "silu(gate) * x for float32 arrays of one shape, on the CPU, with a vectorized exp.");
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("causal") = 0, nb::arg("offset") = 0,
        "Softmax over the last axis of a float32 array on the CPU, with a vectorized exp. With causal = L:\n"
        "attention scores of L new positions after `offset` cached ones, rows (heads, L): row r reads\n"
        "its first offset + r % L + 1 columns, the rest is 0.");
  m.def("top_values", &top_values, nb::arg("x"), nb::arg("k"),
        "The k largest values of each row of a float32 array [..., N] on the CPU, in no particular\n"
        "order (the values of mx.topk(x, k, axis=-1)). Returns [..., k].");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask") = nb::none(),
        nb::arg("causal") = false,
        "Attention of L new positions on the CPU: q [B, H, L, D] (already scaled), k and v [B, H_kv, T, D]\n"
        "(views welcome); mask bool [G * L, T] or [B, 1, G * L, T] (True: may attend), or causal: query l\n"
        "reads keys 0 .. T - L + l. Returns [B, H, L, D].");
  m.def("block_in", &block_in_op, nb::arg("x"), nb::arg("norm"), nb::arg("eps"), nb::arg("weights"), nb::arg("layouts"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("length"), nb::arg("scale"),
        nb::arg("head_norms") = std::vector<mx::array>{}, nb::arg("head_eps") = 0.0f,
        "A Llama-style block's input half on the CPU: rows x [B * L, D] -> RMSNorm(x, norm, eps) -> q, k, v\n"
        "(weights: w, scales, biases and an optional bias of each; layouts: group size, bits, 1 if a bias), each head\n"
        "of q and k RMSNormed by head_norms (q's, k's weights [head_dim], head_eps; Qwen3) where given, rotated (half-split,\n"
        "cos and sin [L or B * L, head_dim]), q times scale. Returns q [B, heads, L, head_dim], k, v [B, kv_heads, L, head_dim].");
  m.def("block_out", &block_out_op, nb::arg("x"), nb::arg("attended"), nb::arg("norm"), nb::arg("eps"),
        nb::arg("weights"), nb::arg("layouts"),
        "A Llama-style block's output half on the CPU: h = x + o(attended as rows), then\n"
        "h + down(silu(gate(n)) * up(n)) with n = RMSNorm(h, norm, eps); weights and layouts of o, gate,\n"
        "up and down as for block_in. Returns rows [B * L, D].");
  m.def("block_step", &block_step_op, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("offset"), nb::arg("plan"),
        nb::arg("arrays"), nb::arg("keys"), nb::arg("values"), nb::arg("mask") = nb::none(),
        "Rows x [B * L, D] through a Llama-style block on the CPU: block_in, the new keys and values written into\n"
        "the cache's buffers [B, kv_heads, capacity, head_dim] at offset .. offset + L - 1, attention over the first\n"
        "offset + L positions (causal, or where mask, bool [B or 1, 1, G * L, offset + L], is True), block_out.\n"
        "cos, sin [L or B * L, head_dim]; the block's plan (heads, kv_heads,\n"
        "q's scale, the two norms' eps, the head norms' eps, whether it has head norms, the layouts of q, k and v\n"
        "and of o, gate, up and down as for block_in) and arrays (its\n"
        "input norm, q's and k's head norms where it has them, q, k and v's weights, its output norm, o, gate, up\n"
        "and down's weights). Returns the rows, the keys and the values (the buffers, written in place where\n"
        "nothing else holds them).");
  m.def("rows_laid_out", &rows_laid_out, nb::arg("sets"), nb::arg("places"), nb::arg("width"),
        "A batch cache's buffers with rows joined or left, on the CPU: sets of float32 arrays [B, H, C, D] (array i\n"
        "of each set alike in H and D) -> per array i, [len(places), H, width, D], whose row r is, for places[r] =\n"
        "(set, row, start, count, at), row `row` of set `set`'s array i, columns start .. start + count - 1, written\n"
        "at column `at`; every other column 0.");
  m.def("kernel", []() { return std::string(level_name(level)); }, "The path in use: avx512, avx2 or portable.");
  m.def("threads", []() { return helpers.size() + 1; }, "Threads a large product runs on, the caller included.");
  m.def("set_threads", [](int threads) { helpers.set_threads(threads); },
        "Run large products on this many threads (the caller included; 1: no helpers).");
  m.def("paths", []() {
    std::vector<std::string> names;
    for (int l = best; l >= PORTABLE; --l) names.push_back(level_name(Level(l)));
    return names;
  }, "The paths this CPU can run, the widest first.");
  m.def("set_kernel", [](const std::string& name) {
    for (int l = best; l >= PORTABLE; --l)
      if (name == level_name(Level(l))) {
        level = Level(l);
        return;
      }
    throw std::invalid_argument(name + " is not a path this CPU can run (best: " + level_name(best) + ")");
  }, "Use a given path (avx512, avx2, portable), up to the widest this CPU has.");
}
#endif
