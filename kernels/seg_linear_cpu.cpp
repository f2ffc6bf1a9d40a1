// The CPU's many-rows linear over segments, every segment in one parallel region: for each
// segment (s, e, slot) of the token buffer, y[s:e] = act(x[s:e] @ w[slot].T + bias[bslot])
// (+ residual[s:e]), then optionally LayerNorm with gamma[gslot] and beta[beslot]. Built at run
// time by itif/runtime/cpu_linear.py (torch.utils.cpp_extension).
//
// Why (issue 65): with one oneDNN call per segment, then torch.cat, and then one layer_norm per
// segment and another cat, an 8-tenant forward ran 3-4 OpenMP regions a segment where a
// 1-tenant forward ran one a product. On this project's 2 shared vCPUs each region ends in a
// barrier, and a barrier waits for a thread the host has parked (measured: a 40 MB cat of 3 ms
// alone took 29 ms in the forward). Here the rows are cut in chunks of about `chunk` rows
// (per segment, so a chunk never spans two tenants) and the threads take chunks as they come
// (schedule(dynamic)): one region a product, no barrier per segment, and a thread held up by
// the host leaves its chunks to the other. Each chunk runs oneDNN's fused primitive (bias,
// activation or residual on the output tile; torch's mkldnn::_linear_pointwise, single-threaded
// inside the region) and LayerNorm while the chunk is still in cache, then lands in place in
// the output: no concatenation.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <string>
#include <vector>

namespace {

using PointwiseFn = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::string_view,
                               c10::List<std::optional<at::Scalar>>,
                               std::optional<c10::string_view>);
using BinaryFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::string_view);

struct Task {
  int64_t a, b, seg;
};

// Every segment in equal pieces of at most `chunk` rows (never a thin tail): the tasks.
std::vector<Task> cut(const std::vector<int64_t>& start, const std::vector<int64_t>& end,
                      int64_t R, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "seg_linear: chunk must be positive");
  TORCH_CHECK(start.size() == end.size(), "seg_linear: segment lists differ");
  std::vector<Task> tasks;
  for (size_t i = 0; i < start.size(); ++i) {
    const int64_t len = end[i] - start[i];
    TORCH_CHECK(len >= 0 && start[i] >= 0 && end[i] <= R, "seg_linear: segment out of range");
    if (len == 0) continue;
    const int64_t pieces = (len + chunk - 1) / chunk;
    for (int64_t p = 0; p < pieces; ++p)
      tasks.push_back({start[i] + len * p / pieces, start[i] + len * (p + 1) / pieces,
                       static_cast<int64_t>(i)});
  }
  return tasks;
}

// Runs body(task) for every task, the threads taking tasks as they come; the first exception
// is rethrown on the calling thread once the region ends (the tasks after it are skipped).
template <typename Body>
void for_tasks(const std::vector<Task>& tasks, const Body& body) {
  std::exception_ptr error = nullptr;
  std::atomic<bool> failed{false};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      c10::InferenceMode guard;  // the output may be an inference tensor (written in place)
      body(tasks[t]);
    } catch (...) {
#pragma omp critical
      if (!failed.exchange(true)) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

// x [R, K], w [C, N, K], float32 or bfloat16, contiguous, on the CPU. start/end/slot: the
// segments (they tile [0, R)); bias [Cb, N] or None with its slot per segment; attr/algo: the
// oneDNN post-op as _linear_pointwise takes it ("none", "gelu" + "none"/"tanh", ...); residual
// [R, N] or None (only with attr "none"); gamma/beta [Cg, N] or None with their slots; chunk:
// rows a task takes at most. Returns a new [R, N] tensor.
torch::Tensor seg_linear(const torch::Tensor& x, const torch::Tensor& w,
                         const std::vector<int64_t>& start, const std::vector<int64_t>& end,
                         const std::vector<int64_t>& slot, const std::optional<torch::Tensor>& bias,
                         const std::vector<int64_t>& bias_slot, const std::string& attr,
                         const std::string& algo, const std::optional<torch::Tensor>& residual,
                         const std::optional<torch::Tensor>& gamma,
                         const std::optional<torch::Tensor>& beta,
                         const std::vector<int64_t>& gamma_slot,
                         const std::vector<int64_t>& beta_slot, double eps, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == x.size(1),
              "seg_linear: x [R, K], w [C, N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "seg_linear: contiguous operands only");
  const size_t n_seg = start.size();
  TORCH_CHECK(end.size() == n_seg && slot.size() == n_seg, "seg_linear: segment lists differ");
  TORCH_CHECK(!bias.has_value() || bias_slot.size() == n_seg, "seg_linear: bias slots");
  const bool ln = gamma.has_value() && beta.has_value();
  TORCH_CHECK(!ln || (gamma_slot.size() == n_seg && beta_slot.size() == n_seg),
              "seg_linear: LayerNorm slots");
  const int64_t R = x.size(0), N = w.size(1);
  auto out = at::empty({R, N}, x.options());
  const std::vector<Task> tasks = cut(start, end, R, chunk);
  static auto pointwise = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                              .typed<PointwiseFn>();
  static auto binary = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                           .typed<BinaryFn>();
  for_tasks(tasks, [&](const Task& k) {
    const int64_t rows = k.b - k.a;
    const auto xc = x.narrow(0, k.a, rows);
    const auto wk = w.select(0, slot[k.seg]);
    std::optional<at::Tensor> b;
    if (bias.has_value()) b = bias->select(0, bias_slot[k.seg]);
    at::Tensor y = residual.has_value()
        ? binary.call(xc, residual->narrow(0, k.a, rows), wk, b, "add")
        : pointwise.call(xc, wk, b, attr, c10::List<std::optional<at::Scalar>>(),
                         algo.empty() ? std::optional<c10::string_view>()
                                      : std::optional<c10::string_view>(algo));
    if (ln)
      y = at::layer_norm(y, {N}, gamma->select(0, gamma_slot[k.seg]),
                         beta->select(0, beta_slot[k.seg]), eps);
    out.narrow(0, k.a, rows).copy_(y);
  });
  return out;
}

// LayerNorm of each segment of x [R, H] with gamma[gslot] and beta[bslot] ([C, H] each), in
// one parallel region, chunk by chunk, into a new [R, H] tensor (a text encoder's embedding
// LayerNorm: a call per segment and a concatenation otherwise).
torch::Tensor seg_layer_norm(const torch::Tensor& x, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& end, const torch::Tensor& gamma,
                             const torch::Tensor& beta, const std::vector<int64_t>& gamma_slot,
                             const std::vector<int64_t>& beta_slot, double eps, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && gamma.dim() == 2 && beta.dim() == 2,
              "seg_layer_norm: x [R, H], gamma and beta [C, H]");
  TORCH_CHECK(gamma_slot.size() == start.size() && beta_slot.size() == start.size(),
              "seg_layer_norm: slots");
  const int64_t R = x.size(0), H = x.size(1);
  const std::vector<Task> tasks = cut(start, end, R, chunk);
  auto out = at::empty({R, H}, x.options());
  for_tasks(tasks, [&](const Task& k) {
    out.narrow(0, k.a, k.b - k.a).copy_(at::layer_norm(
        x.narrow(0, k.a, k.b - k.a), {H}, gamma.select(0, gamma_slot[k.seg]),
        beta.select(0, beta_slot[k.seg]), eps));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("seg_linear", &seg_linear, "per-segment fused linear (+LayerNorm), one parallel region");
  m.def("seg_layer_norm", &seg_layer_norm, "per-segment LayerNorm, one parallel region");
}
