// Memory-bound ops of the fused multi-tenant engine: "model weights rotation" (thesis 4.2.2).
//
// Every kernel runs once over all rows of the token buffer, whatever their tenants. A row reads
// its tenant's parameters through a per-row slot index (int64) into the parameter kind's buffer
// [capacity, ...]: an O(1) lookup instead of Algorithm 3's scan over tenant offsets. Each rotated
// parameter has its own slot array, because the weight store deduplicates per kind (two tenants
// may share a LayerNorm gamma slot and still differ in their bias slots).
//
// The loader (itif/ops/cuda.py) prepends `#define T_STORE <type>` (float, __half or
// __nv_bfloat16); arithmetic is float32 whatever the storage type. Only the __global__ entry
// points are extern "C"; helpers are templates. No host headers: this file must build under
// NVRTC (CuPy RawModule) as well as nvcc.
//
// A slot outside [0, capacity) (or a token id outside its table) never reads out of bounds: that
// row's result is NaN, so the bug is loud instead of silent. Callers validate ids upstream.
//
// Launch configurations (chosen in itif/ops/cuda.py, switchable there for measurement):
//   rows mode  (thesis Eq. 4.3-4.4): one block per row, threads = min(width, 1024) rounded up to
//              a warp multiple, blocks = min(R x SM, rows), grid-stride over rows.
//   flat mode  (alternative for elementwise ops): one thread per 16-byte pack, grid-stride over
//              rows * packs.
//   warp mode  (alternative for LayerNorm and the softmax): one warp per row, several rows per
//              block, grid-stride over rows.
// Vectorised variants (vec != 0) move 16 bytes per access; the host enables them only when the
// row width is a multiple of the pack and every base pointer is 16-byte aligned.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef T_STORE
#define T_STORE float
#endif

typedef T_STORE store_t;
typedef long long i64;
typedef unsigned long long u64;

// Elements of store_t per 16-byte access.
constexpr int VEC = 16 / (int)sizeof(store_t);

// Keep in sync with _ACT_CODES in itif/ops/cuda.py.
#define ACT_NONE 0
#define ACT_GELU 1
#define ACT_GELU_TANH 2
#define ACT_RELU 3
#define ACT_SILU 4
#define ACT_TANH 5

// ---------------------------------------------------------------------------------------------
// conversions, packs

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ float neg_inf_f32() { return __int_as_float(0xff800000); }

// V consecutive elements; with V == VEC this is one 16-byte load or store.
template <int V> struct alignas(sizeof(store_t) * V) Pack {
  store_t v[V];
};

template <int V>
__device__ __forceinline__ void load_pack(const store_t* __restrict__ p, float (&out)[V]) {
  const Pack<V> pk = *reinterpret_cast<const Pack<V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_f32(pk.v[j]);
}

template <int V>
__device__ __forceinline__ void store_pack(store_t* __restrict__ p, const float (&in)[V]) {
  Pack<V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = from_f32<store_t>(in[j]);
  *reinterpret_cast<Pack<V>*>(p) = pk;
}

// True when slot s indexes a buffer of `cap` slots.
__device__ __forceinline__ bool slot_ok(i64 s, i64 cap) { return (u64)s < (u64)cap; }

// ---------------------------------------------------------------------------------------------
// reductions (callers guarantee blockDim.x is a multiple of 32, so full masks are valid)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `red` holds 33 floats of shared memory.
// The trailing barrier lets the caller reuse `red` at once.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31;
  const int wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[wid] = v;
  __syncthreads();
  if (wid == 0) {
    float t = lane < nwarps ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const float total = red[32];
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------------------------
// activations

template <int ACT> __device__ __forceinline__ float act_f32(float v) {
  if (ACT == ACT_GELU) return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  if (ACT == ACT_GELU_TANH) {
    const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (1.f + tanhf(u));
  }
  if (ACT == ACT_RELU) return v < 0.f ? 0.f : v;  // keeps NaN, like torch.relu
  if (ACT == ACT_SILU) return v / (1.f + expf(-v));
  if (ACT == ACT_TANH) return tanhf(v);
  return v;
}

// ---------------------------------------------------------------------------------------------
// row-wise driver for the elementwise ops: Op::row(r) loads the row's slots, Op::pack(r, p)
// handles pack p of row r. `np` is packs per row.

template <class Op>
__device__ __forceinline__ void run_rowwise(Op& op, i64 rows, int np, int flat) {
  if (flat) {
    const i64 total = rows * (i64)np;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
      const i64 r = i / np;
      op.row(r);
      op.pack(r, (int)(i - r * np));
    }
  } else {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
      op.row(r);
      for (int p = threadIdx.x; p < np; p += blockDim.x) op.pack(r, p);
    }
  }
}

// x[r] = act(x[r] + bias[slot[r]] (+ residual[r])), in place. x, residual: [rows, n].
template <int V, int ACT> struct BiasActOp {
  store_t* __restrict__ x;
  const store_t* __restrict__ bias;
  const i64* __restrict__ slot;
  i64 cap;
  const store_t* __restrict__ residual;  // may be null
  int n;
  const store_t* brow;
  bool bad;

  __device__ __forceinline__ void row(i64 r) {
    const i64 s = slot[r];
    bad = !slot_ok(s, cap);
    brow = bias + (bad ? 0 : s) * (i64)n;
  }
  __device__ __forceinline__ void pack(i64 r, int p) {
    const i64 off = r * (i64)n + (i64)p * V;
    float a[V], b[V];
    load_pack<V>(x + off, a);
    load_pack<V>(brow + p * V, b);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] += b[j];
    if (residual != nullptr) {
      float c[V];
      load_pack<V>(residual + off, c);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] += c[j];
    }
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = bad ? nan_f32() : act_f32<ACT>(a[j]);
    store_pack<V>(x + off, a);
  }
};

template <int V, int ACT>
__device__ __forceinline__ void bias_act_run(store_t* x, const store_t* bias, const i64* slot,
                                             i64 cap, const store_t* residual, i64 rows, int n,
                                             int flat) {
  BiasActOp<V, ACT> op;
  op.x = x;
  op.bias = bias;
  op.slot = slot;
  op.cap = cap;
  op.residual = residual;
  op.n = n;
  op.brow = bias;
  op.bad = false;
  run_rowwise(op, rows, n / V, flat);
}

template <int V>
__device__ __forceinline__ void bias_act_switch(int act, store_t* x, const store_t* bias,
                                                const i64* slot, i64 cap,
                                                const store_t* residual, i64 rows, int n,
                                                int flat) {
  switch (act) {
    case ACT_GELU: bias_act_run<V, ACT_GELU>(x, bias, slot, cap, residual, rows, n, flat); break;
    case ACT_GELU_TANH:
      bias_act_run<V, ACT_GELU_TANH>(x, bias, slot, cap, residual, rows, n, flat);
      break;
    case ACT_RELU: bias_act_run<V, ACT_RELU>(x, bias, slot, cap, residual, rows, n, flat); break;
    case ACT_SILU: bias_act_run<V, ACT_SILU>(x, bias, slot, cap, residual, rows, n, flat); break;
    case ACT_TANH: bias_act_run<V, ACT_TANH>(x, bias, slot, cap, residual, rows, n, flat); break;
    default: bias_act_run<V, ACT_NONE>(x, bias, slot, cap, residual, rows, n, flat); break;
  }
}

// bias_act and bias_residual (act = ACT_NONE with a residual). Grid/block per rows or flat mode.
extern "C" __global__ void __launch_bounds__(1024)
    bias_act(store_t* x, const store_t* bias, const i64* slot, i64 cap,
             const store_t* residual, i64 rows, int n, int act, int vec, int flat) {
  if (vec) bias_act_switch<VEC>(act, x, bias, slot, cap, residual, rows, n, flat);
  else bias_act_switch<1>(act, x, bias, slot, cap, residual, rows, n, flat);
}

// ---------------------------------------------------------------------------------------------
// embeddings: out[r] = word[ws[r], ids[r]] + pos[ps[r], positions[r]] + type[ts[r], types[r]]
// Tables are [capacity, table_rows, e]; out is [rows, e].

template <int V> struct EmbedOp {
  store_t* __restrict__ out;
  const store_t* __restrict__ word;
  const i64* __restrict__ wslot;
  const i64* __restrict__ ids;
  i64 wcap, wrows;
  const store_t* __restrict__ pos;
  const i64* __restrict__ pslot;
  const i64* __restrict__ positions;
  i64 pcap, prows;
  const store_t* __restrict__ typ;
  const i64* __restrict__ tslot;
  const i64* __restrict__ types;
  i64 tcap, trows;
  int e;
  const store_t* w_row;
  const store_t* p_row;
  const store_t* t_row;
  bool bad;

  __device__ __forceinline__ void row(i64 r) {
    const i64 ws = wslot[r], id = ids[r];
    const i64 ps = pslot[r], pi = positions[r];
    const i64 ts = tslot[r], ti = types[r];
    bad = !(slot_ok(ws, wcap) && slot_ok(id, wrows) && slot_ok(ps, pcap) && slot_ok(pi, prows) &&
            slot_ok(ts, tcap) && slot_ok(ti, trows));
    if (bad) {
      w_row = word;
      p_row = pos;
      t_row = typ;
    } else {
      w_row = word + (ws * wrows + id) * (i64)e;
      p_row = pos + (ps * prows + pi) * (i64)e;
      t_row = typ + (ts * trows + ti) * (i64)e;
    }
  }
  __device__ __forceinline__ void pack(i64 r, int p) {
    float a[V], b[V], c[V];
    load_pack<V>(w_row + p * V, a);
    load_pack<V>(p_row + p * V, b);
    load_pack<V>(t_row + p * V, c);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] = bad ? nan_f32() : (a[j] + b[j]) + c[j];
    store_pack<V>(out + r * (i64)e + (i64)p * V, a);
  }
};

template <int V>
__device__ __forceinline__ void embed_run(EmbedOp<V>& op, i64 rows, int flat) {
  run_rowwise(op, rows, op.e / V, flat);
}

extern "C" __global__ void __launch_bounds__(1024)
    embed_text(store_t* out, const store_t* word, const i64* wslot, const i64* ids, i64 wcap,
               i64 wrows, const store_t* pos, const i64* pslot, const i64* positions, i64 pcap,
               i64 prows, const store_t* typ, const i64* tslot, const i64* types, i64 tcap,
               i64 trows, i64 rows, int e, int vec, int flat) {
#define ITIF_EMBED_BODY(V)                                                                   \
  {                                                                                          \
    EmbedOp<V> op;                                                                           \
    op.out = out;                                                                            \
    op.word = word; op.wslot = wslot; op.ids = ids; op.wcap = wcap; op.wrows = wrows;        \
    op.pos = pos; op.pslot = pslot; op.positions = positions; op.pcap = pcap;                \
    op.prows = prows;                                                                        \
    op.typ = typ; op.tslot = tslot; op.types = types; op.tcap = tcap; op.trows = trows;      \
    op.e = e;                                                                                \
    op.w_row = word; op.p_row = pos; op.t_row = typ; op.bad = false;                         \
    embed_run<V>(op, rows, flat);                                                            \
  }
  if (vec) ITIF_EMBED_BODY(VEC)
  else ITIF_EMBED_BODY(1)
#undef ITIF_EMBED_BODY
}

// ---------------------------------------------------------------------------------------------
// bias + residual + LayerNorm:  s = x + bias[bs[r]] + residual;  y = LN(s) * gamma[gs[r]] +
// beta[es[r]]. Two passes over s in float32 (mean, then centred variance: exact, no Welford
// cancellation). With keep_sum, s (rounded to store_t) is written back into x.
//
// s is cached in shared memory as float (layout [V][np], conflict-free for consecutive packs)
// when the host gives the kernel a cache; without one it is recomputed from global memory
// (or re-read from x when keep_sum already wrote it there).

struct LnArgs {
  store_t* x;  // read; written when keep_sum
  const store_t* bias;  // may be null
  const i64* bslot;
  i64 bcap;
  const store_t* residual;  // may be null
  const store_t* gamma;
  const i64* gslot;
  i64 gcap;
  const store_t* beta;
  const i64* eslot;
  i64 ecap;
  store_t* y;
  i64 rows;
  int h;
  float eps;
  int keep_sum;
};

// Per-row state shared by the block and warp variants.
struct LnRow {
  const store_t* xr;
  const store_t* br;  // null when no bias
  const store_t* rr;  // null when no residual
  const store_t* gr;
  const store_t* er;
  store_t* yr;
  bool bad;
};

__device__ __forceinline__ LnRow ln_row(const LnArgs& a, i64 r) {
  LnRow w;
  const i64 gs = a.gslot[r], es = a.eslot[r];
  const i64 bs = a.bias != nullptr ? a.bslot[r] : 0;
  w.bad = !(slot_ok(gs, a.gcap) && slot_ok(es, a.ecap) && (a.bias == nullptr || slot_ok(bs, a.bcap)));
  const i64 h = a.h;
  w.xr = a.x + r * h;
  w.br = a.bias != nullptr ? a.bias + (w.bad ? 0 : bs) * h : nullptr;
  w.rr = a.residual != nullptr ? a.residual + r * h : nullptr;
  w.gr = a.gamma + (w.bad ? 0 : gs) * h;
  w.er = a.beta + (w.bad ? 0 : es) * h;
  w.yr = a.y + r * h;
  return w;
}

// s for pack p, from global memory.
template <int V>
__device__ __forceinline__ void ln_sum_pack(const LnRow& w, int p, float (&s)[V]) {
  load_pack<V>(w.xr + p * V, s);
  if (w.br != nullptr) {
    float b[V];
    load_pack<V>(w.br + p * V, b);
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] += b[j];
  }
  if (w.rr != nullptr) {
    float c[V];
    load_pack<V>(w.rr + p * V, c);
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] += c[j];
  }
  if (w.bad) {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = nan_f32();
  }
}

// s for pack p in passes 2 and 3: from the cache, else from x when keep_sum wrote it there
// in pass 1 (same thread, same pack: program order makes it visible), else recomputed.
template <int V>
__device__ __forceinline__ void ln_reload_pack(const LnArgs& a, const LnRow& w, const float* cache,
                                               int np, int p, float (&s)[V]) {
  if (cache != nullptr) {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = cache[j * np + p];
  } else if (a.keep_sum) {
    load_pack<V>(w.xr + p * V, s);
  } else {
    ln_sum_pack<V>(w, p, s);
  }
}

// Pass 1 of one pack: s, cache it, write it back with keep_sum; returns its partial sum.
template <int V>
__device__ __forceinline__ float ln_pass1(const LnArgs& a, const LnRow& w, float* cache, int np,
                                          int p) {
  float s[V];
  ln_sum_pack<V>(w, p, s);
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) t += s[j];
  if (cache != nullptr) {
#pragma unroll
    for (int j = 0; j < V; ++j) cache[j * np + p] = s[j];
  }
  if (a.keep_sum) store_pack<V>(const_cast<store_t*>(w.xr) + p * V, s);
  return t;
}

template <int V>
__device__ __forceinline__ float ln_pass2(const LnArgs& a, const LnRow& w, const float* cache,
                                          int np, int p, float mean) {
  float s[V];
  ln_reload_pack<V>(a, w, cache, np, p, s);
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float d = s[j] - mean;
    t += d * d;
  }
  return t;
}

template <int V>
__device__ __forceinline__ void ln_pass3(const LnArgs& a, const LnRow& w, const float* cache,
                                         int np, int p, float mean, float rstd) {
  float s[V], g[V], b[V];
  ln_reload_pack<V>(a, w, cache, np, p, s);
  load_pack<V>(w.gr + p * V, g);
  load_pack<V>(w.er + p * V, b);
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = (s[j] - mean) * rstd * g[j] + b[j];
  store_pack<V>(w.yr + p * V, s);
}

// One block per row (Eq. 4.3-4.4). Dynamic shared memory: h floats when cached, else 0.
template <int V>
__device__ __forceinline__ void ln_block(const LnArgs& a, float* cache, float* red) {
  const int np = a.h / V;
  const float inv_h = 1.f / (float)a.h;
  for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const LnRow w = ln_row(a, r);
    float t = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) t += ln_pass1<V>(a, w, cache, np, p);
    const float mean = block_sum(t, red) * inv_h;
    t = 0.f;
    for (int p = threadIdx.x; p < np; p += blockDim.x) t += ln_pass2<V>(a, w, cache, np, p, mean);
    const float rstd = rsqrtf(block_sum(t, red) * inv_h + a.eps);
    for (int p = threadIdx.x; p < np; p += blockDim.x) ln_pass3<V>(a, w, cache, np, p, mean, rstd);
    // block_sum's trailing barrier already separates this row's reductions from the next's;
    // cache slots are private to the thread that owns pack p, so no barrier is needed here.
  }
}

// One warp per row, blockDim.x / 32 rows per block. Dynamic shared memory: (blockDim.x / 32) * h
// floats when cached, else 0. No block barriers: warps retire independently.
template <int V>
__device__ __forceinline__ void ln_warp(const LnArgs& a, float* cache) {
  const int np = a.h / V;
  const float inv_h = 1.f / (float)a.h;
  const int lane = threadIdx.x & 31;
  const int wib = threadIdx.x >> 5;
  const int wpb = blockDim.x >> 5;
  float* wcache = cache != nullptr ? cache + (i64)wib * a.h : nullptr;
  for (i64 r = (i64)blockIdx.x * wpb + wib; r < a.rows; r += (i64)gridDim.x * wpb) {
    const LnRow w = ln_row(a, r);
    float t = 0.f;
    for (int p = lane; p < np; p += 32) t += ln_pass1<V>(a, w, wcache, np, p);
    const float mean = warp_sum(t) * inv_h;
    t = 0.f;
    for (int p = lane; p < np; p += 32) t += ln_pass2<V>(a, w, wcache, np, p, mean);
    const float rstd = rsqrtf(warp_sum(t) * inv_h + a.eps);
    for (int p = lane; p < np; p += 32) ln_pass3<V>(a, w, wcache, np, p, mean, rstd);
  }
}

extern "C" __global__ void __launch_bounds__(1024)
    bias_residual_layernorm(store_t* x, const store_t* bias, const i64* bslot, i64 bcap,
                            const store_t* residual, const store_t* gamma, const i64* gslot,
                            i64 gcap, const store_t* beta, const i64* eslot, i64 ecap, store_t* y,
                            i64 rows, int h, float eps, int keep_sum, int vec, int warp_per_row,
                            int cached) {
  extern __shared__ float itif_ln_cache[];
  __shared__ float red[33];
  LnArgs a;
  a.x = x;
  a.bias = bias;
  a.bslot = bslot;
  a.bcap = bcap;
  a.residual = residual;
  a.gamma = gamma;
  a.gslot = gslot;
  a.gcap = gcap;
  a.beta = beta;
  a.eslot = eslot;
  a.ecap = ecap;
  a.y = y;
  a.rows = rows;
  a.h = h;
  a.eps = eps;
  a.keep_sum = keep_sum;
  float* cache = cached ? itif_ln_cache : nullptr;
  if (warp_per_row) {
    if (vec) ln_warp<VEC>(a, cache);
    else ln_warp<1>(a, cache);
  } else {
    if (vec) ln_block<VEC>(a, cache, red);
    else ln_block<1>(a, cache, red);
  }
}

// ---------------------------------------------------------------------------------------------
// masked softmax for the CUDA attention fallback: scores [rows, L] with rows = n * rows_per_seq
// (rows_per_seq = heads * L), in place, p = softmax(scale * s) over the keys of its sequence b =
// r / rows_per_seq. A key j is live when j < lengths[b] (lengths may be null: all L) and
// key_mask[b, j] != 0 (key_mask [n, L] bytes, may be null). A row with no live key is all zeros.
// One warp per row, blockDim.x / 32 rows per block, grid-stride.

extern "C" __global__ void __launch_bounds__(1024)
    masked_softmax(store_t* scores, const i64* lengths, const unsigned char* key_mask, i64 rows,
                   int L, i64 rows_per_seq, float scale) {
  const int lane = threadIdx.x & 31;
  const int wib = threadIdx.x >> 5;
  const int wpb = blockDim.x >> 5;
  for (i64 r = (i64)blockIdx.x * wpb + wib; r < rows; r += (i64)gridDim.x * wpb) {
    const i64 b = r / rows_per_seq;
    i64 len = lengths != nullptr ? lengths[b] : (i64)L;
    len = len < 0 ? 0 : (len > L ? (i64)L : len);
    const unsigned char* mrow = key_mask != nullptr ? key_mask + b * (i64)L : nullptr;
    store_t* row = scores + r * (i64)L;

    float m = neg_inf_f32();
    for (int j = lane; j < len; j += 32) {
      if (mrow == nullptr || mrow[j] != 0) m = fmaxf(m, to_f32(row[j]) * scale);
    }
    m = warp_max(m);
    float sum = 0.f;
    for (int j = lane; j < len; j += 32) {
      if (mrow == nullptr || mrow[j] != 0) sum += expf(to_f32(row[j]) * scale - m);
    }
    sum = warp_sum(sum);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    // No live key: m is -inf and sum 0, so the live branch is never taken and the row is zeros.
    for (int j = lane; j < L; j += 32) {
      const bool live = j < len && (mrow == nullptr || mrow[j] != 0);
      const float pj = live ? expf(to_f32(row[j]) * scale - m) * inv : 0.f;
      row[j] = from_f32<store_t>(pj);
    }
  }
}
