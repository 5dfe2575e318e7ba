// The exact int8 linear layer in one call: a row's quantisation, its integer sums and the rescale.
//
// It computes what models/exact.py's Int8Linear computes with torch ops, bit for bit: every float
// operation below is the same IEEE operation on the same operands (a product, a reciprocal, a
// round-to-nearest-even), built without contraction into fused multiply-adds, and the sums are
// integers, exact in any order. What it saves is the calls: about fifteen small ATen ops a layer,
// and _int_mm's per-call cost, which on a few rows runs far below the memory's speed.
//
// The sums use AVX-512 VNNI (vpdpbusd: four u8 x s8 products into an int32 lane, without
// saturation). The weights are kept shifted by 128 into u8, so each row's four activations can be
// broadcast straight from memory as the signed operand; 128 times the row's integer sum is taken
// off again after. Machines without VNNI keep the torch path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

constexpr int64_t COLS = 16;  // output columns a block: one zmm of int32 sums
constexpr int64_t DEPTH = 4;  // inner products per lane per vpdpbusd
constexpr int CHUNK = 8;  // tokens whose sums share one pass over a block's weights (16 zmm with hi and lo)
constexpr double FIXED = 1048576.0;  // exact.FIXED: queries', keys' and values' fixed-point levels
constexpr int64_t GRAIN = 32768;  // exact.GRAIN
constexpr int64_t LANES = 32;  // exact.LANES

int64_t blocks(int64_t n) { return (n + COLS - 1) / COLS; }
int64_t depth(int64_t k) { return (k + DEPTH - 1) / DEPTH; }

}  // namespace

bool available() {
#ifdef SPECDEC_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// (N, K) int8 rows -> (blocks(N), depth(K) * 64) uint8, each weight + 128: for each block of 16
// columns and each group of 4 inner positions, the 16 columns' 4 weights side by side (vpdpbusd's
// layout). Padding holds 128, a weight of 0.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8, "pack takes (N, K) int8 rows");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = blocks(n), k4 = depth(k);
  auto out = torch::full({nb, k4 * COLS * DEPTH}, 128, w.options().dtype(torch::kUInt8));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t b = col / COLS, j = col % COLS;
    for (int64_t i = 0; i < k; ++i) {
      dst[b * k4 * COLS * DEPTH + (i / DEPTH) * COLS * DEPTH + j * DEPTH + i % DEPTH] =
          static_cast<uint8_t>(src[col * k + i] + 128);
    }
  }
  return out;
}

#ifdef SPECDEC_X86
namespace {

// The int32 sums of R rows against one block of 16 columns, still shifted: out[r][c] = Σ x[r]·(w[c] + 128).
// x is interleaved (depth(K), R, 4): each group's R broadcasts sit at constant offsets from one pointer.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void block_sums(
    const int8_t* x, const uint8_t* w, int64_t k4, int32_t (*out)[COLS]) {
  __m512i acc[R];  // local, so the sums stay in registers across the whole inner dimension
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < k4; ++g) {
    const __m512i wv = _mm512_loadu_si512(w + g * COLS * DEPTH);
    const int32_t* xg = reinterpret_cast<const int32_t*>(x + g * R * DEPTH);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], wv, _mm512_set1_epi32(xg[r]));
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_store_si512(out[r], acc[r]);
}

using BlockFn = void (*)(const int8_t*, const uint8_t*, int64_t, int32_t (*)[COLS]);

BlockFn block_fn(int rows) {
  switch (rows) {
#define SPECDEC_CASE(R) \
  case R:               \
    return &block_sums<R>;
    SPECDEC_CASE(1) SPECDEC_CASE(2) SPECDEC_CASE(3) SPECDEC_CASE(4) SPECDEC_CASE(5) SPECDEC_CASE(6)
    SPECDEC_CASE(7) SPECDEC_CASE(8) SPECDEC_CASE(9) SPECDEC_CASE(10) SPECDEC_CASE(11) SPECDEC_CASE(12)
    SPECDEC_CASE(13) SPECDEC_CASE(14) SPECDEC_CASE(15) SPECDEC_CASE(16)
#undef SPECDEC_CASE
  }
  return nullptr;
}

struct Job {
  const int8_t* xq;  // the rows' integers (hi and lo, or the row itself), interleaved a chunk of tokens at a time
  const int32_t* shifts;  // (T, parts) 128 times each row's integer sum
  const float* steps;  // (T,) each row's step
  const uint8_t* ws;  // packed weights
  const float* scale;  // (N,) each column's scale
  const float* bias;  // (N,) or null
  float* ys;  // (T, N) out
  int64_t t, n, k4, row_bytes;
  int parts;
  int64_t half;
  bool wide;
};

// Column blocks b0..b1-1 of the output: the integer sums, then exact.Int8Linear's rescale.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void run_blocks(const Job& j, int64_t b0, int64_t b1) {
  alignas(64) int32_t lanes[2 * CHUNK][COLS];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = j.ws + b * j.k4 * COLS * DEPTH;
    const int64_t c0 = b * COLS, cols = std::min(COLS, j.n - c0);
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(live, j.scale + c0);
    const __m512 bias = j.bias ? _mm512_maskz_loadu_ps(live, j.bias + c0) : _mm512_setzero_ps();
    for (int64_t r0 = 0; r0 < j.t; r0 += CHUNK) {
      const int tokens = static_cast<int>(std::min<int64_t>(CHUNK, j.t - r0));
      block_fn(tokens * j.parts)(j.xq + r0 * j.parts * j.row_bytes, wb, j.k4, lanes);
      for (int r = 0; r < tokens; ++r) {
        const int64_t row = r0 + r;
        float* out = j.ys + row * j.n + c0;
        if (j.wide && j.parts == 2) {  // int64 sums: rows past about 1,000 inputs at 15 bits, one by one
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t hi = int64_t{lanes[2 * r][c]} - j.shifts[2 * row];
            const int64_t lo = int64_t{lanes[2 * r + 1][c]} - j.shifts[2 * row + 1];
            volatile float v = static_cast<float>(lo + hi * j.half) * j.steps[row];
            volatile float scaled = v * j.scale[c0 + c];
            out[c] = j.bias ? scaled + j.bias[c0 + c] : scaled;
          }
          continue;
        }
        __m512i sums;
        if (j.parts == 1) {
          sums = _mm512_sub_epi32(_mm512_load_si512(lanes[r]), _mm512_set1_epi32(j.shifts[row]));
        } else {
          const __m512i hi = _mm512_sub_epi32(_mm512_load_si512(lanes[2 * r]), _mm512_set1_epi32(j.shifts[2 * row]));
          const __m512i lo =
              _mm512_sub_epi32(_mm512_load_si512(lanes[2 * r + 1]), _mm512_set1_epi32(j.shifts[2 * row + 1]));
          sums = _mm512_add_epi32(lo, _mm512_mullo_epi32(hi, _mm512_set1_epi32(static_cast<int32_t>(j.half))));
        }
        // separate products and sum, never fused (-ffp-contract=off): torch's mul, mul_ and add_
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(j.steps[row])), scale);
        if (j.bias) y = _mm512_add_ps(y, bias);
        _mm512_mask_storeu_ps(out, live, y);
      }
    }
  }
}


// Each row as integers, the same operations as exact.split in float32: step = max(amax, 1e-30) ·
// (1/(127·half)), q = round(x · (1/step)), and with half > 0, hi = round(q · (1/half)), lo = q − hi·half.
// Rounding is to nearest even, as torch's round_. Also 128 times each row's integer sum (the u8 shift).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void quantise(const float* xs, int64_t t, int64_t k,
                                                                      int64_t row_bytes, int64_t half, int8_t* xq,
                                                                      int32_t* shifts, float* steps) {
  const int parts = half > 0 ? 2 : 1;
  const float per_level = static_cast<float>(1.0 / (127.0 * static_cast<double>(half > 0 ? half : 1)));
  const __m512 inv_half = _mm512_set1_ps(half > 0 ? static_cast<float>(1.0 / static_cast<double>(half)) : 0.0f);
  const __m512 half_f = _mm512_set1_ps(static_cast<float>(half));
  const float least = static_cast<float>(1e-30);
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = 0; r < t; ++r) {
    const float* row = xs + r * k;
    __m512 peaks = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffff : (1u << (k - i)) - 1);
      peaks = _mm512_max_ps(peaks, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + i)));
    }
    const float peak = _mm512_reduce_max_ps(peaks);
    volatile float step = (peak < least ? least : peak) * per_level;  // volatile: rounded here, as torch's mul_
    const __m512 recip = _mm512_set1_ps(1.0f / step);
    steps[r] = step;
    int8_t* out = xq + r * parts * row_bytes;
    __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffff : (1u << (k - i)) - 1);
      const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), recip), NEAREST);
      if (parts == 1) {
        const __m512i qi = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(q));
        sum_hi = _mm512_add_epi32(sum_hi, qi);
        _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(qi));
      } else {
        const __m512 hi = _mm512_roundscale_ps(_mm512_mul_ps(q, inv_half), NEAREST);
        const __m512 lo = _mm512_sub_ps(q, _mm512_mul_ps(hi, half_f));  // exact: small integers
        const __m512i hi_i = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(hi));
        const __m512i lo_i = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(lo));
        sum_hi = _mm512_add_epi32(sum_hi, hi_i);
        sum_lo = _mm512_add_epi32(sum_lo, lo_i);
        _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(hi_i));
        _mm_mask_storeu_epi8(out + row_bytes + i, m, _mm512_cvtepi32_epi8(lo_i));
      }
    }
    shifts[r * parts] = 128 * _mm512_reduce_add_epi32(sum_hi);
    if (parts == 2) shifts[r * parts + 1] = 128 * _mm512_reduce_add_epi32(sum_lo);
  }
}

}  // namespace
#endif

// Rows (T, parts, row_bytes) -> for each chunk of CHUNK tokens, (depth(K), rows of the chunk, 4):
// block_sums's layout. A chunk starts where its rows started.
void interleave(std::vector<int8_t>& xq, int64_t t, int parts, int64_t row_bytes) {
  std::vector<int8_t> out(xq.size());
  for (int64_t r0 = 0; r0 < t; r0 += CHUNK) {
    const int64_t rows = std::min<int64_t>(CHUNK, t - r0) * parts;
    const int8_t* src = xq.data() + r0 * parts * row_bytes;
    int8_t* dst = out.data() + r0 * parts * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < row_bytes / DEPTH; ++g) {
        __builtin_memcpy(dst + (g * rows + r) * DEPTH, src + r * row_bytes + g * DEPTH, DEPTH);
      }
    }
  }
  xq.swap(out);
}

// (T, K) float32 rows -> (T, N) float32: x Wᵀ in the exact precision. `half` > 0 splits each row's
// 15-bit integers into hi·half + lo (Int8Linear with split=True), 0 takes the row as int8; `wide`
// combines hi and lo in int64 (rows too long for int32 at that half).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                     int64_t n, int64_t half, bool wide) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the int8 kernel needs an x86-64 CPU with AVX-512 VNNI");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear takes (T, K) float32 rows");
  x = x.contiguous();
  const int64_t t = x.size(0), k = x.size(1), k4 = depth(k), nb = blocks(n);
  TORCH_CHECK(packed.size(0) == nb && packed.size(1) == k4 * COLS * DEPTH, "packed weights of another shape");
  const int parts = half > 0 ? 2 : 1;
  const int64_t row_bytes = k4 * DEPTH;
  std::vector<int8_t> xq(static_cast<size_t>(t * parts * row_bytes), 0);
  std::vector<int32_t> shifts(static_cast<size_t>(t * parts));
  std::vector<float> steps(static_cast<size_t>(t));
  quantise(x.data_ptr<float>(), t, k, row_bytes, half, xq.data(), shifts.data(), steps.data());
  interleave(xq, t, parts, row_bytes);
  auto y = torch::empty({t, n}, x.options());
  const Job job{xq.data(),
                shifts.data(),
                steps.data(),
                packed.data_ptr<uint8_t>(),
                scale.data_ptr<float>(),
                bias.has_value() ? bias->data_ptr<float>() : nullptr,
                y.data_ptr<float>(),
                t,
                n,
                k4,
                row_bytes,
                parts,
                half,
                wide};
  at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) { run_blocks(job, b0, b1); });
  return y;
#endif
}


#ifdef SPECDEC_X86
namespace {


// Scores of one query row against keys j0..j0+7, integers in float64: Σ_c q[c]·Kt[c][j]. Every
// partial sum is an integer below 2**53, so the order (and fusing each product) cannot change it.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) __m512d dots8(const double* q, const double* kt,
                                                                              int64_t stride, int64_t d) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  int64_t c = 0;
  for (; c + 2 <= d; c += 2) {
    acc0 = _mm512_fmadd_pd(_mm512_set1_pd(q[c]), _mm512_loadu_pd(kt + c * stride), acc0);
    acc1 = _mm512_fmadd_pd(_mm512_set1_pd(q[c + 1]), _mm512_loadu_pd(kt + (c + 1) * stride), acc1);
  }
  if (c < d) acc0 = _mm512_fmadd_pd(_mm512_set1_pd(q[c]), _mm512_loadu_pd(kt + c * stride), acc0);
  return _mm512_add_pd(acc0, acc1);
}

// acc[0..8·V) += Σ_j w[j] · v[j][0..8·V), integers in float64 (exact in any order, as dots8); rows of
// v are `stride` apart. V is fixed, so the sums stay in registers.
template <int V>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void weighted(const double* w, const double* v,
                                                                               int64_t stride, int64_t s, double* out) {
  __m512d acc[V];
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) acc[i] = _mm512_setzero_pd();
  for (int64_t j = 0; j < s; ++j) {
    if (w[j] == 0.0) continue;
    const __m512d wj = _mm512_set1_pd(w[j]);
    const double* vj = v + j * stride;
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) acc[i] = _mm512_fmadd_pd(wj, _mm512_loadu_pd(vj + 8 * i), acc[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) _mm512_storeu_pd(out + 8 * i, acc[i]);
}

void weighted_any(const double* w, const double* v, int64_t stride, int64_t s, int64_t d, double* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0;
  for (int64_t j = 0; j < s; ++j) {
    if (w[j] == 0.0) continue;
    for (int64_t c = 0; c < d; ++c) out[c] += w[j] * v[j * stride + c];
  }
}

}  // namespace
#endif

#ifdef SPECDEC_X86
namespace {

struct Attend {
  const float* qs;  // (B, H, T, D) queries
  const double* ks;  // (B, Hkv, S, D + 1) keys in fixed point, their step last: the cache's view, strided
  const double* vs;  // values, as keys
  int64_t k_strides[3], v_strides[3];  // the views' strides over B, Hkv and S (D + 1 is contiguous)
  const bool* mask;  // (B, 1, T, S - first), or null
  double* sc;  // (B·Hkv, group·T, S) scores, then their exp
  double* kts;  // (B·Hkv, D, S8) keys' integers transposed
  double* k_steps;  // (B·Hkv, S8)
  double* v_steps;  // (B·Hkv, S8)
  double* v_ints;  // (B·Hkv, S, D) values' integers, rows 64-byte aligned
  double* q_int;  // (B·Hkv, group·T, D)
  double* q_step;  // (B·Hkv, group·T)
  float* os;  // (B, T, H, D) out
  int64_t heads, kv_heads, group, t, s, s8, d, first;
  double scaling, levels;
};

void transpose_keys(const Attend& a, int64_t n0, int64_t n1) {
  for (int64_t nn = n0; nn < n1; ++nn) {
    const int64_t bb = nn / a.kv_heads, head = nn % a.kv_heads;
    for (int64_t j = 0; j < a.s; ++j) {
      const double* kj = a.ks + bb * a.k_strides[0] + head * a.k_strides[1] + j * a.k_strides[2];
      for (int64_t c = 0; c < a.d; ++c) a.kts[(nn * a.d + c) * a.s8 + j] = kj[c];
      a.k_steps[nn * a.s8 + j] = kj[a.d];
      const double* vj = a.vs + bb * a.v_strides[0] + head * a.v_strides[1] + j * a.v_strides[2];
      std::copy(vj, vj + a.d, a.v_ints + (nn * a.s + j) * a.d);
      a.v_steps[nn * a.s8 + j] = vj[a.d];
    }
  }
}

// Rows r0..r1-1 (row r: kv head r / (group·T), query head g = (r mod group·T) / T, position i):
// the query in fixed point (exact.fixed), its scores (integer sums, then · (q_step · scaling) · key
// step, each rounded as torch's mul_), the mask, and minus the row's max.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void score_rows(const Attend& a, int64_t r0,
                                                                                int64_t r1) {
  const int64_t rows = a.group * a.t, d = a.d;
  alignas(64) double lane[8];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t nn = r / rows, gi = r % rows, g = gi / a.t, i = gi % a.t;
    const int64_t bb = nn / a.kv_heads, h = (nn % a.kv_heads) * a.group + g;
    const float* x = a.qs + ((bb * a.heads + h) * a.t + i) * d;
    double peak = 1e-300;
    for (int64_t c = 0; c < d; ++c) {
      const double m = std::fabs(static_cast<double>(x[c]));
      peak = m > peak ? m : peak;
    }
    volatile double inv = 1.0 / peak;  // levels / peak is torch's reciprocal, then the product
    volatile double per = inv * FIXED;
    double* q = a.q_int + r * d;
    for (int64_t c = 0; c < d; ++c) {
      volatile double scaled = static_cast<double>(x[c]) * per;
      q[c] = std::nearbyint(static_cast<double>(scaled));
    }
    a.q_step[r] = peak * (1.0 / FIXED);
    const __m512d factor = _mm512_set1_pd(a.q_step[r] * a.scaling);
    const double* kt = a.kts + nn * d * a.s8;
    double* row = a.sc + r * a.s;
    for (int64_t j0 = 0; j0 < a.s; j0 += 8) {
      const __mmask8 live = j0 + 8 <= a.s ? 0xff : static_cast<__mmask8>((1u << (a.s - j0)) - 1);
      const __m512d dots = _mm512_mul_pd(dots8(q, kt + j0, a.s8, d), factor);
      _mm512_mask_storeu_pd(row + j0, live, _mm512_mul_pd(dots, _mm512_loadu_pd(a.k_steps + nn * a.s8 + j0)));
    }
    if (a.mask) {
      const bool* blocked = a.mask + (bb * a.t + i) * (a.s - a.first) - a.first;
      for (int64_t j = a.first; j < a.s; ++j) {
        if (blocked[j]) row[j] = -INFINITY;
      }
    }
    __m512d tops = _mm512_set1_pd(-INFINITY);
    for (int64_t j0 = 0; j0 < a.s; j0 += 8) {
      const __mmask8 live = j0 + 8 <= a.s ? 0xff : static_cast<__mmask8>((1u << (a.s - j0)) - 1);
      tops = _mm512_max_pd(tops, _mm512_mask_loadu_pd(_mm512_set1_pd(-INFINITY), live, row + j0));
    }
    const __m512d top = _mm512_set1_pd(_mm512_reduce_max_pd(tops));
    for (int64_t j0 = 0; j0 < a.s; j0 += 8) {
      const __mmask8 live = j0 + 8 <= a.s ? 0xff : static_cast<__mmask8>((1u << (a.s - j0)) - 1);
      _mm512_mask_storeu_pd(row + j0, live, _mm512_sub_pd(_mm512_maskz_loadu_pd(live, row + j0), top));
    }
  }
}

// Rows r0..r1-1 after exp: the weights in fixed point with the values' steps carried in, their
// integer total, the integer sums over values, and the rescale, as exact._attend.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void weigh_rows(const Attend& a, int64_t r0,
                                                                                int64_t r1) {
  const int64_t rows = a.group * a.t, d = a.d, s = a.s;
  const double scale_up = FIXED * a.levels;
  std::vector<double> w(static_cast<size_t>(a.s8)), acc(static_cast<size_t>(d));
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t nn = r / rows, gi = r % rows, g = gi / a.t, i = gi % a.t;
    const int64_t bb = nn / a.kv_heads, h = (nn % a.kv_heads) * a.group + g;
    const double* e = a.sc + r * s;
    const double* vn = a.v_ints + nn * s * d;
    // x = e · value step, its peak, and the integer total of e · FIXED · levels (exact in any order)
    const __m512d up = _mm512_set1_pd(scale_up);
    constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512d peaks = _mm512_set1_pd(1e-300), totals = _mm512_setzero_pd();
    for (int64_t j0 = 0; j0 < s; j0 += 8) {
      const __mmask8 live = j0 + 8 <= s ? 0xff : static_cast<__mmask8>((1u << (s - j0)) - 1);
      const __m512d ej = _mm512_maskz_loadu_pd(live, e + j0);
      const __m512d x = _mm512_mul_pd(ej, _mm512_loadu_pd(a.v_steps + nn * a.s8 + j0));
      _mm512_storeu_pd(w.data() + j0, x);
      peaks = _mm512_max_pd(peaks, x);
      totals = _mm512_add_pd(totals, _mm512_roundscale_pd(_mm512_mul_pd(ej, up), NEAREST));
    }
    const double peak = _mm512_reduce_max_pd(peaks), total = _mm512_reduce_add_pd(totals);
    volatile double inv = 1.0 / peak;
    const __m512d per = _mm512_set1_pd(inv * a.levels);
    for (int64_t j0 = 0; j0 < s; j0 += 8) {
      _mm512_storeu_pd(w.data() + j0, _mm512_roundscale_pd(_mm512_mul_pd(_mm512_loadu_pd(w.data() + j0), per), NEAREST));
    }
    if (d == 64) {
      weighted<8>(w.data(), vn, d, s, acc.data());
    } else if (d == 128) {
      weighted<16>(w.data(), vn, d, s, acc.data());
    } else {
      weighted_any(w.data(), vn, d, s, d, acc.data());
    }
    volatile double w_step = peak * (1.0 / a.levels);
    volatile double factor = w_step * scale_up;
    float* o = a.os + ((bb * a.t + i) * a.heads + h) * d;
    for (int64_t c = 0; c < d; ++c) {
      volatile double up = acc[c] * factor;
      o[c] = static_cast<float>(up / total);
    }
  }
}

}  // namespace
#endif

// exact.attention's arithmetic in one call, for passes of a few rows: (B, H, T, D) float32 queries
// over (B, Hkv, S, D + 1) float64 keys and values in fixed point (exact.stored), -> (B, T, H, D)
// float32. `blocked`: (B, 1, T, S - first) bool, True where a row may not see a key from slot `first`
// on, or None. Each float operation is exact.py's own, in its order; the sums over the head dimension
// and over keys are of integers below 2**53; exp is ATen's, on a buffer laid out as exact._attend's.
torch::Tensor attention_rows(torch::Tensor query, torch::Tensor key, torch::Tensor value, int64_t first,
                             c10::optional<torch::Tensor> blocked, double scaling, double levels) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the exact attention kernel needs an x86-64 CPU with AVX-512");
#else
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat64 &&
                  value.scalar_type() == torch::kFloat64,
              "attention takes float32 queries and float64 fixed-point keys and values");
  const int64_t b = query.size(0), heads = query.size(1), t = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), s = key.size(2), group = heads / kv_heads, n = b * kv_heads;
  TORCH_CHECK(key.size(3) == d + 1 && value.size(3) == d + 1, "keys and values carry their step as a last column");
  auto q = query.contiguous();
  // The cache's keys and values are views of buffers with room to spare: read in place, not copied,
  // wherever each position's D + 1 numbers are contiguous.
  auto k = key.stride(3) == 1 ? key : key.contiguous();
  auto v = value.stride(3) == 1 ? value : value.contiguous();
  torch::Tensor blocked_c;
  if (blocked.has_value()) blocked_c = blocked->to(torch::kBool).contiguous();
  const int64_t rows = group * t, size = n * rows * s, s8 = (s + 7) / 8 * 8;
  // the scores sit in a buffer padded to whole vector widths, so exp runs every element on one path
  auto buffer = torch::zeros({size + (LANES - size % LANES) % LANES}, k.options());
  std::vector<double> kts(static_cast<size_t>(n * d * s8), 0.0), k_steps(static_cast<size_t>(n * s8), 1.0),
      v_steps(static_cast<size_t>(n * s8), 0.0);
  auto v_ints = torch::empty({n, s, d}, k.options());  // torch's allocator aligns to 64 bytes
  std::vector<double> q_int(static_cast<size_t>(n * rows * d)), q_step(static_cast<size_t>(n * rows));
  auto out = torch::empty({b, t, heads, d}, q.options());
  const Attend a{q.data_ptr<float>(),
                 k.data_ptr<double>(),
                 v.data_ptr<double>(),
                 {k.stride(0), k.stride(1), k.stride(2)},
                 {v.stride(0), v.stride(1), v.stride(2)},
                 blocked.has_value() ? blocked_c.data_ptr<bool>() : nullptr,
                 buffer.data_ptr<double>(),
                 kts.data(),
                 k_steps.data(),
                 v_steps.data(),
                 v_ints.data_ptr<double>(),
                 q_int.data(),
                 q_step.data(),
                 out.data_ptr<float>(),
                 heads,
                 kv_heads,
                 group,
                 t,
                 s,
                 s8,
                 d,
                 first,
                 scaling,
                 levels};
  // Rows go to torch's threads only where each thread gets about a million multiply-adds: waking
  // a thread costs more than a one-token pass's attention.
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, 2 * s * d));
  transpose_keys(a, 0, n);
  at::parallel_for(0, n * rows, grain, [&](int64_t r0, int64_t r1) { score_rows(a, r0, r1); });
  // exp as exact.exp_: ATen's own, on slices of whole vector widths below its grain
  for (int64_t start = 0; start < buffer.size(0); start += GRAIN) {
    auto part = buffer.narrow(0, start, std::min(GRAIN, buffer.size(0) - start));
    at::exp_out(part, part);
  }
  at::parallel_for(0, n * rows, grain, [&](int64_t r0, int64_t r1) { weigh_rows(a, r0, r1); });
  return out;
#endif
}

// attention_rows over ROWS query rows a call, as exact.attention: a long prefill's float64 scores stay
// a few tens of MB. (B, H, T, D) queries -> (B, T, H, D).
torch::Tensor attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, int64_t first,
                        c10::optional<torch::Tensor> blocked, double scaling, double levels) {
  constexpr int64_t ROWS = 128;  // exact.ROWS
  const int64_t t = query.size(2);
  if (t <= ROWS) return attention_rows(query, key, value, first, blocked, scaling, levels);
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < t; i += ROWS) {
    const int64_t n = std::min(ROWS, t - i);
    c10::optional<torch::Tensor> mask;
    if (blocked.has_value()) mask = blocked->narrow(2, i, n);
    parts.push_back(attention_rows(query.narrow(2, i, n), key, value, first, mask, scaling, levels));
  }
  return torch::cat(parts, 1);
}

// A Llama RMSNorm with ATen's own kernels, as LlamaRMSNorm.forward calls them (the mean's order is
// ATen's, so these are its bits).
torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& weight, double eps) {
  auto x = h.to(torch::kFloat32);
  auto variance = x.pow(2).mean(-1, true);
  x = x * at::rsqrt(variance + eps);
  return weight * x;
}

#ifdef SPECDEC_X86
namespace {

// exact.fixed's rows with their step as a last column (exact.stored), from float32 rows of d.
void stored_row(const float* x, int64_t d, double* out) {
  double peak = 1e-300;
  for (int64_t c = 0; c < d; ++c) {
    const double m = std::fabs(static_cast<double>(x[c]));
    peak = m > peak ? m : peak;
  }
  volatile double inv = 1.0 / peak;
  volatile double per = inv * FIXED;
  for (int64_t c = 0; c < d; ++c) {
    volatile double scaled = static_cast<double>(x[c]) * per;
    out[c] = std::nearbyint(static_cast<double>(scaled));
  }
  out[d] = peak * (1.0 / FIXED);
}

}  // namespace
#endif

// The first half of an exact decoder layer: RMSNorm, the q, k, v layer (one int8 layer), the model's
// rotary embedding on queries and keys (x·cos + rotate_half(x)·sin, each product rounded, as
// ExactAttention.forward), and keys and values in fixed point. No norm weight: no norm. (B, T, H) hidden states ->
// [(B, heads, T, D) float32 queries, (B, kv_heads, T, D + 1) float64 keys, values].
std::vector<torch::Tensor> attention_in(torch::Tensor h, c10::optional<torch::Tensor> norm_weight, double eps,
                                        torch::Tensor packed,
                                        torch::Tensor scale, c10::optional<torch::Tensor> bias, int64_t half,
                                        bool wide, int64_t heads, int64_t kv_heads, torch::Tensor cos,
                                        torch::Tensor sin) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the int8 kernel needs an x86-64 CPU with AVX-512 VNNI");
#else
  const int64_t b = h.size(0), t = h.size(1), d = cos.size(-1), width = heads + 2 * kv_heads;
  // no norm weight: the layer's input norm is an identity (an EAGLE head's first layer)
  auto x = norm_weight.has_value() ? rms_norm(h, *norm_weight, eps) : h.to(torch::kFloat32);
  auto qkv = linear(x.reshape({b * t, h.size(2)}), packed, scale, bias, width * d, half, wide);  // (B·T, width·D)
  auto c = cos.to(torch::kFloat32).expand({b, t, d}).contiguous();
  auto sn = sin.to(torch::kFloat32).expand({b, t, d}).contiguous();
  auto q = torch::empty({b, heads, t, d}, h.options().dtype(torch::kFloat32));
  auto k = torch::empty({b, kv_heads, t, d + 1}, h.options().dtype(torch::kFloat64));
  auto v = torch::empty({b, kv_heads, t, d + 1}, h.options().dtype(torch::kFloat64));
  const float* src = qkv.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  const float* ss = sn.data_ptr<float>();
  float* qs = q.data_ptr<float>();
  double* ks = k.data_ptr<double>();
  double* vs = v.data_ptr<double>();
  const int64_t half_d = d / 2;
  std::vector<float> turned(static_cast<size_t>(d));
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t i = 0; i < t; ++i) {
      const float* row = src + (bb * t + i) * width * d;
      const float* ci = cs + (bb * t + i) * d;
      const float* si = ss + (bb * t + i) * d;
      for (int64_t head = 0; head < width; ++head) {
        const float* x_h = row + head * d;
        if (head >= heads + kv_heads) {  // a value: fixed point as it is
          stored_row(x_h, d, vs + ((bb * kv_heads + head - heads - kv_heads) * t + i) * (d + 1));
          continue;
        }
        for (int64_t e = 0; e < d; ++e) {
          volatile float a = x_h[e] * ci[e];
          volatile float r = (e < half_d ? -x_h[e + half_d] : x_h[e - half_d]) * si[e];
          turned[e] = a + r;
        }
        if (head < heads) {
          std::copy(turned.begin(), turned.end(), qs + ((bb * heads + head) * t + i) * d);
        } else {
          stored_row(turned.data(), d, ks + ((bb * kv_heads + head - heads) * t + i) * (d + 1));
        }
      }
    }
  }
  return {q, k, v};
#endif
}

// The second half: attention over the cached keys and values, the output layer, the residual, RMSNorm,
// the MLP (gate and up as one int8 layer on int8 rows, SiLU on whole-row slices below ATen's grain, as
// exact.silu, times up, down) and its residual. -> (B, T, H) hidden states.
torch::Tensor attention_out(torch::Tensor h, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t first,
                            c10::optional<torch::Tensor> blocked, double scaling, double levels, torch::Tensor o_packed,
                            torch::Tensor o_scale, c10::optional<torch::Tensor> o_bias, int64_t o_half, bool o_wide,
                            torch::Tensor norm_weight, double eps, torch::Tensor up_packed, torch::Tensor up_scale,
                            c10::optional<torch::Tensor> up_bias, int64_t up_n, torch::Tensor down_packed,
                            torch::Tensor down_scale, c10::optional<torch::Tensor> down_bias, int64_t down_half,
                            bool down_wide) {
  const int64_t b = h.size(0), t = h.size(1), hidden = h.size(2);
  auto rows_of = [&](const torch::Tensor& x) { return x.reshape({b * t, x.size(-1)}); };
  auto attended = attention(q, k, v, first, blocked, scaling, levels);  // (B, T, H, D)
  auto o = linear(rows_of(attended.reshape({b, t, -1})), o_packed, o_scale, o_bias, hidden, o_half, o_wide);
  auto h1 = h + o.view({b, t, hidden});
  auto x = rms_norm(h1, norm_weight, eps);
  auto gate_up = linear(rows_of(x), up_packed, up_scale, up_bias, up_n, 0, false).view({b, t, up_n});
  auto chunks = gate_up.chunk(2, -1);
  auto gate = chunks[0].contiguous();
  const int64_t inner = gate.size(-1), per = std::max<int64_t>(1, GRAIN / inner);
  auto flat = gate.reshape({-1, inner});
  torch::Tensor act;
  if (flat.size(0) <= per) {
    act = at::silu(gate);
  } else {
    std::vector<torch::Tensor> slices;
    for (auto& part : flat.split(per)) slices.push_back(at::silu(part));
    act = torch::cat(slices).reshape(gate.sizes());
  }
  act.mul_(chunks[1]);
  auto down = linear(rows_of(act), down_packed, down_scale, down_bias, hidden, down_half, down_wide);
  return h1 + down.view({b, t, hidden});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU runs the kernel (AVX-512 VNNI)");
  m.def("pack", &pack, "(N, K) int8 rows in the kernel's layout, shifted into uint8");
  m.def("linear", &linear, "the exact int8 linear layer");
  m.def("attention", &attention, "the exact attention over fixed-point keys and values");
  m.def("attention_in", &attention_in, "an exact decoder layer up to its keys and values");
  m.def("attention_out", &attention_out, "an exact decoder layer from its attention on");
}
