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
// ATen's own headers and torch's pybind11 casters, not torch/extension.h: its C++ frontend alone took 24 of
// a 31 s build here
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

constexpr int64_t COLS = 16;  // output columns a block: one zmm of int32 sums
constexpr int64_t DEPTH = 4;  // inner products per lane per vpdpbusd
// rows whose sums share one pass over a block's weights: 24 zmm accumulators beside the weights' vector
// (up to 12 tokens of hi and lo rows)
constexpr int MAX_ROWS = 24;
// From 6 rows a block's sums take longer than its weights take to arrive, and the two stop overlapping:
// the weights 4 KB ahead are asked for while these are summed (a few rows, bound by memory, gain nothing).
constexpr int64_t PREFETCH = 4096;
constexpr int PREFETCH_ROWS = 6;
constexpr double FIXED = 1048576.0;  // exact.FIXED: values' fixed-point levels
constexpr double KEY_LEVELS = 8192.0;  // exact.KEY_LEVELS: keys' fixed-point levels
constexpr double STORED_LEAST = 0x1p-100;  // exact.STORED_LEAST: a stored row's least peak
constexpr int64_t GRAIN = 32768;  // exact.GRAIN
// exact.exp32's constants
constexpr double EXP_LOWEST = -86.0, LOG2E = 1.44269504088896341, LN2_HI = 0.693359375, LN2_LO = -2.12194440e-4;
constexpr float EXP_TERMS[] = {1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                               4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1};

int64_t blocks(int64_t n) { return (n + COLS - 1) / COLS; }
int64_t depth(int64_t k) { return (k + DEPTH - 1) / DEPTH; }
// Tokens a chunk: t tokens of `parts` rows each in as few chunks of at most MAX_ROWS rows as fit, the
// chunks as even as can be (a short last chunk runs on too few accumulators to hide their latency).
int64_t chunk_tokens(int64_t t, int parts) {
  const int64_t per = MAX_ROWS / parts, chunks = (t + per - 1) / per;
  return (t + chunks - 1) / chunks;
}

}  // namespace

// The instruction sets the kernel is written for, the widest first: AVX-512 VNNI (Xeons since Cascade Lake,
// AMD since Zen 4) and AVX2 (nearly every x86-64 CPU since 2013, laptops without AVX-512 among them). Both
// compute the same integers and the same IEEE operations, so the same bits.
namespace {

enum class Isa { none = 0, avx2 = 1, vnni = 2 };

Isa best_isa() {
#ifdef SPECDEC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni")) {
    return Isa::vnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::none;
}

// What the kernel runs on: the widest this CPU has, unless use() chose a narrower one.
std::atomic<Isa> running{best_isa()};

bool vnni() { return running.load(std::memory_order_relaxed) == Isa::vnni; }

const char* isa_name(Isa isa) { return isa == Isa::vnni ? "avx512-vnni" : isa == Isa::avx2 ? "avx2" : ""; }

}  // namespace

bool available() { return running.load() != Isa::none; }

std::string isa() { return isa_name(running.load()); }

// The instruction sets this CPU runs the kernel on, the widest first.
std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (int i = static_cast<int>(best_isa()); i > 0; --i) out.emplace_back(isa_name(static_cast<Isa>(i)));
  return out;
}

// Runs the kernel on `name` ("avx512-vnni" or "avx2") from now on: the narrower path on a CPU that has both,
// to measure or test what a CPU with AVX2 alone runs.
void use(const std::string& name) {
  const Isa best = best_isa();
  for (const Isa isa : {Isa::vnni, Isa::avx2}) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best), "this CPU has no ", name);
    running.store(isa);
    return;
  }
  TORCH_CHECK(false, "the kernel runs on avx512-vnni or avx2, not ", name);
}

// `bytes` uint8 on memory Linux may back with 2 MB pages (transparent huge pages, asked for by
// madvise; a hint, so a kernel that refuses it gives 4 KB pages). A pass streams every weight once,
// and on 4 KB pages each page of the stream costs a TLB miss: the packed weights of a model live in one
// such buffer (exact_model). Its memory is released with the last tensor that views it.
at::Tensor huge_buffer(int64_t bytes) {
#if defined(__linux__)
  constexpr uintptr_t HUGE_PAGE = uintptr_t(2) << 20;
  const size_t length = (static_cast<size_t>(bytes) + 2 * HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;  // room to align
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base != MAP_FAILED) {
    const uintptr_t at = (reinterpret_cast<uintptr_t>(base) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    void* start = reinterpret_cast<void*>(at);
    madvise(start, length - (at - reinterpret_cast<uintptr_t>(base)), MADV_HUGEPAGE);
    return at::from_blob(start, {bytes}, [base, length](void*) { munmap(base, length); },
                         at::TensorOptions().dtype(at::kByte));
  }
#endif
  return at::empty({bytes}, at::kByte);
}

// (N, K) int8 rows -> (blocks(N), depth(K) * 64) uint8, each weight + 128: for each block of 16
// columns and each group of 4 inner positions, the 16 columns' 4 weights side by side (vpdpbusd's
// layout). Padding holds 128, a weight of 0.
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "pack takes (N, K) int8 rows");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = blocks(n), k4 = depth(k);
  auto out = at::full({nb, k4 * COLS * DEPTH}, 128, w.options().dtype(at::kByte));
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
  // Under 4 rows the sums' dependency chains, not the multiplies, set the pace (a vpdpbusd waits on
  // its accumulator's last): even and odd groups then add into two sets, summed at the end.
  constexpr int SETS = R < 4 ? 2 : 1;
  __m512i acc[SETS][R];  // local, so the sums stay in registers across the whole inner dimension
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) for (int s = 0; s < SETS; ++s) acc[s][r] = _mm512_setzero_si512();
  int64_t g = 0;
  if constexpr (SETS == 2) {
    for (; g + 1 < k4; g += 2) {
      const __m512i w0 = _mm512_loadu_si512(w + g * COLS * DEPTH);
      const __m512i w1 = _mm512_loadu_si512(w + (g + 1) * COLS * DEPTH);
      const int32_t* x0 = reinterpret_cast<const int32_t*>(x + g * R * DEPTH);
      const int32_t* x1 = reinterpret_cast<const int32_t*>(x + (g + 1) * R * DEPTH);
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r) {
        acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], w0, _mm512_set1_epi32(x0[r]));
        acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], w1, _mm512_set1_epi32(x1[r]));
      }
    }
  }
  for (; g < k4; ++g) {
    if constexpr (R >= PREFETCH_ROWS) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * COLS * DEPTH + PREFETCH), _MM_HINT_T0);
    }
    const __m512i wv = _mm512_loadu_si512(w + g * COLS * DEPTH);
    const int32_t* xg = reinterpret_cast<const int32_t*>(x + g * R * DEPTH);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], wv, _mm512_set1_epi32(xg[r]));
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
    __m512i sum = acc[0][r];
    if constexpr (SETS == 2) sum = _mm512_add_epi32(sum, acc[1][r]);  // integers: any order is exact
    _mm512_store_si512(out[r], sum);
  }
}

using BlockFn = void (*)(const int8_t*, const uint8_t*, int64_t, int32_t (*)[COLS]);

BlockFn block_fn(int rows) {
  switch (rows) {
#define SPECDEC_CASE(R) \
  case R:               \
    return &block_sums<R>;
    SPECDEC_CASE(1) SPECDEC_CASE(2) SPECDEC_CASE(3) SPECDEC_CASE(4) SPECDEC_CASE(5) SPECDEC_CASE(6)
    SPECDEC_CASE(7) SPECDEC_CASE(8) SPECDEC_CASE(9) SPECDEC_CASE(10) SPECDEC_CASE(11) SPECDEC_CASE(12)
    SPECDEC_CASE(13) SPECDEC_CASE(14) SPECDEC_CASE(15) SPECDEC_CASE(16) SPECDEC_CASE(17) SPECDEC_CASE(18)
    SPECDEC_CASE(19) SPECDEC_CASE(20) SPECDEC_CASE(21) SPECDEC_CASE(22) SPECDEC_CASE(23) SPECDEC_CASE(24)
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
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void run_blocks(const Job& j, int64_t b0, int64_t b1) {
  alignas(64) int32_t lanes[MAX_ROWS][COLS];
  const int64_t per = chunk_tokens(j.t, j.parts);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = j.ws + b * j.k4 * COLS * DEPTH;
    const int64_t c0 = b * COLS, cols = std::min(COLS, j.n - c0);
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(live, j.scale + c0);
    const __m512 bias = j.bias ? _mm512_maskz_loadu_ps(live, j.bias + c0) : _mm512_setzero_ps();
    for (int64_t r0 = 0; r0 < j.t; r0 += per) {
      const int tokens = static_cast<int>(std::min<int64_t>(per, j.t - r0));
      block_fn(tokens * j.parts)(j.xq + r0 * j.parts * j.row_bytes, wb, j.k4, lanes);
      for (int r = 0; r < tokens; ++r) {
        const int64_t row = r0 + r;
        float* out = j.ys + row * j.n + c0;
        if (j.wide && j.parts == 2) {  // int64 sums: rows past about 1,000 inputs at 15 bits, 8 columns a time
          const __m512i hi_shift = _mm512_set1_epi64(j.shifts[2 * row]);
          const __m512i lo_shift = _mm512_set1_epi64(j.shifts[2 * row + 1]);
          const __m512i halves = _mm512_set1_epi64(j.half);
          const __m256 step = _mm256_set1_ps(j.steps[row]);
          const __m512i hi32 = _mm512_load_si512(lanes[2 * r]), lo32 = _mm512_load_si512(lanes[2 * r + 1]);
          for (int part = 0; part < 2; ++part) {
            const __m512i hi = _mm512_sub_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(hi32, part)), hi_shift);
            const __m512i lo = _mm512_sub_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lo32, part)), lo_shift);
            // int64 to float32 rounds to nearest, as the scalar conversion; then the two products and the sum
            const __m256 v = _mm512_cvtepi64_ps(_mm512_add_epi64(lo, _mm512_mullo_epi64(hi, halves)));
            __m256 y = _mm256_mul_ps(_mm256_mul_ps(v, step), _mm512_extractf32x8_ps(scale, part));
            if (j.bias) y = _mm256_add_ps(y, _mm512_extractf32x8_ps(bias, part));
            _mm256_mask_storeu_ps(out + 8 * part, static_cast<__mmask8>(live >> (8 * part)), y);
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


// 16 int8s as four groups of 4 into block_sums's layout: group g at out + g·stride (the groups past
// `groups` are left alone).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void groups_to(__m128i x, int groups, int8_t* out,
                                                                           int64_t stride) {
  alignas(16) int32_t g[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(g), x);
  for (int i = 0; i < groups; ++i) __builtin_memcpy(out + i * stride, &g[i], 4);
}

// Each row as integers, the same operations as exact.split in float32: step = max(amax, 1e-30) ·
// (1/(127·half)), q = round(x · (1/step)), and with half > 0, hi = round(q · (1/half)), lo = q − hi·half.
// Rounding is to nearest even, as torch's round_. Also 128 times each row's integer sum (the u8 shift).
// The integers go straight into block_sums's layout: for each chunk of chunk_tokens tokens,
// (depth(K), rows of the chunk, 4), a chunk starting where its rows start in (T, parts, row_bytes).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void quantise(const float* xs, int64_t t, int64_t k,
                                                                      int64_t row_bytes, int64_t half, int8_t* xq,
                                                                      int32_t* shifts, float* steps) {
  const int parts = half > 0 ? 2 : 1;
  const float per_level = static_cast<float>(1.0 / (127.0 * static_cast<double>(half > 0 ? half : 1)));
  const __m512 inv_half = _mm512_set1_ps(half > 0 ? static_cast<float>(1.0 / static_cast<double>(half)) : 0.0f);
  const __m512 half_f = _mm512_set1_ps(static_cast<float>(half));
  const float least = static_cast<float>(1e-30);
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t per = chunk_tokens(t, parts);
  for (int64_t r = 0; r < t; ++r) {
    const float* row = xs + r * k;
    const int64_t r0 = r / per * per, rows = std::min(per, t - r0) * parts;  // r's chunk: its first token, rows
    int8_t* chunk = xq + r0 * parts * row_bytes + (r - r0) * parts * DEPTH;  // r's first row, group 0
    const int64_t stride = rows * DEPTH;  // bytes from one group of a row to its next
    __m512 peaks = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffff : (1u << (k - i)) - 1);
      peaks = _mm512_max_ps(peaks, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + i)));
    }
    const float peak = _mm512_reduce_max_ps(peaks);
    volatile float step = (peak < least ? least : peak) * per_level;  // volatile: rounded here, as torch's mul_
    const __m512 recip = _mm512_set1_ps(1.0f / step);
    steps[r] = step;
    __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffff : (1u << (k - i)) - 1);
      const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), recip), NEAREST);
      const int groups = static_cast<int>(std::min<int64_t>(4, (row_bytes - i) / DEPTH));
      int8_t* at = chunk + i / DEPTH * stride;
      if (parts == 1) {
        const __m512i qi = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(q));
        sum_hi = _mm512_add_epi32(sum_hi, qi);
        groups_to(_mm512_cvtepi32_epi8(qi), groups, at, stride);
      } else {
        const __m512 hi = _mm512_roundscale_ps(_mm512_mul_ps(q, inv_half), NEAREST);
        const __m512 lo = _mm512_sub_ps(q, _mm512_mul_ps(hi, half_f));  // exact: small integers
        const __m512i hi_i = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(hi));
        const __m512i lo_i = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(lo));
        sum_hi = _mm512_add_epi32(sum_hi, hi_i);
        sum_lo = _mm512_add_epi32(sum_lo, lo_i);
        groups_to(_mm512_cvtepi32_epi8(hi_i), groups, at, stride);
        groups_to(_mm512_cvtepi32_epi8(lo_i), groups, at + DEPTH, stride);
      }
    }
    shifts[r * parts] = 128 * _mm512_reduce_add_epi32(sum_hi);
    if (parts == 2) shifts[r * parts + 1] = 128 * _mm512_reduce_add_epi32(sum_lo);
  }
}

}  // namespace
#endif

#ifdef SPECDEC_X86
namespace {
namespace avx2 {

#define SPECDEC_AVX2 __attribute__((target("avx2")))

// Groups of 4 inner positions whose sums an int32 lane holds before they go into int64: each group adds a
// pair of products of at most 127·HALF (16,256) by 255, so 64 groups stay within 2**30.
constexpr int64_t FLUSH = 64;
// Rows whose sums share one pass over a block's weights: four int32 vectors a row for the whole block,
// two for half of it, beside the rows' broadcasts and a vector of weights in AVX2's 16 registers. One or
// two rows take the whole block, three half of it twice (with more, the compiler keeps a sum in memory,
// and the loop waits on it each group).
constexpr int ROWS = 3;

// The sums of R rows against C vectors of 4 columns of a block (C = 4: all 16; C = 2: the 8 from
// 8·half), still shifted: out[r][c] = Σ x[r]·(w[c] + 128). Without VNNI's four-product lanes, each row's
// integers are int16 (a 15-bit row needs no hi and lo) and vpmaddwd adds two products a lane: a group's
// weights widened to int16, 4 columns a vector, each column's pairs (k0, k1) and (k2, k3) in two lanes,
// folded into the column's int64 sum every FLUSH groups. x is (depth(K), stride / 4, 4) int16, row r's
// group g at x + g·stride + 4r.
template <int R, int C>
SPECDEC_AVX2 void block_sums(const int16_t* x, int64_t stride, const uint8_t* w, int64_t k4, int half,
                             int64_t (*out)[COLS]) {
  const int64_t c0 = 8 * half;
  for (int r = 0; r < R; ++r) for (int c = 0; c < 4 * C; ++c) out[r][c0 + c] = 0;
  for (int64_t g0 = 0; g0 < k4; g0 += FLUSH) {
    __m256i acc[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
    const int64_t g1 = std::min(k4, g0 + FLUSH);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * COLS * DEPTH + 32 * half;
      __m256i xr[R];
      for (int r = 0; r < R; ++r) {
        int64_t four;  // the row's four int16s, in every 64 bits
        __builtin_memcpy(&four, x + g * stride + 4 * r, 8);
        xr[r] = _mm256_set1_epi64x(four);
      }
      for (int c = 0; c < C; ++c) {
        const __m256i wc = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16 * c)));
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(wc, xr[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][c]);
        for (int m = 0; m < 4; ++m) out[r][c0 + 4 * c + m] += static_cast<int64_t>(lanes[2 * m]) + lanes[2 * m + 1];
      }
    }
  }
}

// Each row as integers, as the VNNI path's quantise (exact.split's operations in float32), but whole:
// q = round(x · (1/step)) as int16 in block_sums's layout, (depth(K), T, 4), zero past K, and 128 times
// each row's integer sum. Σ q·w is hi·half·w + lo·w summed, so the same integer either way. 8 numbers a
// step: two groups of a row.
SPECDEC_AVX2 void quantise(const float* xs, int64_t t, int64_t k, int64_t k4, int64_t half, int16_t* xq,
                           int64_t* shifts, float* steps) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const float per_level = static_cast<float>(1.0 / (127.0 * static_cast<double>(half > 0 ? half : 1)));
  const float least = static_cast<float>(1e-30);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t whole = k / 8 * 8;
  for (int64_t r = 0; r < t; ++r) {
    const float* row = xs + r * k;
    __m256 peaks = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) peaks = _mm256_max_ps(peaks, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + i)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peaks);
    float peak = 0.0f;
    for (const float lane : lanes) peak = std::max(peak, lane);
    for (int64_t i = whole; i < k; ++i) peak = std::max(peak, std::fabs(row[i]));
    volatile float step = (peak < least ? least : peak) * per_level;  // volatile: rounded here, as torch's mul_
    const float recip = 1.0f / step;
    steps[r] = step;
    const __m256 recips = _mm256_set1_ps(recip);
    __m256i sums = _mm256_setzero_si256();  // at most 16,256 · K / 8 a lane: int32 holds it
    int16_t* at = xq + r * DEPTH;
    const int64_t group_stride = t * DEPTH;
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i), recips), NEAREST));
      sums = _mm256_add_epi32(sums, q);
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(at + i / DEPTH * group_stride), q16);
      _mm_storeh_pd(reinterpret_cast<double*>(at + (i / DEPTH + 1) * group_stride), _mm_castsi128_pd(q16));
    }
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sums);
    int64_t sum = 0;
    for (const int32_t part : parts) sum += part;
    for (int64_t i = whole; i < k4 * DEPTH; ++i) {
      const int64_t q = i < k ? static_cast<int64_t>(std::nearbyint(row[i] * recip)) : 0;
      at[i / DEPTH * group_stride + i % DEPTH] = static_cast<int16_t>(q);
      sum += q;
    }
    shifts[r] = 128 * sum;
  }
}

// Column blocks b0..b1-1 of `t` rows' output: the integer sums, up to ROWS rows a pass
// (the rows in as few passes as fit, as even as can be), then exact.Int8Linear's rescale, each number as
// the VNNI path's (the integer rounded once to float32, then the two products and the bias).
SPECDEC_AVX2 void run_blocks(const int16_t* xq, const int64_t* shifts, const float* steps, const uint8_t* ws,
                             const float* scale, const float* bias, float* ys, int64_t t, int64_t n, int64_t k4,
                             int64_t b0, int64_t b1) {
  alignas(32) int64_t sums[ROWS][COLS];
  const int64_t passes = (t + ROWS - 1) / ROWS, per = (t + passes - 1) / passes;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = ws + b * k4 * COLS * DEPTH;
    const int64_t c0 = b * COLS, cols = std::min(COLS, n - c0);
    for (int64_t r0 = 0; r0 < t; r0 += per) {
      const int rows = static_cast<int>(std::min(per, t - r0));
      const int16_t* x = xq + r0 * DEPTH;
      if (rows == 1) {
        block_sums<1, 4>(x, t * DEPTH, wb, k4, 0, sums);
      } else if (rows == 2) {
        block_sums<2, 4>(x, t * DEPTH, wb, k4, 0, sums);
      } else {
        for (int half = 0; half < 2 && 8 * half < cols; ++half) block_sums<3, 2>(x, t * DEPTH, wb, k4, half, sums);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        float* out = ys + row * n + c0;
        for (int64_t c = 0; c < cols; ++c) {
          // separate products and sum, never fused (-ffp-contract=off): torch's mul, mul_ and add_
          float y = static_cast<float>(sums[r][c] - shifts[row]) * steps[row] * scale[c0 + c];
          if (bias) y = y + bias[c0 + c];
          out[c] = y;
        }
      }
    }
  }
}

}  // namespace avx2
}  // namespace
#endif

// An int8 layer's weights as the kernel reads them.
struct Weights {
  const uint8_t* packed;
  int64_t bytes;  // the packed weights' size
  const float* scale;
  const float* bias;  // or null
  int64_t n, half;  // outputs; hi·half + lo (0: the row as int8)
  bool wide;
};

// An int8 layer of n outputs over rows of k inputs; its packed weights, scales and bias checked against
// those, since the kernel reads them by n and k alone.
Weights weights_of(const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                   int64_t n, int64_t k, int64_t half, bool wide) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == blocks(n) && packed.size(1) == depth(k) * COLS * DEPTH,
              "packed weights of another shape");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "a float32 scale per output");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n),
              "a float32 bias per output");
  // hi and lo then fit int8, and a whole row's integers (the AVX2 path's) int16, with room to spare
  TORCH_CHECK(half >= 0 && half <= 128, "a row split at a half of at most exact.HALF (128)");
  return {packed.data_ptr<uint8_t>(), packed.numel(), scale.data_ptr<float>(),
          bias.has_value() ? bias->data_ptr<float>() : nullptr, n, half, wide};
}

// The rows' integers a linear layer makes, kept by a caller that runs many layers (a pass's Stack::run),
// so that they are allocated once a pass, not once a layer: a pass of a few tokens is short enough
// for allocations to show.
struct LinearScratch {
  std::vector<int8_t> xq;  // block_sums's layout
  std::vector<int32_t> shifts;
  std::vector<float> steps;
  std::vector<int16_t> xq16;  // the AVX2 path's: its rows whole, as int16
  std::vector<int64_t> shifts64;
};

// (T, K) float32 rows -> y, (T, N) float32: x Wᵀ in the exact precision. `half` > 0 splits each row's
// 15-bit integers into hi·half + lo (Int8Linear with split=True), 0 takes the row as int8; `wide`
// combines hi and lo in int64 (rows too long for int32 at that half).
void linear_rows(const float* x, int64_t t, int64_t k, const Weights& w, float* y, LinearScratch& s) {
#ifdef SPECDEC_X86
  if (t == 0) return;  // no rows: no chunks to share them among
  if (!vnni()) {
    const int64_t k4 = depth(k), nb = blocks(w.n);
    s.xq16.resize(static_cast<size_t>(t * k4 * DEPTH));
    s.shifts64.resize(static_cast<size_t>(t));
    s.steps.resize(static_cast<size_t>(t));
    avx2::quantise(x, t, k, k4, w.half, s.xq16.data(), s.shifts64.data(), s.steps.data());
    at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
      avx2::run_blocks(s.xq16.data(), s.shifts64.data(), s.steps.data(), w.packed, w.scale, w.bias, y, t, w.n, k4,
                       b0, b1);
    });
    return;
  }
  const int parts = w.half > 0 ? 2 : 1;
  const int64_t k4 = depth(k), nb = blocks(w.n), row_bytes = k4 * DEPTH;
  s.xq.resize(static_cast<size_t>(t * parts * row_bytes));  // quantise writes every byte
  s.shifts.resize(static_cast<size_t>(t * parts));
  s.steps.resize(static_cast<size_t>(t));
  quantise(x, t, k, row_bytes, w.half, s.xq.data(), s.shifts.data(), s.steps.data());
  const Job job{s.xq.data(), s.shifts.data(), s.steps.data(), w.packed, w.scale, w.bias, y, t, w.n, k4,
                row_bytes, parts, w.half, w.wide};
  at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) { run_blocks(job, b0, b1); });
#endif
}

at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                  int64_t n, int64_t half, bool wide) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the int8 kernel needs an x86-64 CPU with AVX-512 VNNI");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear takes (T, K) float32 rows");
  x = x.contiguous();
  const int64_t t = x.size(0), k = x.size(1);
  const Weights w = weights_of(packed, scale, bias, n, k, half, wide);
  auto y = at::empty({t, n}, x.options());
  LinearScratch s;
  linear_rows(x.data_ptr<float>(), t, k, w, y.data_ptr<float>(), s);
  return y;
#endif
}


#ifdef SPECDEC_X86
namespace {


#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// Eight of the cache's float32 numbers as float64: integers of at most 2**20 (a value's) and steps that are a
// float32 peak times 2**-20, the same numbers in either type, so the cache keeps them in half the bytes.
SPECDEC_AVX512 inline __m512d widened(const float* x) { return _mm512_cvtps_pd(_mm256_loadu_ps(x)); }

// acc[r][0..8·V) = Σ_j w[r][j] · v[j][0..8·V) for R rows at once, so each value row is loaded once for
// all R; v's rows are `stride` apart (the cache in place). Integers in float64: exact in any order.
template <int V, int R>
SPECDEC_AVX512 void weighted(const double* const* w, const float* v, int64_t stride, int64_t s, double* const* out) {
  __m512d acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) acc[r][i] = _mm512_setzero_pd();
  }
  for (int64_t j = 0; j < s; ++j) {
    const float* vj = v + j * stride;
    __m512d wj[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wj[r] = _mm512_set1_pd(w[r][j]);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) {
      const __m512d x = widened(vj + 8 * i);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_pd(wj[r], x, acc[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) _mm512_storeu_pd(out[r] + 8 * i, acc[r][i]);
  }
}

void weighted_any(const double* w, const float* v, int64_t stride, int64_t s, int64_t d, double* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0;
  for (int64_t j = 0; j < s; ++j) {
    for (int64_t c = 0; c < d; ++c) out[c] += w[j] * v[j * stride + c];
  }
}

// exact.fixed of one float32 row of d numbers, 8 at a time: the peak (at least `least`), its
// reciprocal times `levels` (a power of two), and each number times that, rounded to nearest even,
// written as Out (double for a query's integers, float for a stored key's or value's); returns the
// row's step.
template <typename Out>
SPECDEC_AVX512 double fixed_row(const float* x, int64_t d, double least, double levels, Out* out) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512d peaks = _mm512_set1_pd(least);
  for (int64_t c = 0; c < d; c += 8) {
    const __mmask8 m = static_cast<__mmask8>(d - c >= 8 ? 0xff : (1u << (d - c)) - 1);
    peaks = _mm512_max_pd(_mm512_abs_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, x + c))), peaks);
  }
  const double peak = _mm512_reduce_max_pd(peaks);
  volatile double inv = 1.0 / peak;  // levels / peak is torch's reciprocal, then the product
  const __m512d per = _mm512_set1_pd(inv * levels);
  for (int64_t c = 0; c < d; c += 8) {
    const __mmask8 m = static_cast<__mmask8>(d - c >= 8 ? 0xff : (1u << (d - c)) - 1);
    const __m512d scaled = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, x + c)), per);
    const __m512d rounded = _mm512_roundscale_pd(scaled, NEAREST);
    if constexpr (std::is_same_v<Out, double>) {
      _mm512_mask_storeu_pd(out + c, m, rounded);
    } else {
      _mm256_mask_storeu_ps(out + c, m, _mm512_cvtpd_ps(rounded));
    }
  }
  return peak * (1.0 / levels);
}

}  // namespace
#endif

#ifdef SPECDEC_X86
namespace {
namespace avx2 {
SPECDEC_AVX2 uint32_t key_pairs(const float* k0, int64_t stride, int64_t from, int64_t s, int64_t d, int32_t* kt);
}  // namespace avx2
}  // namespace

namespace {

struct Attend {
  const float* qs;  // (B, H, T, D) queries
  const float* ks;  // (B, Hkv, S, D + 1) keys in fixed point, their step last: the cache's view, strided
  const float* vs;  // values, as keys
  int64_t k_strides[3], v_strides[3];  // the views' strides over B, Hkv and S (D + 1 is contiguous)
  const bool* mask;  // (B, 1, T, S - first), or null
  double* sc;  // (B·Hkv, group·t, S) scores, then their exp (t: this call's rows)
  double* q_int;  // (B·Hkv, group·t, D)
  double* q_step;  // (B·Hkv, group·t)
  float* os;  // (B, T, H, D) out
  int64_t heads, kv_heads, group, t, s, s8, d, first;
  int64_t t0, t_all;  // this call's t query rows start at row t0 of the pass's t_all
  double scaling, levels;
  double q_levels;  // exact.query_levels(d)
  // The cache's keys as int16 pairs and its steps, kept beside it (Stack::run's `kept`), or null:
  // kv head nn's pairs at kept_pairs + nn·P·cap, its key steps at kept_k_steps + nn·cap, its value
  // steps at kept_v_steps + nn·cap (P: pairs a key, cap: the positions they have room for).
  const int32_t* kept_pairs;
  const double* kept_k_steps;
  const double* kept_v_steps;
  int64_t kept_cap;

  const float* query(int64_t bb, int64_t h, int64_t i) const { return qs + ((bb * heads + h) * t_all + t0 + i) * d; }
  // Row r's query and its place in the output (row r: kv head r / (group·t), query head g = (r mod
  // group·t) / t, position i)
  const float* query_of(int64_t r) const {
    const int64_t nn = r / (group * t), gi = r % (group * t);
    return query(nn / kv_heads, (nn % kv_heads) * group + gi / t, gi % t);
  }
  float* out_of(int64_t r) const {
    const int64_t nn = r / (group * t), gi = r % (group * t);
    return out(nn / kv_heads, gi % t, (nn % kv_heads) * group + gi / t);
  }
  // How many rows from r (at most `most`, before r1) share r's kv head: they share each pass over it.
  int sharing(int64_t r, int64_t r1, int most) const {
    int n = 1;
    while (n < most && r + n < r1 && (r + n) / (group * t) == r / (group * t)) ++n;
    return n;
  }
  // Row r's scores, -inf where the mask blocks a key.
  double* masked(int64_t r) const {
    double* row = sc + r * s;
    if (mask) {
      const bool* seen = blocked(r / (group * t) / kv_heads, r % (group * t) % t);
      for (int64_t j = first; j < s; ++j) {
        if (seen[j]) row[j] = -INFINITY;
      }
    }
    return row;
  }
  float* out(int64_t bb, int64_t i, int64_t h) const { return os + ((bb * t_all + t0 + i) * heads + h) * d; }
  const bool* blocked(int64_t bb, int64_t i) const { return mask + (bb * t_all + t0 + i) * (s - first) - first; }

  const float* key(int64_t nn, int64_t j) const {
    return ks + nn / kv_heads * k_strides[0] + nn % kv_heads * k_strides[1] + j * k_strides[2];
  }
  const float* value(int64_t nn, int64_t j) const {
    return vs + nn / kv_heads * v_strides[0] + nn % kv_heads * v_strides[1] + j * v_strides[2];
  }
};

// One kv head's steps of its keys (or values), from their last column, into steps[0..S): read by the
// thread that next reads those rows, so the strided reads overlap its sums instead of running alone first.
void steps_of(const Attend& a, int64_t nn, bool values, double* steps) {
  const double* kept = values ? a.kept_v_steps : a.kept_k_steps;
  if (kept) {
    std::copy(kept + nn * a.kept_cap, kept + nn * a.kept_cap + a.s, steps);
    return;
  }
  for (int64_t j = 0; j < a.s; ++j) steps[j] = (values ? a.value(nn, j) : a.key(nn, j))[a.d];
}

// A 16 × 16 block of int32 lanes transposed in registers: r[i]'s lane j goes to r[j]'s lane i.
SPECDEC_AVX512 inline void transposed16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// One kv head's keys from `from` (a multiple of 16) to S as int16 pairs (vpdpwssd's operand, 16 keys a
// vector), 32 keys a block of P rows: kt[(j / 32)·P·32 + p·32 + j mod 32] holds key j's numbers 2p and
// 2p + 1, keys from S to the block's end zero. A head's blocks follow each other, so a pass over its
// keys reads one run of memory. The cache's float32 integers (at most KEY_LEVELS) as int16, sixteen
// keys at a time, then each 16 × 16 block of pairs transposed. Returns the largest magnitude among
// them: keys stored at other levels would be cut short, not summed (NaN and infinities convert to
// INT_MIN, whose magnitude, unsigned, is 2**31).
template <int V>
SPECDEC_AVX512 uint32_t key_pairs(const float* k0, int64_t stride, int64_t from, int64_t s, int32_t* kt) {
  constexpr int BLOCKS = V / 4;  // 16 pairs (32 numbers) a block of a key's 8·V numbers
  constexpr int P = 4 * V;
  const int64_t s32 = (s + 31) / 32 * 32;
  __m512i r[BLOCKS][16];
  __m512i most = _mm512_setzero_si512();
  for (int64_t j0 = from; j0 < s32; j0 += 16) {
    for (int kk = 0; kk < 16; ++kk) {
      const int64_t j = j0 + kk;
#pragma GCC unroll 4
      for (int blk = 0; blk < BLOCKS; ++blk) {
        if (j >= s) {
          r[blk][kk] = _mm512_setzero_si512();
          continue;
        }
        const float* x = k0 + j * stride + 32 * blk;
        const __m512i lo = _mm512_cvtps_epi32(_mm512_loadu_ps(x)), hi = _mm512_cvtps_epi32(_mm512_loadu_ps(x + 16));
        most = _mm512_max_epu32(most, _mm512_max_epu32(_mm512_abs_epi32(lo), _mm512_abs_epi32(hi)));
        const __m256i lo16 = _mm512_cvtepi32_epi16(lo), hi16 = _mm512_cvtepi32_epi16(hi);
        r[blk][kk] = _mm512_inserti64x4(_mm512_castsi256_si512(lo16), hi16, 1);
      }
    }
    for (int blk = 0; blk < BLOCKS; ++blk) {
      transposed16(r[blk]);
      int32_t* block = kt + j0 / 32 * P * 32 + j0 % 32;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(block + (16 * blk + p) * 32, r[blk][p]);
    }
  }
  return _mm512_reduce_max_epu32(most);
}

void check_keys(uint32_t most) {
  TORCH_CHECK(most <= static_cast<uint32_t>(KEY_LEVELS),
              "finite keys in fixed point at exact.KEY_LEVELS (exact.stored(keys, KEY_LEVELS))");
}

// One key's int16 pairs into key_pairs's layout, `kt` at the key's own column of its block (the lanes
// key_pairs's transposes would put there); returns their largest magnitude, as key_pairs.
template <int V>
SPECDEC_AVX512 uint32_t key_pairs_of_one(const float* key, int32_t* kt) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(32));
  __m512i most = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int blk = 0; blk < V / 4; ++blk) {
    const __m512i lo = _mm512_cvtps_epi32(_mm512_loadu_ps(key + 32 * blk));
    const __m512i hi = _mm512_cvtps_epi32(_mm512_loadu_ps(key + 32 * blk + 16));
    most = _mm512_max_epu32(most, _mm512_max_epu32(_mm512_abs_epi32(lo), _mm512_abs_epi32(hi)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                            _mm512_cvtepi32_epi16(hi), 1);
    _mm512_i32scatter_epi32(kt + 16 * blk * 32, rows, both, 4);  // pair p to row 16·blk + p
  }
  return _mm512_reduce_max_epu32(most);
}

// Positions from..s-1 of a layer's cache (keys and values (B·Hkv, room, D + 1), contiguous, D 64 or
// 128) into what a Stack keeps beside it, so that a pass converts only its new keys: each key's int16
// pairs (`pairs` (B·Hkv, P·cap), key_pairs's layout) and each key's and value's step (`k_steps`,
// `v_steps` (B·Hkv, cap)). The same numbers attention would take from the cache. A few new keys go one
// by one; many (a prompt's) sixteen at a time. Past S the blocks hold whatever they held: the scores
// of those lanes are never kept.
void keep_positions(const float* keys, const float* values, int64_t heads, int64_t room, int64_t d, int64_t from,
                    int64_t s, int32_t* pairs, double* k_steps, double* v_steps, int64_t cap) {
  const int64_t width = d + 1, p = d / 2;
  uint32_t most = 0;
  for (int64_t nn = 0; nn < heads; ++nn) {
    const float* k0 = keys + nn * room * width;
    const float* v0 = values + nn * room * width;
    for (int64_t j = from; j < s; ++j) {
      k_steps[nn * cap + j] = k0[j * width + d];
      v_steps[nn * cap + j] = v0[j * width + d];
    }
    int32_t* kt = pairs + nn * p * cap;
    if (!vnni()) {
      most = std::max(most, avx2::key_pairs(k0, width, from, s, d, kt));
      continue;
    }
    if (s - from >= 32) {
      const int64_t run = from / 16 * 16;
      most = std::max(most, d == 64 ? key_pairs<8>(k0, width, run, s, kt) : key_pairs<16>(k0, width, run, s, kt));
      continue;
    }
    for (int64_t j = from; j < s; ++j) {
      int32_t* column = kt + j / 32 * p * 32 + j % 32;
      most = std::max(most, d == 64 ? key_pairs_of_one<8>(k0 + j * width, column)
                                    : key_pairs_of_one<16>(k0 + j * width, column));
    }
  }
  check_keys(most);
}

// A query row's integers (at most query_levels) as int16 pairs, as key_pairs's.
void query_pairs(const double* q, int64_t d, int32_t* out) {
  for (int64_t p = 0; p < d / 2; ++p) {
    const auto lo = static_cast<uint16_t>(static_cast<int16_t>(q[2 * p]));
    const auto hi = static_cast<uint16_t>(static_cast<int16_t>(q[2 * p + 1]));
    out[p] = static_cast<int32_t>(static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16));
  }
}

// Rows r..r+R-1 of one kv head against its keys, 32 a step: the integer sums by vpdpwssd (two int16
// products into an int32 lane, every sum within 2**30: exact), then as float64 · (q_step · scaling) ·
// key step, each product rounded, as torch's mul_.
template <int V, int R>
SPECDEC_AVX512 void score_block(const Attend& a, int64_t r, const int32_t* qp, const int32_t* kt, const double* k_steps) {
  constexpr int P = 4 * V;  // pairs a key
  __m512d factor[R];
#pragma GCC unroll 4
  for (int k = 0; k < R; ++k) factor[k] = _mm512_set1_pd(a.q_step[r + k] * a.scaling);
  for (int64_t j0 = 0; j0 < a.s; j0 += 32) {
    __m512i acc[R][2];
#pragma GCC unroll 4
    for (int k = 0; k < R; ++k) acc[k][0] = acc[k][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const int32_t* kp = kt + j0 * P + p * 32;  // block j0 / 32's row p
      const __m512i k0 = _mm512_loadu_si512(kp), k1 = _mm512_loadu_si512(kp + 16);
#pragma GCC unroll 4
      for (int k = 0; k < R; ++k) {
        const __m512i q = _mm512_set1_epi32(qp[k * P + p]);
        acc[k][0] = _mm512_dpwssd_epi32(acc[k][0], k0, q);
        acc[k][1] = _mm512_dpwssd_epi32(acc[k][1], k1, q);
      }
    }
#pragma GCC unroll 4
    for (int k = 0; k < R; ++k) {
      double* row = a.sc + (r + k) * a.s;
      for (int h = 0; h < 4; ++h) {
        const int64_t j = j0 + 8 * h;
        if (j >= a.s) break;
        const __mmask8 live = j + 8 <= a.s ? 0xff : static_cast<__mmask8>((1u << (a.s - j)) - 1);
        const __m256i ints = _mm512_extracti64x4_epi64(acc[k][h / 2], h % 2);
        const __m512d dots = _mm512_mul_pd(_mm512_cvtepi32_pd(ints), factor[k]);
        _mm512_mask_storeu_pd(row + j, live, _mm512_mul_pd(dots, _mm512_loadu_pd(k_steps + j)));
      }
    }
  }
}

// Rows r0..r1-1's scores from their queries' integers, for a head size of neither 64 nor 128: each
// dot product in float64 (integers within 2**30: exact in any order), then · (q_step · scaling) · key step.
void scores_any(const Attend& a, int64_t r0, int64_t r1, double* k_steps) {
  const int64_t rows = a.group * a.t, d = a.d, stride = a.k_strides[2];
  int64_t held = -1;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t nn = r / rows;
    if (nn != held) steps_of(a, held = nn, false, k_steps);
    const float* k0 = a.key(nn, 0);
    const double* q = a.q_int + r * d;
    double* row = a.sc + r * a.s;
    for (int64_t j = 0; j < a.s; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) dot += q[c] * k0[j * stride + c];
      volatile double scaled = dot * (a.q_step[r] * a.scaling);
      row[j] = scaled * k_steps[j];
    }
  }
}

// Rows r0..r1-1 (row r: kv head r / (group·T), query head g = (r mod group·T) / T, position i):
// the query in fixed point (exact.fixed at query_levels), its scores (integer sums, then · (q_step ·
// scaling) · key step, each rounded as torch's mul_), the mask, and minus the row's max. Where d is 64
// or 128, up to four rows of one kv head share each pass over its keys, as int16 pairs.
template <int V>
SPECDEC_AVX512 void score_rows(const Attend& a, int64_t r0, int64_t r1) {
  const int64_t rows = a.group * a.t, d = a.d;
  for (int64_t r = r0; r < r1; ++r) a.q_step[r] = fixed_row(a.query_of(r), d, 1e-300, a.q_levels, a.q_int + r * d);
  const int64_t s32 = (a.s + 31) / 32 * 32;
  std::vector<double> k_steps(static_cast<size_t>(s32), 1.0);  // padding past S: a step of 1
  if constexpr (V > 0) {
    constexpr int P = 4 * V, MOST = 4;
    int64_t held = -1;
    std::vector<int32_t> kt(a.kept_pairs ? 0 : static_cast<size_t>(P * s32)), qp(static_cast<size_t>(MOST * P));
    const int32_t* pairs = nullptr;
    for (int64_t r = r0; r < r1;) {
      const int64_t nn = r / rows;
      if (nn != held) {
        steps_of(a, held = nn, false, k_steps.data());
        if (a.kept_pairs) {
          pairs = a.kept_pairs + nn * P * a.kept_cap;
        } else {
          check_keys(key_pairs<V>(a.key(nn, 0), a.k_strides[2], 0, a.s, kt.data()));
          pairs = kt.data();
        }
      }
      const int n_rows = a.sharing(r, r1, MOST);
      for (int k = 0; k < n_rows; ++k) query_pairs(a.q_int + (r + k) * d, d, qp.data() + k * P);
      switch (n_rows) {
        case 4: score_block<V, 4>(a, r, qp.data(), pairs, k_steps.data()); break;
        case 3: score_block<V, 3>(a, r, qp.data(), pairs, k_steps.data()); break;
        case 2: score_block<V, 2>(a, r, qp.data(), pairs, k_steps.data()); break;
        default: score_block<V, 1>(a, r, qp.data(), pairs, k_steps.data()); break;
      }
      r += n_rows;
    }
  } else {
    scores_any(a, r0, r1, k_steps.data());
  }
  for (int64_t r = r0; r < r1; ++r) {
    double* row = a.masked(r);
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

// One row after exp: the weights in fixed point with the values' steps carried in (into w), and their
// integer total; returns the weights' step factor for the rescale, as exact._attend.
SPECDEC_AVX512 double softmax_weights(const Attend& a, int64_t r, const double* v_steps, double* w, double* total_out) {
  const int64_t s = a.s;
  const double scale_up = FIXED * a.levels;
  const double* e = a.sc + r * s;
  // x = e · value step, its peak, and the integer total of e · FIXED · levels (exact in any order)
  const __m512d up = _mm512_set1_pd(scale_up);
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512d peaks = _mm512_set1_pd(1e-300), totals = _mm512_setzero_pd();
  for (int64_t j0 = 0; j0 < s; j0 += 8) {
    const __mmask8 live = j0 + 8 <= s ? 0xff : static_cast<__mmask8>((1u << (s - j0)) - 1);
    const __m512d ej = _mm512_maskz_loadu_pd(live, e + j0);
    const __m512d x = _mm512_mul_pd(ej, _mm512_loadu_pd(v_steps + j0));
    _mm512_storeu_pd(w + j0, x);
    peaks = _mm512_max_pd(peaks, x);
    totals = _mm512_add_pd(totals, _mm512_roundscale_pd(_mm512_mul_pd(ej, up), NEAREST));
  }
  const double peak = _mm512_reduce_max_pd(peaks);
  *total_out = _mm512_reduce_add_pd(totals);
  volatile double inv = 1.0 / peak;
  const __m512d per = _mm512_set1_pd(inv * a.levels);
  for (int64_t j0 = 0; j0 < s; j0 += 8) {
    _mm512_storeu_pd(w + j0, _mm512_roundscale_pd(_mm512_mul_pd(_mm512_loadu_pd(w + j0), per), NEAREST));
  }
  volatile double w_step = peak * (1.0 / a.levels);
  volatile double factor = w_step * scale_up;
  return factor;
}

// Rows r0..r1-1 after exp: softmax_weights, the integer sums over values (up to three rows of one kv head
// share a pass over its values), and the rescale.
template <int V>
SPECDEC_AVX512 void weigh_rows(const Attend& a, int64_t r0, int64_t r1) {
  constexpr int MOST = V > 0 && V <= 8 ? 3 : 1;  // MOST·V accumulators fit the 32 registers
  const int64_t rows = a.group * a.t, d = a.d;
  std::vector<double> w(static_cast<size_t>(MOST * a.s8)), acc(static_cast<size_t>(MOST * d));
  std::vector<double> v_steps(static_cast<size_t>(a.s8), 0.0);  // padding past S: a step of 0
  int64_t held = -1;
  for (int64_t r = r0; r < r1;) {
    const int64_t nn = r / rows;
    if (nn != held) steps_of(a, held = nn, true, v_steps.data());
    const int n_rows = a.sharing(r, r1, MOST);
    double factors[3], totals[3];
    const double* ws[3];
    double* accs[3];
    for (int64_t k = 0; k < n_rows; ++k) {
      ws[k] = w.data() + k * a.s8;
      accs[k] = acc.data() + k * d;
      factors[k] = softmax_weights(a, r + k, v_steps.data(), w.data() + k * a.s8, &totals[k]);
    }
    const float* v0 = a.value(nn, 0);
    const int64_t stride = a.v_strides[2];
    if constexpr (V > 0 && MOST == 3) {
      if (n_rows == 3) {
        weighted<V, 3>(ws, v0, stride, a.s, accs);
      } else if (n_rows == 2) {
        weighted<V, 2>(ws, v0, stride, a.s, accs);
      } else {
        weighted<V, 1>(ws, v0, stride, a.s, accs);
      }
    } else if constexpr (V > 0) {
      weighted<V, 1>(ws, v0, stride, a.s, accs);
    } else {
      weighted_any(ws[0], v0, stride, a.s, d, accs[0]);
    }
    for (int64_t k = 0; k < n_rows; ++k) {
      float* o = a.out_of(r + k);
      const __m512d factor = _mm512_set1_pd(factors[k]), total = _mm512_set1_pd(totals[k]);
      for (int64_t c = 0; c < d; c += 8) {  // the product rounded, then the quotient, as mul_ and div_
        const __mmask8 m = static_cast<__mmask8>(d - c >= 8 ? 0xff : (1u << (d - c)) - 1);
        const __m512d up = _mm512_mul_pd(_mm512_maskz_loadu_pd(m, accs[k] + c), factor);
        _mm256_mask_storeu_ps(o + c, m, _mm512_cvtpd_ps(_mm512_div_pd(up, total)));
      }
    }
    r += n_rows;
  }
}

// exact.exp32 of 16 float32s: the same IEEE operations in the same order, none fused.
SPECDEC_AVX512 inline __m512 exp32(__m512 x) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(static_cast<float>(EXP_LOWEST)), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(static_cast<float>(EXP_LOWEST)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(static_cast<float>(LOG2E))), NEAREST);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(static_cast<float>(LN2_HI)))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(static_cast<float>(LN2_LO))));
  __m512 p = _mm512_set1_ps(EXP_TERMS[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 6; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_TERMS[i]));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512 two_n = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~low), _mm512_mul_ps(p, two_n));
}

// exact.exp32 in place over n float64s (each rounded to float32 first, the result widened back), 16 a step.
SPECDEC_AVX512 void exp32_rows(double* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t left = n - i;
    const __mmask8 m0 = left >= 8 ? 0xff : static_cast<__mmask8>((1u << left) - 1);
    const __mmask8 m1 = left >= 16 ? 0xff : left <= 8 ? 0 : static_cast<__mmask8>((1u << (left - 8)) - 1);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(m0, x + i));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(m1, x + i + 8));
    const __m512 e = exp32(_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
    _mm512_mask_storeu_pd(x + i, m0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    _mm512_mask_storeu_pd(x + i + 8, m1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
  }
}

}  // namespace
#endif

#ifdef SPECDEC_X86
namespace {
namespace avx2 {

// The VNNI path's attention steps for CPUs with AVX2 alone: the same IEEE operations on each number, one
// number at a time where the compiler vectorises the loop itself, and the integer sums over the head
// dimension by vpmaddwd (two int16 products a lane, as vpdpwssd) over the same key pairs.

// fixed_row's operations, number by number.
template <typename Out>
SPECDEC_AVX2 double fixed_row(const float* x, int64_t d, double least, double levels, Out* out) {
  double peak = least;
  for (int64_t c = 0; c < d; ++c) {
    const double a = std::fabs(static_cast<double>(x[c]));
    peak = a > peak ? a : peak;
  }
  volatile double inv = 1.0 / peak;  // levels / peak is torch's reciprocal, then the product
  const double per = inv * levels;
  for (int64_t c = 0; c < d; ++c) out[c] = static_cast<Out>(std::nearbyint(static_cast<double>(x[c]) * per));
  return peak * (1.0 / levels);
}

SPECDEC_AVX2 void stored_row(const float* x, int64_t d, double levels, float* out) {
  out[d] = static_cast<float>(fixed_row(x, d, STORED_LEAST, levels, out));
}

// cvtps2dq's integer: to nearest even, INT_MIN for NaN, the infinities and whatever int32 cannot hold.
inline int32_t to_int(float x) {
  if (!(x >= -2147483648.0f && x < 2147483648.0f)) return INT32_MIN;
  return static_cast<int32_t>(std::nearbyint(x));
}

inline uint32_t magnitude(int32_t i) {
  return i < 0 ? static_cast<uint32_t>(0) - static_cast<uint32_t>(i) : static_cast<uint32_t>(i);
}

// Keys from..s-1 of one kv head as key_pairs's int16 pairs, key by key, and zeros from S to its block's
// end; returns their largest magnitude, as key_pairs.
SPECDEC_AVX2 uint32_t key_pairs(const float* k0, int64_t stride, int64_t from, int64_t s, int64_t d, int32_t* kt) {
  const int64_t pairs = d / 2, s32 = (s + 31) / 32 * 32;
  uint32_t most = 0;
  for (int64_t j = from; j < s32; ++j) {
    int32_t* column = kt + j / 32 * pairs * 32 + j % 32;
    const float* key = k0 + j * stride;
    for (int64_t p = 0; p < pairs; ++p) {
      if (j >= s) {
        column[p * 32] = 0;
        continue;
      }
      const int32_t lo = to_int(key[2 * p]), hi = to_int(key[2 * p + 1]);
      most = std::max(most, std::max(magnitude(lo), magnitude(hi)));
      column[p * 32] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                            (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
    }
  }
  return most;
}

// Rows r..r+R-1 of one kv head against its keys, 32 a step: score_block's sums (vpmaddwd's pairs of
// int16 products, added in int32 as vpdpwssd adds them) and products.
template <int V, int R>
SPECDEC_AVX2 void score_block(const Attend& a, int64_t r, const int32_t* qp, const int32_t* kt, const double* k_steps) {
  constexpr int P = 4 * V;  // pairs a key
  for (int64_t j0 = 0; j0 < a.s; j0 += 32) {
    __m256i acc[R][4];
    for (int k = 0; k < R; ++k) for (int h = 0; h < 4; ++h) acc[k][h] = _mm256_setzero_si256();
    for (int p = 0; p < P; ++p) {
      const int32_t* kp = kt + j0 * P + p * 32;  // block j0 / 32's row p
      __m256i q[R];
      for (int k = 0; k < R; ++k) q[k] = _mm256_set1_epi32(qp[k * P + p]);
      for (int h = 0; h < 4; ++h) {
        const __m256i keys = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + 8 * h));
        for (int k = 0; k < R; ++k) acc[k][h] = _mm256_add_epi32(acc[k][h], _mm256_madd_epi16(keys, q[k]));
      }
    }
    const int64_t end = std::min<int64_t>(32, a.s - j0);
    for (int k = 0; k < R; ++k) {
      const double factor = a.q_step[r + k] * a.scaling;
      double* row = a.sc + (r + k) * a.s + j0;
      alignas(32) int32_t dots[32];
      for (int h = 0; h < 4; ++h) _mm256_store_si256(reinterpret_cast<__m256i*>(dots + 8 * h), acc[k][h]);
      for (int64_t j = 0; j < end; ++j) row[j] = static_cast<double>(dots[j]) * factor * k_steps[j0 + j];
    }
  }
}

// A row minus its max (maxpd's: the second operand where the first is not greater), 4 a step.
SPECDEC_AVX2 void row_minus_max(double* row, int64_t s) {
  __m256d tops = _mm256_set1_pd(-INFINITY);
  int64_t j = 0;
  for (; j + 4 <= s; j += 4) tops = _mm256_max_pd(tops, _mm256_loadu_pd(row + j));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, tops);
  double top = lanes[0];
  for (int k = 1; k < 4; ++k) top = top > lanes[k] ? top : lanes[k];
  for (; j < s; ++j) top = top > row[j] ? top : row[j];
  const __m256d tv = _mm256_set1_pd(top);
  for (j = 0; j + 4 <= s; j += 4) _mm256_storeu_pd(row + j, _mm256_sub_pd(_mm256_loadu_pd(row + j), tv));
  for (; j < s; ++j) row[j] = row[j] - top;
}

// score_rows's steps: the queries in fixed point, their scores, the mask, and minus each row's max.
template <int V>
SPECDEC_AVX2 void score_rows(const Attend& a, int64_t r0, int64_t r1) {
  const int64_t rows = a.group * a.t, d = a.d;
  for (int64_t r = r0; r < r1; ++r) a.q_step[r] = fixed_row(a.query_of(r), d, 1e-300, a.q_levels, a.q_int + r * d);
  const int64_t s32 = (a.s + 31) / 32 * 32;
  std::vector<double> k_steps(static_cast<size_t>(s32), 1.0);
  if constexpr (V > 0) {
    constexpr int P = 4 * V, MOST = 3;  // 4·R accumulators, R queries and the keys' vector: 16 registers
    std::vector<int32_t> kt(a.kept_pairs ? 0 : static_cast<size_t>(P * s32)), qp(static_cast<size_t>(MOST * P));
    const int32_t* pairs = nullptr;
    int64_t held = -1;
    for (int64_t r = r0; r < r1;) {
      const int64_t nn = r / rows;
      if (nn != held) {
        steps_of(a, held = nn, false, k_steps.data());
        if (a.kept_pairs) {
          pairs = a.kept_pairs + nn * P * a.kept_cap;
        } else {
          check_keys(key_pairs(a.key(nn, 0), a.k_strides[2], 0, a.s, d, kt.data()));
          pairs = kt.data();
        }
      }
      const int n_rows = a.sharing(r, r1, MOST);
      for (int k = 0; k < n_rows; ++k) query_pairs(a.q_int + (r + k) * d, d, qp.data() + k * P);
      if (n_rows == 3) {
        avx2::score_block<V, 3>(a, r, qp.data(), pairs, k_steps.data());
      } else if (n_rows == 2) {
        avx2::score_block<V, 2>(a, r, qp.data(), pairs, k_steps.data());
      } else {
        avx2::score_block<V, 1>(a, r, qp.data(), pairs, k_steps.data());
      }
      r += n_rows;
    }
  } else {
    scores_any(a, r0, r1, k_steps.data());
  }
  for (int64_t r = r0; r < r1; ++r) row_minus_max(a.masked(r), a.s);
}

// softmax_weights's operations, 4 numbers a step (the total: integers, exact in any order).
SPECDEC_AVX2 double softmax_weights(const Attend& a, int64_t r, const double* v_steps, double* w, double* total_out) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t s = a.s;
  const double scale_up = FIXED * a.levels;
  const double* e = a.sc + r * s;
  const __m256d up = _mm256_set1_pd(scale_up);
  __m256d peaks = _mm256_set1_pd(1e-300), totals = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 4 <= s; j += 4) {
    const __m256d ej = _mm256_loadu_pd(e + j);
    const __m256d x = _mm256_mul_pd(ej, _mm256_loadu_pd(v_steps + j));
    _mm256_storeu_pd(w + j, x);
    peaks = _mm256_max_pd(peaks, x);
    totals = _mm256_add_pd(totals, _mm256_round_pd(_mm256_mul_pd(ej, up), NEAREST));
  }
  alignas(32) double lanes[4], sums[4];
  _mm256_store_pd(lanes, peaks);
  _mm256_store_pd(sums, totals);
  double peak = lanes[0], total = sums[0] + sums[1] + sums[2] + sums[3];
  for (int k = 1; k < 4; ++k) peak = peak > lanes[k] ? peak : lanes[k];
  for (; j < s; ++j) {
    const double x = e[j] * v_steps[j];
    w[j] = x;
    peak = peak > x ? peak : x;
    total += std::nearbyint(e[j] * scale_up);
  }
  *total_out = total;
  volatile double inv = 1.0 / peak;
  const double per = inv * a.levels;
  const __m256d pers = _mm256_set1_pd(per);
  for (j = 0; j + 4 <= s; j += 4) {
    _mm256_storeu_pd(w + j, _mm256_round_pd(_mm256_mul_pd(_mm256_loadu_pd(w + j), pers), NEAREST));
  }
  for (; j < s; ++j) w[j] = std::nearbyint(w[j] * per);
  volatile double w_step = peak * (1.0 / a.levels);
  volatile double factor = w_step * scale_up;
  return factor;
}

// acc[r][0..8) += Σ_j w[r][j] · v[j][c0..c0+8) over keys j0..j1-1 for R rows: each value row's 8 numbers
// loaded once for all R, as the VNNI path's weighted (integers in float64: exact in any order, fused or not).
template <int R>
__attribute__((target("avx2,fma"))) void weighted8(const double* const* w, const float* v, int64_t stride, int64_t j0,
                                                   int64_t j1, double* const* acc_out) {
  __m256d acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_pd(acc_out[r]);
    acc[r][1] = _mm256_loadu_pd(acc_out[r] + 4);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * stride;
    const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(vj)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(vj + 4));
    for (int r = 0; r < R; ++r) {
      const __m256d wj = _mm256_set1_pd(w[r][j]);
      acc[r][0] = _mm256_fmadd_pd(wj, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(wj, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_pd(acc_out[r], acc[r][0]);
    _mm256_storeu_pd(acc_out[r] + 4, acc[r][1]);
  }
}

using Weighted8 = void (*)(const double* const*, const float*, int64_t, int64_t, int64_t, double* const*);
// Keys a block of the values' sums: the block's rows are asked for whole while the block before is summed,
// then summed 8 numbers at a time from the nearest cache (one pass over a head's strided rows per 8
// numbers would wait on the memory at each).
constexpr int64_t VALUE_BLOCK = 32;
constexpr int MOST_ROWS = 6;  // 2·R accumulators, the values' two vectors and a weight: 15 registers
constexpr Weighted8 WEIGHTED8[MOST_ROWS] = {&weighted8<1>, &weighted8<2>, &weighted8<3>,
                                            &weighted8<4>, &weighted8<5>, &weighted8<6>};

// weigh_rows's steps: softmax_weights, the integer sums over the values (up to six rows of one kv head
// share a pass over them, 8 of a head's numbers at a time; a head size not a multiple of 8 goes number
// by number), and the rescale.
SPECDEC_AVX2 void weigh_rows(const Attend& a, int64_t r0, int64_t r1) {
  constexpr int MOST = MOST_ROWS;
  const int64_t rows = a.group * a.t, d = a.d, stride = a.v_strides[2];
  std::vector<double> w(static_cast<size_t>(MOST * a.s8)), acc(static_cast<size_t>(MOST * d));
  std::vector<double> v_steps(static_cast<size_t>(a.s8), 0.0);
  int64_t held = -1;
  for (int64_t r = r0; r < r1;) {
    const int64_t nn = r / rows;
    if (nn != held) steps_of(a, held = nn, true, v_steps.data());
    const int n_rows = a.sharing(r, r1, MOST);
    double factors[MOST], totals[MOST];
    const double* ws[MOST];
    double* accs[MOST];
    for (int k = 0; k < n_rows; ++k) {
      ws[k] = w.data() + k * a.s8;
      accs[k] = acc.data() + k * d;
      factors[k] = avx2::softmax_weights(a, r + k, v_steps.data(), w.data() + k * a.s8, &totals[k]);
    }
    const float* v0 = a.value(nn, 0);
    if (d % 8 == 0) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j0 = 0; j0 < a.s; j0 += VALUE_BLOCK) {
        const int64_t j1 = std::min(a.s, j0 + VALUE_BLOCK), next = std::min(a.s, j1 + VALUE_BLOCK);
        const char* ahead = reinterpret_cast<const char*>(v0 + j1 * stride);
        for (int64_t off = 0; off < (next - j1) * stride * 4; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        for (int64_t c0 = 0; c0 < d; c0 += 8) {
          double* part[MOST];
          for (int k = 0; k < n_rows; ++k) part[k] = accs[k] + c0;
          WEIGHTED8[n_rows - 1](ws, v0 + c0, stride, j0, j1, part);
        }
      }
    } else {
      for (int k = 0; k < n_rows; ++k) weighted_any(ws[k], v0, stride, a.s, d, accs[k]);
    }
    for (int k = 0; k < n_rows; ++k) {
      float* o = a.out_of(r + k);
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<float>(accs[k][c] * factors[k] / totals[k]);  // mul_, div_
    }
    r += n_rows;
  }
}

// exact.exp32 of one float32: exp32's operations in its order, none fused.
SPECDEC_AVX2 inline float exp32(float x) {
  const float lowest = static_cast<float>(EXP_LOWEST);
  const bool low = x < lowest;
  x = x > lowest ? x : lowest;  // maxps: the second operand where either is NaN
  const float n = std::nearbyint(x * static_cast<float>(LOG2E));
  const float r = x - n * static_cast<float>(LN2_HI) - n * static_cast<float>(LN2_LO);
  float p = EXP_TERMS[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_TERMS[i];
  p = p * (r * r) + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, 4);
  return low ? 0.0f : p * two_n;
}

// exp32's operations on 8 float32s.
SPECDEC_AVX2 inline __m256 exp32x8(__m256 x) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 lowest = _mm256_set1_ps(static_cast<float>(EXP_LOWEST));
  const __m256 low = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(static_cast<float>(LOG2E))), NEAREST);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(static_cast<float>(LN2_HI)))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(static_cast<float>(LN2_LO))));
  __m256 p = _mm256_set1_ps(EXP_TERMS[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_TERMS[i]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256 two_n = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(low, _mm256_mul_ps(p, two_n));
}

// exp32_rows's: each float64 rounded to float32, exp32, widened back, 8 a step.
SPECDEC_AVX2 void exp32_rows(double* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128 lo = _mm256_cvtpd_ps(_mm256_loadu_pd(x + i)), hi = _mm256_cvtpd_ps(_mm256_loadu_pd(x + i + 4));
    const __m256 e = exp32x8(_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1));
    _mm256_storeu_pd(x + i, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    _mm256_storeu_pd(x + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  for (; i < n; ++i) x[i] = static_cast<double>(exp32(static_cast<float>(x[i])));
}

}  // namespace avx2
}  // namespace
#endif

// exact.query_levels: a query's fixed-point levels, the most up to KEY_LEVELS whose score (a sum of d
// products with keys of KEY_LEVELS) stays within 2**30, so int32 lanes sum it exactly.
double query_levels(int64_t d) {
  double levels = KEY_LEVELS;
  while (levels > 1 && levels * KEY_LEVELS * static_cast<double>(d) > 1073741824.0) levels /= 2;
  return levels;
}

// Query rows a thread of the attention takes at least: rows go to torch's threads only where each
// gets about a million multiply-adds (waking a thread costs more than a one-token pass's attention).
int64_t attention_grain(int64_t s, int64_t d) {
  return std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, 2 * s * d));
}

// What an attention call keeps between calls: the scores and the queries' integers.
struct AttendScratch {
  std::vector<double> sc, q_int, q_step;
};

// The operands of exact.attention over raw memory: (B, H, T, D) float32 queries, (B, Hkv, S, D + 1)
// float32 keys and values in fixed point (exact.stored: keys at KEY_LEVELS) at their strides over B,
// Hkv and S, the mask (B, 1, T, S - first) or null; out: (B, T, H, D) float32.
struct AttendArgs {
  const float* q;
  const float* k;
  const float* v;
  int64_t k_strides[3], v_strides[3];
  const bool* mask;
  float* out;
  int64_t b, heads, kv_heads, t, s, d, first;
  double scaling, levels;
  // Attend's kept pairs and steps (Stack::run's `kept`), where a pass has them
  const int32_t* kept_pairs = nullptr;
  const double* kept_k_steps = nullptr;
  const double* kept_v_steps = nullptr;
  int64_t kept_cap = 0;
};

// exact.attention's arithmetic for query rows t0..t0+t-1, in one call: each float operation is
// exact.py's own, in its order; the sums over the head dimension are of integers within 2**30 and
// those over keys of integers below 2**53; exp is exact.exp32's operations.
void attend_rows(const AttendArgs& x, int64_t t0, int64_t t, AttendScratch& scratch) {
#ifdef SPECDEC_X86
  const int64_t group = x.heads / x.kv_heads, n = x.b * x.kv_heads, s = x.s, d = x.d;
  const int64_t rows = group * t, size = n * rows * s, s8 = (s + 7) / 8 * 8;
  scratch.sc.resize(static_cast<size_t>(size));
  scratch.q_int.resize(static_cast<size_t>(n * rows * d));
  scratch.q_step.resize(static_cast<size_t>(n * rows));
  const Attend a{x.q,
                 x.k,
                 x.v,
                 {x.k_strides[0], x.k_strides[1], x.k_strides[2]},
                 {x.v_strides[0], x.v_strides[1], x.v_strides[2]},
                 x.mask,
                 scratch.sc.data(),
                 scratch.q_int.data(),
                 scratch.q_step.data(),
                 x.out,
                 x.heads,
                 x.kv_heads,
                 group,
                 t,
                 s,
                 s8,
                 d,
                 x.first,
                 t0,
                 x.t,
                 x.scaling,
                 x.levels,
                 query_levels(d),
                 x.kept_pairs,
                 x.kept_k_steps,
                 x.kept_v_steps,
                 x.kept_cap};
  const int64_t grain = attention_grain(s, d);
  using Rows = void (*)(const Attend&, int64_t, int64_t);
  Rows scores = d == 64 ? &score_rows<8> : d == 128 ? &score_rows<16> : &score_rows<0>;
  Rows weigh = d == 64 ? &weigh_rows<8> : d == 128 ? &weigh_rows<16> : &weigh_rows<0>;
  void (*exp_rows)(double*, int64_t) = &exp32_rows;
  if (!vnni()) {
    scores = d == 64 ? &avx2::score_rows<8> : d == 128 ? &avx2::score_rows<16> : &avx2::score_rows<0>;
    weigh = &avx2::weigh_rows;
    exp_rows = &avx2::exp32_rows;
  }
  at::parallel_for(0, n * rows, grain, [&](int64_t r0, int64_t r1) { scores(a, r0, r1); });
  // a verify pass's rows split over the threads, 16 numbers a step
  at::parallel_for(0, (size + 15) / 16, 512, [&](int64_t i0, int64_t i1) {
    exp_rows(scratch.sc.data() + 16 * i0, std::min(size, 16 * i1) - 16 * i0);
  });
  at::parallel_for(0, n * rows, grain, [&](int64_t r0, int64_t r1) { weigh(a, r0, r1); });
#endif
}

// attend_rows over ROWS query rows a call, as exact.attention: a long prefill's float64 scores stay
// a few tens of MB.
void attend(const AttendArgs& x, AttendScratch& scratch) {
  constexpr int64_t ROWS = 128;  // exact.ROWS
  for (int64_t t0 = 0; t0 < x.t; t0 += ROWS) attend_rows(x, t0, std::min(ROWS, x.t - t0), scratch);
}

// A (B, Hkv, S, D + 1) float32 key or value tensor whose positions' numbers are contiguous (the cache's
// view as it is), copied where they are not.
at::Tensor rows_contiguous(const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

// attention's `blocked`, (B, 1, T, S - first), as contiguous bools, checked against the pass's shape.
at::Tensor blocked_rows(const at::Tensor& blocked, int64_t b, int64_t t, int64_t s, int64_t first) {
  TORCH_CHECK(first >= 0 && first <= s && blocked.dim() == 4 && blocked.size(0) == b && blocked.size(1) == 1 &&
                  blocked.size(2) == t && blocked.size(3) == s - first,
              "a mask of (B, 1, T, S - first)");
  return blocked.to(at::kBool).contiguous();
}

// The attention's operands from tensors (its `out` unset): float32 queries made contiguous, the cache's
// keys and values read in place (views of buffers with room to spare) wherever each position's D + 1
// numbers are contiguous, the mask as contiguous bools; `held` keeps whatever was copied alive.
AttendArgs attend_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first,
                       const c10::optional<at::Tensor>& blocked, double scaling, double levels,
                       std::vector<at::Tensor>& held) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "attention takes float32 queries and float32 fixed-point keys and values (exact.stored)");
  const int64_t b = query.size(0), t = query.size(2), d = query.size(3);
  TORCH_CHECK(key.size(3) == d + 1 && value.size(3) == d + 1, "keys and values carry their step as a last column");
  TORCH_CHECK(key.size(0) == b && value.size(0) == b && value.size(1) == key.size(1) && value.size(2) == key.size(2) &&
                  query.size(1) % key.size(1) == 0,
              "keys and values of the queries' batch, kv heads that divide the query heads");
  held.reserve(held.size() + 4);  // the references below stay valid
  const auto& q = held.emplace_back(query.contiguous());
  const auto& k = held.emplace_back(rows_contiguous(key));
  const auto& v = held.emplace_back(rows_contiguous(value));
  const bool* mask = nullptr;
  if (blocked.has_value()) mask = held.emplace_back(blocked_rows(*blocked, b, t, k.size(2), first)).data_ptr<bool>();
  return {q.data_ptr<float>(),
          k.data_ptr<float>(),
          v.data_ptr<float>(),
          {k.stride(0), k.stride(1), k.stride(2)},
          {v.stride(0), v.stride(1), v.stride(2)},
          mask,
          nullptr,
          b,
          q.size(1),
          k.size(1),
          t,
          k.size(2),
          d,
          first,
          scaling,
          levels};
}

// exact.attention's arithmetic: (B, H, T, D) float32 queries over (B, Hkv, S, D + 1) float32 keys and
// values in fixed point (exact.stored: keys at KEY_LEVELS, values at FIXED) -> (B, T, H, D) float32.
// `blocked`: (B, 1, T, S - first) bool, True where a row may not see a key from slot `first` on, or None.
at::Tensor attention(at::Tensor query, at::Tensor key, at::Tensor value, int64_t first,
                     c10::optional<at::Tensor> blocked, double scaling, double levels) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the exact attention kernel needs an x86-64 CPU with AVX-512");
#else
  std::vector<at::Tensor> held;
  AttendArgs x = attend_args(query, key, value, first, blocked, scaling, levels, held);
  auto out = at::empty({x.b, x.t, x.heads, x.d}, query.options());
  x.out = out.data_ptr<float>();
  AttendScratch scratch;
  attend(x, scratch);
  return out;
#endif
}

#ifdef SPECDEC_X86
namespace {

// ceil(log2(x)) as ATen's utils::CeilLog2 (1 for x <= 2)
int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// Eight numbers' squares, each rounded as pow(2)'s.
__attribute__((target("avx2"))) inline __m256 squared(const float* x) {
  const __m256 a = _mm256_loadu_ps(x);
  return _mm256_mul_ps(a, a);
}

// The sum of a contiguous float32 row's squares, in the order of ATen's sum (SumKernel.cpp's cascade
// over 8-lane vectors, which ATen runs for float32 on AVX2 and AVX-512 machines alike: four vector
// accumulators, folded level by level every 16 groups, then the lanes added one by one), so
// squares.mean() and this give the same bits where ATen sums a row on one thread. A torch whose sum
// took another order would fail test_int8_kernel's norm test, not pass quietly.
__attribute__((target("avx2"))) float row_sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t W = 8, ILP = 4, LEVELS = 4;
  const int64_t vectors = n / W, groups = vectors / ILP;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / LEVELS), step = int64_t(1) << power;
  const int64_t mask = step - 1;
  __m256 acc[LEVELS][ILP];
  for (auto& level : acc) for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], squared(x + (ILP * i + k) * W));
    }
    for (int64_t j = 1; j < LEVELS; ++j) {
      for (int64_t k = 0; k < ILP; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if (i & (mask << (j * power))) break;
    }
  }
  for (; i < groups; ++i) {
    for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], squared(x + (ILP * i + k) * W));
  }
  for (int64_t j = 1; j < LEVELS; ++j) {
    for (int64_t k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  }
  for (int64_t v = groups * ILP; v < vectors; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], squared(x + v * W));
  __m256 sum = acc[0][0];
  for (int64_t k = 1; k < ILP; ++k) sum = _mm256_add_ps(sum, acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vectors * W; e < n; ++e) {
    const float sq = x[e] * x[e];
    total += sq;
  }
  alignas(32) float lanes[W];
  _mm256_store_ps(lanes, sum);
  for (int64_t k = 0; k < W; ++k) total += lanes[k];
  return total;
}

}  // namespace
#endif

// A Llama RMSNorm of `rows` float32 rows of `hidden` numbers into out, with LlamaRMSNorm.forward's
// bits, each step the same IEEE operation on each number (x·x as pow(2), the mean as ATen's sum then
// / H, + eps in float32, 1/sqrt as ATen's rsqrt, then the two products), written here because ATen's
// six small calls cost more than the row's arithmetic. The sums are row_sum_of_squares's where ATen
// sums each row on one thread (fewer than its grain of numbers), ATen's own mean elsewhere.
void rms_rows(const float* xs, int64_t rows, int64_t hidden, const float* ws, double eps, float* os) {
  const float e = static_cast<float>(eps);
  auto normed = [&](int64_t r, float var) {
    const float inv = 1.0f / std::sqrt(var + e);
    const float* xr = xs + r * hidden;
    float* o = os + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const float scaled = xr[i] * inv;
      o[i] = ws[i] * scaled;
    }
  };
#ifdef SPECDEC_X86
  if (rows * hidden < GRAIN && hidden >= 8) {  // ATen sums rows shorter than a vector by another loop
    for (int64_t r = 0; r < rows; ++r) {
      normed(r, row_sum_of_squares(xs + r * hidden, hidden) / static_cast<float>(hidden));
    }
    return;
  }
#endif
  auto squares = at::empty({rows, hidden}, at::kFloat);
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * hidden; ++i) sq[i] = xs[i] * xs[i];
  auto mean = squares.mean(-1, true).contiguous();
  const float* var = mean.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) normed(r, var[r]);
}

at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps) {
  auto x = h.to(at::kFloat).contiguous();
  auto w = weight.to(at::kFloat).contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(1, hidden);
  TORCH_CHECK(w.numel() == hidden, "a norm weight per hidden number");
  auto out = at::empty_like(x);
  rms_rows(x.data_ptr<float>(), rows, hidden, w.data_ptr<float>(), eps, out.data_ptr<float>());
  return out;
}

#ifdef SPECDEC_X86
namespace {

// exact.fixed's rows with their step as a last column (exact.stored): fixed_row's integers as float32,
// then the step.
SPECDEC_AVX512 void stored_row(const float* x, int64_t d, double levels, float* out) {
  out[d] = static_cast<float>(fixed_row(x, d, STORED_LEAST, levels, out));
}

// x·cos + rotate_half(x)·sin for one head of d numbers (d/2 a whole number of vectors): each product
// rounded, then the sum, as ExactAttention.forward's torch ops.
SPECDEC_AVX512 void rotated(const float* x, const float* cs, const float* sn, int64_t d, float* out) {
  const int64_t half_d = d / 2;
  const __m512 minus = _mm512_set1_ps(-0.0f);
  for (int64_t e = 0; e < d; e += 16) {
    const __m512 turned = e < half_d ? _mm512_xor_ps(_mm512_loadu_ps(x + e + half_d), minus)  // -x[e + d/2]
                                     : _mm512_loadu_ps(x + e - half_d);
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(cs + e));
    _mm512_storeu_ps(out + e, _mm512_add_ps(a, _mm512_mul_ps(turned, _mm512_loadu_ps(sn + e))));
  }
}

}  // namespace
#endif

// What a decoder layer's two halves write between their steps, kept by a caller that runs many layers
// (a pass's Stack::run), so that it is allocated once a pass, not once a layer.
struct LayerScratch {
  LinearScratch linear;
  AttendScratch attend;
  std::vector<float> x, qkv, turned, q, k, v, attended, o, h1, gate_up, act, down;
};

template <typename T>
T* sized(std::vector<T>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
  return v.data();
}

// The first half of an exact decoder layer: RMSNorm, the q, k, v layer (one int8 layer), the model's
// rotary embedding on queries and keys (x·cos + rotate_half(x)·sin, each product rounded, as
// ExactAttention.forward), and keys and values in fixed point. No norm weight: no norm. (B, T, H)
// float32 hidden states and (B, T, D) cos and sin -> (B, heads, T, D) queries into qs, (B, kv_heads,
// T, D + 1) keys and values into ks and vs (exact.stored).
void layer_in(const float* h, int64_t b, int64_t t, int64_t hidden, const float* norm_weight, double eps,
              const Weights& qkv_w, int64_t heads, int64_t kv_heads, const float* cs, const float* ss, int64_t d,
              float* qs, float* ks, float* vs, LayerScratch& s) {
#ifdef SPECDEC_X86
  const int64_t width = heads + 2 * kv_heads;
  const float* x = h;
  if (norm_weight != nullptr) {  // none: the layer's input norm is an identity (an EAGLE head's first layer)
    rms_rows(h, b * t, hidden, norm_weight, eps, sized(s.x, b * t * hidden));
    x = s.x.data();
  }
  const float* src = sized(s.qkv, b * t * width * d);
  linear_rows(x, b * t, hidden, qkv_w, s.qkv.data(), s.linear);  // (B·T, width·D)
  const int64_t half_d = d / 2;
  const bool fast = vnni();
  float* turned = sized(s.turned, d);
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t i = 0; i < t; ++i) {
      const float* row = src + (bb * t + i) * width * d;
      const float* ci = cs + (bb * t + i) * d;
      const float* si = ss + (bb * t + i) * d;
      for (int64_t head = 0; head < width; ++head) {
        const float* x_h = row + head * d;
        if (head >= heads + kv_heads) {  // a value: fixed point as it is
          float* out = vs + ((bb * kv_heads + head - heads - kv_heads) * t + i) * (d + 1);
          fast ? stored_row(x_h, d, FIXED, out) : avx2::stored_row(x_h, d, FIXED, out);
          continue;
        }
        if (fast && half_d % 16 == 0) {
          rotated(x_h, ci, si, d, turned);
        } else {
          for (int64_t e = 0; e < d; ++e) {
            volatile float a = x_h[e] * ci[e];
            volatile float r = (e < half_d ? -x_h[e + half_d] : x_h[e - half_d]) * si[e];
            turned[e] = a + r;
          }
        }
        if (head < heads) {
          std::copy(turned, turned + d, qs + ((bb * heads + head) * t + i) * d);
        } else {
          float* out = ks + ((bb * kv_heads + head - heads) * t + i) * (d + 1);
          fast ? stored_row(turned, d, KEY_LEVELS, out) : avx2::stored_row(turned, d, KEY_LEVELS, out);
        }
      }
    }
  }
#endif
}

// (B, T, D) float32 cos or sin for every row of a pass, as the layers read them.
at::Tensor per_row(const at::Tensor& x, int64_t b, int64_t t, int64_t d) {
  return x.to(at::kFloat).expand({b, t, d}).contiguous();
}

std::vector<at::Tensor> attention_in(at::Tensor h, c10::optional<at::Tensor> norm_weight, double eps,
                                     at::Tensor packed,
                                     at::Tensor scale, c10::optional<at::Tensor> bias, int64_t half,
                                     bool wide, int64_t heads, int64_t kv_heads, at::Tensor cos,
                                     at::Tensor sin) {
#ifndef SPECDEC_X86
  TORCH_CHECK(false, "the int8 kernel needs an x86-64 CPU with AVX-512 VNNI");
#else
  const int64_t b = h.size(0), t = h.size(1), d = cos.size(-1), width = heads + 2 * kv_heads;
  auto x = h.to(at::kFloat).contiguous();
  at::Tensor w;
  if (norm_weight.has_value()) w = norm_weight->to(at::kFloat).contiguous();
  auto c = per_row(cos, b, t, d), sn = per_row(sin, b, t, d);
  auto q = at::empty({b, heads, t, d}, x.options());
  auto k = at::empty({b, kv_heads, t, d + 1}, x.options());
  auto v = at::empty({b, kv_heads, t, d + 1}, x.options());
  LayerScratch s;
  layer_in(x.data_ptr<float>(), b, t, h.size(2), norm_weight.has_value() ? w.data_ptr<float>() : nullptr, eps,
           weights_of(packed, scale, bias, width * d, h.size(2), half, wide), heads, kv_heads, c.data_ptr<float>(),
           sn.data_ptr<float>(), d, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), s);
  return {q, k, v};
#endif
}

#ifdef SPECDEC_X86
namespace {

// Reads the weights in `spans` (a pointer and a byte count each) until `done` is set: run on a thread
// the attention leaves idle, it brings the weights the layer reads next nearer (its cache, and the
// shared cache as they leave it) while the memory would otherwise wait on the attention's arithmetic.
// Loads, not prefetch hints, so it never runs ahead of what has arrived.
SPECDEC_AVX512 void warm(const std::vector<std::pair<const uint8_t*, int64_t>>& spans, const std::atomic<bool>& done) {
  __m512i sink = _mm512_setzero_si512();
  for (const auto& [ptr, bytes] : spans) {
    for (int64_t off = 0; off + 512 <= bytes; off += 512) {
      if ((off & 8191) == 0 && done.load(std::memory_order_relaxed)) {
        volatile int keep = _mm512_reduce_or_epi32(sink);
        (void)keep;
        return;
      }
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) sink = _mm512_or_si512(sink, _mm512_loadu_si512(ptr + off + 64 * l));
    }
  }
  volatile int keep = _mm512_reduce_or_epi32(sink);
  (void)keep;
}

}  // namespace

namespace {
namespace avx2 {

// warm's loads, 32 bytes at a time.
SPECDEC_AVX2 void warm(const std::vector<std::pair<const uint8_t*, int64_t>>& spans, const std::atomic<bool>& done) {
  __m256i sink = _mm256_setzero_si256();
  for (const auto& [ptr, bytes] : spans) {
    for (int64_t off = 0; off + 512 <= bytes; off += 512) {
      if ((off & 8191) == 0 && done.load(std::memory_order_relaxed)) {
        volatile int keep = _mm256_extract_epi32(sink, 0);
        (void)keep;
        return;
      }
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr + off + 32 * l)));
      }
    }
  }
  volatile int keep = _mm256_extract_epi32(sink, 0);
  (void)keep;
}

}  // namespace avx2
}  // namespace
#endif

// The second half's weights: the output layer, the norm, gate and up (one layer on int8 rows), down.
struct OutWeights {
  Weights o;
  const float* norm;
  double eps;
  Weights up, down;
};

// The second half: attention over the cached keys and values, the output layer, the residual, RMSNorm,
// the MLP (gate and up as one int8 layer on int8 rows, SiLU on whole-row slices below ATen's grain, as
// exact.silu, times up, down) and its residual. (B, T, H) hidden states h and the attention's operands
// (its `out` unused) -> (B, T, H) hidden states into out.
void layer_out(const float* h, int64_t hidden, AttendArgs x, const OutWeights& w, float* out, LayerScratch& s) {
  const int64_t rows = x.b * x.t;
  x.out = sized(s.attended, rows * x.heads * x.d);  // (B, T, H, D)
#ifdef SPECDEC_X86
  // A few rows' attention runs on one thread (attend_rows's grain): the other then warms what it
  // reads after its first kv head's keys (the other heads' keys, or their kept pairs, then every
  // head's values: a pass's weights have pushed them out of the caches since the last pass), then this
  // layer's output, gate-and-up and down weights, read next at the memory's speed.
  const bool alone = x.t <= 128 && x.b * x.heads * x.t <= attention_grain(x.s, x.d);
  if (alone && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    std::vector<std::pair<const uint8_t*, int64_t>> spans;
    const int64_t s32 = (x.s + 31) / 32 * 32;
    for (int64_t nn = 1; x.kept_pairs && nn < x.b * x.kv_heads; ++nn) {  // what a kept head's scores read
      spans.emplace_back(reinterpret_cast<const uint8_t*>(x.kept_pairs + nn * (x.d / 2) * x.kept_cap), s32 * x.d * 2);
    }
    for (int kind = x.kept_pairs ? 1 : 0; kind < 2; ++kind) {
      const float* base = kind == 0 ? x.k : x.v;
      const int64_t* strides = kind == 0 ? x.k_strides : x.v_strides;
      const int64_t head_bytes = ((x.s - 1) * strides[2] + x.d + 1) * 4;  // a head's positions, to its last number
      for (int64_t nn = kind == 0 ? 1 : 0; nn < x.b * x.kv_heads; ++nn) {
        const float* head = base + nn / x.kv_heads * strides[0] + nn % x.kv_heads * strides[1];
        spans.emplace_back(reinterpret_cast<const uint8_t*>(head), head_bytes);
      }
    }
    for (const Weights* layer : {&w.o, &w.up, &w.down}) spans.emplace_back(layer->packed, layer->bytes);
    std::atomic<bool> done{false};
    at::parallel_for(0, 2, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        if (i == 0) {
          attend(x, s.attend);
          done.store(true, std::memory_order_relaxed);
        } else if (vnni()) {
          warm(spans, done);
        } else {
          avx2::warm(spans, done);
        }
      }
    });
  } else {
    attend(x, s.attend);
  }
#else
  attend(x, s.attend);
#endif
  const int64_t n = rows * hidden;
  linear_rows(x.out, rows, x.heads * x.d, w.o, sized(s.o, n), s.linear);
  float* h1 = sized(s.h1, n);
  for (int64_t i = 0; i < n; ++i) h1[i] = h[i] + s.o[i];
  rms_rows(h1, rows, hidden, w.norm, w.eps, sized(s.x, n));
  const int64_t up_n = w.up.n, inner = up_n / 2;
  const float* gate_up = sized(s.gate_up, rows * up_n);
  linear_rows(s.x.data(), rows, hidden, w.up, s.gate_up.data(), s.linear);
  float* act = sized(s.act, rows * inner);
  for (int64_t r = 0; r < rows; ++r) std::copy(gate_up + r * up_n, gate_up + r * up_n + inner, act + r * inner);
  // ATen's SiLU in place on slices of whole rows below its grain (the row length is a multiple of exact.LANES)
  const int64_t per = std::max<int64_t>(1, GRAIN / inner);
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    auto part = at::from_blob(act + r0 * inner, {std::min(per, rows - r0), inner}, at::kFloat);
    at::silu_out(part, part);
  }
  for (int64_t r = 0; r < rows; ++r) {  // times up, each product rounded as mul_'s
    const float* up = gate_up + r * up_n + inner;
    float* a = act + r * inner;
    for (int64_t i = 0; i < inner; ++i) a[i] = a[i] * up[i];
  }
  linear_rows(act, rows, inner, w.down, sized(s.down, n), s.linear);
  for (int64_t i = 0; i < n; ++i) out[i] = h1[i] + s.down[i];
}

at::Tensor attention_out(at::Tensor h, at::Tensor q, at::Tensor k, at::Tensor v, int64_t first,
                         c10::optional<at::Tensor> blocked, double scaling, double levels, at::Tensor o_packed,
                         at::Tensor o_scale, c10::optional<at::Tensor> o_bias, int64_t o_half, bool o_wide,
                         at::Tensor norm_weight, double eps, at::Tensor up_packed, at::Tensor up_scale,
                         c10::optional<at::Tensor> up_bias, int64_t up_n, at::Tensor down_packed,
                         at::Tensor down_scale, c10::optional<at::Tensor> down_bias, int64_t down_half,
                         bool down_wide) {
  TORCH_CHECK(h.scalar_type() == at::kFloat, "a layer's second half takes float32 hidden states");
  const int64_t b = h.size(0), t = h.size(1), hidden = h.size(2), d = q.size(3);
  TORCH_CHECK(q.size(0) == b && q.size(2) == t, "queries of the hidden states' batch and positions");
  auto x = h.contiguous();
  auto w = norm_weight.to(at::kFloat).contiguous();
  std::vector<at::Tensor> held;
  const AttendArgs args = attend_args(q, k, v, first, blocked, scaling, levels, held);
  TORCH_CHECK(w.numel() == hidden, "a norm weight per hidden number");
  const OutWeights weights{weights_of(o_packed, o_scale, o_bias, hidden, q.size(1) * d, o_half, o_wide),
                           w.data_ptr<float>(), eps, weights_of(up_packed, up_scale, up_bias, up_n, hidden, 0, false),
                           weights_of(down_packed, down_scale, down_bias, hidden, up_n / 2, down_half, down_wide)};
  auto out = at::empty({b, t, hidden}, x.options());
  LayerScratch s;
  layer_out(x.data_ptr<float>(), hidden, args, weights, out.data_ptr<float>(), s);
  return out;
}

// A decoder stack's layers as one call: each layer's arguments (the tuples exact_model gathers) are
// converted once, and each pass runs layer_in, writes the new keys and values into the cache's
// buffers in place (a growing cache's, with room for them), and runs layer_out, layer after layer:
// the same arithmetic in the same order as one layer at a time, so the same bits, without a return to
// Python and a cache update through transformers between the two halves of every layer, and with one
// scratch for every layer's steps.
class Stack {
 public:
  explicit Stack(const py::list& layers) {
    for (const auto& item : layers) {
      const auto pair = item.cast<py::tuple>();
      const auto in = pair[0].cast<py::tuple>(), out = pair[1].cast<py::tuple>();
      TORCH_CHECK(in.size() == 9 && out.size() == 18, "a layer's kernel arguments: 9 into, 18 out of");
      Layer l;
      auto kept = [&](const at::Tensor& x) -> const at::Tensor& { return l.held.emplace_back(x); };
      auto kept_bias = [&](const py::handle& x) -> c10::optional<at::Tensor> {
        auto bias = x.cast<c10::optional<at::Tensor>>();
        if (bias.has_value()) return kept(*bias);
        return bias;
      };
      l.held.reserve(16);  // the references kept() returns stay valid
      const auto& norm = kept(out[7].cast<at::Tensor>().to(at::kFloat).contiguous());
      const int64_t hidden = norm.numel();
      l.heads = in[7].cast<int64_t>();
      l.kv_heads = in[8].cast<int64_t>();
      const auto& qkv_scale = kept(in[3].cast<at::Tensor>());
      const int64_t width = l.heads + 2 * l.kv_heads, d = qkv_scale.numel() / width;
      TORCH_CHECK(layers_.empty() || (hidden == hidden_ && d == d_),
                  "a stack's layers of one hidden size and head size");
      hidden_ = hidden;
      d_ = d;
      const auto in_norm = in[0].cast<c10::optional<at::Tensor>>();
      if (in_norm.has_value()) {
        TORCH_CHECK(in_norm->numel() == hidden, "a norm weight per hidden number");
        l.in_norm = kept(in_norm->to(at::kFloat).contiguous()).data_ptr<float>();
      }
      l.in_eps = in[1].cast<double>();
      l.qkv = weights_of(kept(in[2].cast<at::Tensor>()), qkv_scale, kept_bias(in[4]), width * d, hidden,
                         in[5].cast<int64_t>(), in[6].cast<bool>());
      l.scaling = out[0].cast<double>();
      l.levels = out[1].cast<double>();
      const int64_t up_n = out[12].cast<int64_t>();
      l.out = {weights_of(kept(out[2].cast<at::Tensor>()), kept(out[3].cast<at::Tensor>()), kept_bias(out[4]),
                          hidden, l.heads * d, out[5].cast<int64_t>(), out[6].cast<bool>()),
               norm.data_ptr<float>(), out[8].cast<double>(),
               weights_of(kept(out[9].cast<at::Tensor>()), kept(out[10].cast<at::Tensor>()), kept_bias(out[11]),
                          up_n, hidden, 0, false),
               weights_of(kept(out[13].cast<at::Tensor>()), kept(out[14].cast<at::Tensor>()),
                          kept_bias(out[15]), hidden, up_n / 2, out[16].cast<int64_t>(), out[17].cast<bool>())};
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(!layers_.empty(), "a stack of at least one layer");
  }

  // (B, T, H) float32 hidden states through the layers; keys[i] and values[i] are layer i's cache
  // buffers, (B, Hkv, room, D + 1) contiguous float32 with the new positions from `start` fitting inside;
  // `first` and `blocked` as attention's. `kept`: none, or for each layer what the cache keeps beside its
  // buffers, its keys' int16 pairs (B·Hkv, D / 2 · cap) int32 and its keys' and values' steps (2, B·Hkv,
  // cap) float64 (cap: a multiple of 32 at least the buffers' room), right up to position `kept_from`;
  // the pass brings them up to start + T. -> [the last layer's hidden states, then the states entering
  // each layer in `taps`, in the order of taps].
  std::vector<at::Tensor> run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                              const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                              int64_t start, int64_t first, const c10::optional<at::Tensor>& blocked,
                              const std::vector<int64_t>& taps, const std::vector<at::Tensor>& kept,
                              int64_t kept_from) const {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "a key and a value buffer a layer");
    TORCH_CHECK(kept.empty() || kept.size() == 2 * layers_.size(), "two kept tensors a layer, or none");
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 3 && h.size(2) == hidden_ && cos.size(-1) == d_,
                "float32 hidden states and rotary of the stack's sizes");
    const int64_t b = h.size(0), t = h.size(1), hidden = hidden_, d = d_, n = b * t * hidden;
    auto x = h.contiguous();
    auto c = per_row(cos, b, t, d), sn = per_row(sin, b, t, d);
    at::Tensor mask;
    if (blocked.has_value()) mask = blocked_rows(*blocked, b, t, start + t, first);
    std::vector<bool> tapped(layers_.size(), false);
    for (const int64_t i : taps) tapped.at(static_cast<size_t>(i)) = true;
    std::vector<at::Tensor> entering(layers_.size());
    auto result = at::empty({b, t, hidden}, x.options());
    std::vector<float> ping(static_cast<size_t>(n)), pong(static_cast<size_t>(n));
    LayerScratch s;
    const float* now = x.data_ptr<float>();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (tapped[i]) {
        entering[i] = i == 0 ? x : at::empty({b, t, hidden}, x.options());
        if (i > 0) std::copy(now, now + n, entering[i].data_ptr<float>());
      }
      float* q = sized(s.q, b * l.heads * t * d);
      float* k = sized(s.k, b * l.kv_heads * t * (d + 1));
      float* v = sized(s.v, b * l.kv_heads * t * (d + 1));
      layer_in(now, b, t, hidden, l.in_norm, l.in_eps, l.qkv, l.heads, l.kv_heads, c.data_ptr<float>(),
               sn.data_ptr<float>(), d, q, k, v, s);
      place(k, b, l.kv_heads, t, d + 1, keys[i], start);
      place(v, b, l.kv_heads, t, d + 1, values[i], start);
      int32_t* pairs = nullptr;
      double* steps = nullptr;
      int64_t cap = 0;
      if (!kept.empty()) {
        const at::Tensor &kp = kept[2 * i], &ks = kept[2 * i + 1];
        cap = ks.dim() == 3 ? ks.size(2) : 0;
        TORCH_CHECK((d == 64 || d == 128) && kp.scalar_type() == at::kInt && ks.scalar_type() == at::kDouble &&
                        kp.is_contiguous() && ks.is_contiguous() && cap % 32 == 0 && cap >= keys[i].size(2) &&
                        values[i].sizes() == keys[i].sizes() &&
                        ks.size(0) == 2 && ks.size(1) == b * l.kv_heads && kp.numel() == b * l.kv_heads * d / 2 * cap &&
                        kept_from >= 0 && kept_from <= start,
                    "kept key pairs and steps for a head size of 64 or 128, with room for the cache's positions");
        pairs = kp.data_ptr<int32_t>();
        steps = ks.data_ptr<double>();
#ifdef SPECDEC_X86
        keep_positions(keys[i].data_ptr<float>(), values[i].data_ptr<float>(), b * l.kv_heads, keys[i].size(2), d,
                       kept_from, start + t, pairs, steps, steps + b * l.kv_heads * cap, cap);
#endif
      }
      const AttendArgs args{q,
                            keys[i].data_ptr<float>(),
                            values[i].data_ptr<float>(),
                            {keys[i].stride(0), keys[i].stride(1), keys[i].stride(2)},
                            {values[i].stride(0), values[i].stride(1), values[i].stride(2)},
                            blocked.has_value() ? mask.data_ptr<bool>() : nullptr,
                            nullptr,
                            b,
                            l.heads,
                            l.kv_heads,
                            t,
                            start + t,
                            d,
                            first,
                            l.scaling,
                            l.levels,
                            pairs,
                            steps,
                            steps ? steps + b * l.kv_heads * cap : nullptr,
                            cap};
      float* next = i + 1 == layers_.size() ? result.data_ptr<float>() : now == ping.data() ? pong.data() : ping.data();
      layer_out(now, hidden, args, l.out, next, s);
      now = next;
    }
    std::vector<at::Tensor> out{result};
    for (const int64_t i : taps) out.push_back(entering.at(static_cast<size_t>(i)));
    return out;
  }

 private:
  // A layer's weights as the kernel reads them, checked once against the stack's sizes.
  struct Layer {
    std::vector<at::Tensor> held;  // what the pointers below read
    const float* in_norm = nullptr;  // none: no input norm (an EAGLE head's first layer)
    double in_eps, scaling, levels;
    int64_t heads, kv_heads;
    Weights qkv;
    OutWeights out;
  };
  std::vector<Layer> layers_;
  int64_t hidden_ = 0, d_ = 0;  // every layer's hidden size and head size

  // new (B, Hkv, T, width) rows into a (B, Hkv, room, width) buffer's positions start..start+T-1, in place
  static void place(const float* rows, int64_t b, int64_t kv_heads, int64_t t, int64_t width,
                    const at::Tensor& buffer, int64_t start) {
    TORCH_CHECK(buffer.dim() == 4 && buffer.is_contiguous() && buffer.scalar_type() == at::kFloat &&
                    buffer.size(0) == b && buffer.size(1) == kv_heads && buffer.size(3) == width &&
                    start + t <= buffer.size(2),
                "a cache buffer with room for the new keys and values");
    const int64_t heads = b * kv_heads, room = buffer.size(2);
    float* dst = buffer.data_ptr<float>();
    for (int64_t hh = 0; hh < heads; ++hh) {
      std::copy(rows + hh * t * width, rows + (hh + 1) * t * width, dst + (hh * room + start) * width);
    }
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU runs the kernel (AVX-512 VNNI or AVX2)");
  m.def("isa", &isa, "the instruction set the kernel runs on");
  m.def("isas", &isas, "the instruction sets this CPU runs the kernel on, the widest first");
  m.def("use", &use, "run the kernel on this instruction set from now on");
  m.def("huge_buffer", &huge_buffer, "uint8 on memory that may be backed by 2 MB pages");
  m.def("pack", &pack, "(N, K) int8 rows in the kernel's layout, shifted into uint8");
  m.def("linear", &linear, "the exact int8 linear layer");
  m.def("attention", &attention, "the exact attention over fixed-point keys and values");
  m.def("attention_in", &attention_in, "an exact decoder layer up to its keys and values");
  m.def("rms_norm", &rms_norm, "a Llama RMSNorm with its module's bits");
  m.def("attention_out", &attention_out, "an exact decoder layer from its attention on");
  py::class_<Stack>(m, "Stack", "a decoder stack's layers as one call")
      .def(py::init<const py::list&>())
      // the GIL goes while the stack runs (it reads no Python object): other requests' threads go on
      .def("run", &Stack::run, "hidden states through every layer, the cache written in place",
           py::call_guard<py::gil_scoped_release>());
}
