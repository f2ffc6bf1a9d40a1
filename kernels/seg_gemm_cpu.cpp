// Per-segment GEMM for few rows on the CPU (AVX2 + FMA): y[s:e] = x[s:e] @ w[slot].T for each
// segment (s, e, slot) of the token buffer, the weights read in place from the buffer
// w [capacity, N, K]. Built at run time by itif/runtime/cpu_gemm.py (torch.utils.cpp_extension).
//
// Why: with 16 rows a tenant (a decode step: 4 requests x 4 beams), MKL's sgemm repacks the
// weight panel on every call and reaches about 45% of this CPU's FMA peak; here each weight
// element is loaded once and broadcast against 16 rows held transposed in L1, 12 accumulators
// in registers (6 weight rows x 16 rows), which reaches about 70%.
//
// Layout: the rows of a segment are cut in chunks of 16, each transposed (and zero-padded) to
// xT [K, 16]; a task is (segment, block of NBLK weight rows, chunk), ordered so the chunks of
// one segment read the same weight block one after another (from cache, not memory).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t NBLK = 48;  // weight rows per task (a multiple of 6)

// y[r, n] for r < rows, n in [n0, n1): xT [K, 16] (16-float aligned rows), w [N, K].
void block16(const float* xT, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
             int64_t ldy, int64_t rows) {
  alignas(32) float tmp[6][16];
  for (int64_t n = n0; n < n1; n += 6) {
    const int nb = static_cast<int>(std::min<int64_t>(6, n1 - n));
    // past the last column: repeat it (computed, never stored)
    const float* w0 = w + n * K;
    const float* w1 = w + (n + std::min(1, nb - 1)) * K;
    const float* w2 = w + (n + std::min(2, nb - 1)) * K;
    const float* w3 = w + (n + std::min(3, nb - 1)) * K;
    const float* w4 = w + (n + std::min(4, nb - 1)) * K;
    const float* w5 = w + (n + std::min(5, nb - 1)) * K;
    // named accumulators: an array of them is kept in memory by the compiler
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float* xp = xT;
// one weight row j: its element k broadcast against the 16 rows (two halves of 8)
#define ITIF_FMA_ROW(j)                              \
  b = _mm256_broadcast_ss(w##j + k);                 \
  a##j##0 = _mm256_fmadd_ps(b, x0, a##j##0);         \
  a##j##1 = _mm256_fmadd_ps(b, x1, a##j##1);
#define ITIF_STORE_ROW(j)                            \
  _mm256_store_ps(tmp[j], a##j##0);                  \
  _mm256_store_ps(tmp[j] + 8, a##j##1);
    for (int64_t k = 0; k < K; ++k, xp += 16) {
      const __m256 x0 = _mm256_load_ps(xp), x1 = _mm256_load_ps(xp + 8);
      __m256 b;
      ITIF_FMA_ROW(0) ITIF_FMA_ROW(1) ITIF_FMA_ROW(2) ITIF_FMA_ROW(3) ITIF_FMA_ROW(4) ITIF_FMA_ROW(5)
    }
    ITIF_STORE_ROW(0) ITIF_STORE_ROW(1) ITIF_STORE_ROW(2) ITIF_STORE_ROW(3) ITIF_STORE_ROW(4)
    ITIF_STORE_ROW(5)
#undef ITIF_FMA_ROW
#undef ITIF_STORE_ROW
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + r * ldy + n;
      for (int j = 0; j < nb; ++j) yr[j] = tmp[j][r];
    }
  }
}

}  // namespace

// x [R, K], w [capacity, N, K], out [R, N]: float32, contiguous, on the CPU; start/end/slot:
// the segments (they need not tile R; rows outside every segment are left as they are).
void seg_gemm(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& start,
              const std::vector<int64_t>& end, const std::vector<int64_t>& slot,
              torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && out.dim() == 2, "seg_gemm: x [R, K], w [C, N, K], out [R, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              out.scalar_type() == at::kFloat, "seg_gemm: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "seg_gemm: contiguous operands only");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(1), cap = w.size(0);
  TORCH_CHECK(w.size(2) == K && out.size(0) == R && out.size(1) == N, "seg_gemm: shapes differ");
  TORCH_CHECK(start.size() == end.size() && end.size() == slot.size(), "seg_gemm: segment lists differ");
  std::vector<int64_t> cs, ce, cw, seg_first;  // chunks: rows [cs, ce) of slot cw
  for (size_t i = 0; i < start.size(); ++i) {
    TORCH_CHECK(0 <= start[i] && start[i] <= end[i] && end[i] <= R, "seg_gemm: segment out of rows");
    TORCH_CHECK(0 <= slot[i] && slot[i] < cap, "seg_gemm: slot out of the buffer");
    seg_first.push_back(static_cast<int64_t>(cs.size()));
    for (int64_t s = start[i]; s < end[i]; s += 16) {
      cs.push_back(s);
      ce.push_back(std::min(s + 16, end[i]));
      cw.push_back(slot[i]);
    }
  }
  seg_first.push_back(static_cast<int64_t>(cs.size()));
  const int64_t C = static_cast<int64_t>(cs.size());
  if (C == 0 || N == 0) return;
  auto xT = torch::empty({C, K, 16}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xtp = xT.data_ptr<float>();
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* t = xtp + c * K * 16;
      const int64_t rows = ce[c] - cs[c];
      if (rows < 16) std::fill(t, t + K * 16, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + (cs[c] + r) * K;
        for (int64_t k = 0; k < K; ++k) t[k * 16 + r] = xr[k];
      }
    }
  });
  // tasks: (segment, weight block, chunk of the segment)
  const int64_t nblocks = (N + NBLK - 1) / NBLK;
  std::vector<int64_t> task_chunk, task_block;
  for (size_t i = 0; i + 1 < seg_first.size(); ++i)
    for (int64_t b = 0; b < nblocks; ++b)
      for (int64_t c = seg_first[i]; c < seg_first[i + 1]; ++c) {
        task_chunk.push_back(c);
        task_block.push_back(b);
      }
  const float* wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(task_chunk.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = task_chunk[t], n0 = task_block[t] * NBLK, n1 = std::min(N, n0 + NBLK);
      block16(xtp + c * K * 16, wp + cw[c] * N * K, K, n0, n1, yp + cs[c] * N, N, ce[c] - cs[c]);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("seg_gemm", &seg_gemm, "y[s:e] = x[s:e] @ w[slot].T per segment (CPU, AVX2, float32)");
}
