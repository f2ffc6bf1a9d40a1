// Variable-length self-attention on the CPU: every sequence [cu[s], cu[s+1]) of the token
// buffer attends to itself alone, read in place from qkv [T, 3H] (Q, K, V side by side) and
// written in place into out [T, H]. Built at run time by itif/runtime/cpu_attention.py
// (torch.utils.cpp_extension).
//
// Why (issue 65): torch's CPU attention runs a batch of short sequences of many lengths as
// length groups, each gathered into a padded [n, L, 3H] block (an index_select), with a key
// mask, through the flash-attention kernel, then scattered back (an index_copy): on the peer
// workload (256 requests of 2-100 tokens, 17 groups) that was about half of a BERT forward.
// Here there is no gather, no padding and no mask: one task per (sequence, head), scheduled
// dynamically over the threads since tasks range from 2 to 100 rows.
//
// A task copies its head's keys transposed (Kt [d, L]) and its values ([L, d]) to float32 in a
// per-thread buffer, then for each query row: scores over all keys (broadcast q[k] against a
// row of Kt: no horizontal sums), a max-subtracted softmax in float32, and the weighted sum of
// the values, rounded once to the output type. float32 and bfloat16 (computed in float32).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void run(const T* qkv, T* out, const int64_t* cu, int64_t S, int64_t heads, int64_t d,
         float scale) {
  const int64_t H = heads * d, ld = 3 * H;
  int64_t Lmax = 0;
  for (int64_t s = 0; s < S; ++s) Lmax = std::max(Lmax, cu[s + 1] - cu[s]);
  const int64_t tasks = S * heads;
  const int nthreads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nthreads)
  {
    // per thread: Kt [d, Lmax], V [Lmax, d], scores [Lmax], q and o [d]
    std::vector<float> kt(d * Lmax), vv(Lmax * d), sc(Lmax), q(d), o(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // longest sequences first would balance better, but the buffer's order is cheap to keep
      const int64_t s = t / heads, h = t % heads;
      const int64_t b = cu[s], L = cu[s + 1] - b;
      if (L <= 0) continue;
      const T* base = qkv + b * ld + h * d;
      for (int64_t j = 0; j < L; ++j) {
        const T* kr = base + j * ld + H;
        const T* vr = base + j * ld + 2 * H;
        float* vj = vv.data() + j * d;
        for (int64_t k = 0; k < d; ++k) {
          kt[k * L + j] = static_cast<float>(kr[k]);
          vj[k] = static_cast<float>(vr[k]);
        }
      }
      for (int64_t i = 0; i < L; ++i) {
        const T* qr = base + i * ld;
        for (int64_t k = 0; k < d; ++k) q[k] = static_cast<float>(qr[k]) * scale;
        float* scp = sc.data();
        std::fill(scp, scp + L, 0.0f);
        for (int64_t k = 0; k < d; ++k) {
          const float qk = q[k];
          const float* kk = kt.data() + k * L;
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) scp[j] += qk * kk[j];
        }
        float m = scp[0];
        for (int64_t j = 1; j < L; ++j) m = std::max(m, scp[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          scp[j] = std::exp(scp[j] - m);
          sum += scp[j];
        }
        float* op = o.data();
        std::fill(op, op + d, 0.0f);
        for (int64_t j = 0; j < L; ++j) {
          const float p = scp[j];
          const float* vj = vv.data() + j * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) op[k] += p * vj[k];
        }
        const float inv = 1.0f / sum;
        T* orow = out + (b + i) * H + h * d;
        for (int64_t k = 0; k < d; ++k) orow[k] = static_cast<T>(op[k] * inv);
      }
    }
  }
}

}  // namespace

// qkv [T, 3H] and out [T, H]: float32 or bfloat16 (the same), contiguous, on the CPU; cu: the
// boundaries [S + 1] (int64, ascending, cu[0] >= 0, cu[S] <= T). Rows outside every sequence
// keep out's values. Returns nothing: out is written in place.
void varlen_attention(const torch::Tensor& qkv, const torch::Tensor& cu, int64_t heads,
                      double scale, torch::Tensor& out) {
  TORCH_CHECK(qkv.dim() == 2 && out.dim() == 2 && cu.dim() == 1, "varlen_attention: qkv [T, 3H], out [T, H], cu [S+1]");
  TORCH_CHECK(qkv.is_contiguous() && out.is_contiguous() && cu.is_contiguous(), "varlen_attention: contiguous operands only");
  TORCH_CHECK(qkv.scalar_type() == out.scalar_type(), "varlen_attention: qkv and out differ in dtype");
  TORCH_CHECK(cu.scalar_type() == at::kLong, "varlen_attention: cu int64");
  const int64_t T = qkv.size(0), H = out.size(1);
  TORCH_CHECK(heads > 0 && H % heads == 0 && qkv.size(1) == 3 * H && out.size(0) == T, "varlen_attention: shapes differ");
  const int64_t S = cu.size(0) - 1;
  const int64_t* c = cu.data_ptr<int64_t>();
  TORCH_CHECK(S >= 0, "varlen_attention: cu needs at least one boundary");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(c[s] >= 0 && c[s] <= c[s + 1] && c[s + 1] <= T, "varlen_attention: boundaries out of order or out of range");
  const float sc = static_cast<float>(scale);
  if (qkv.scalar_type() == at::kFloat) {
    run<float>(qkv.data_ptr<float>(), out.data_ptr<float>(), c, S, heads, H / heads, sc);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(qkv.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), c, S, heads, H / heads, sc);
  } else {
    TORCH_CHECK(false, "varlen_attention: float32 or bfloat16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("varlen_attention", &varlen_attention, "Variable-length self-attention on the CPU");
}
