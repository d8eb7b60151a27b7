// fxrec's own CPU kernels for a group of pooled lookups (see fxrec/runtime/_native.py).
//
// Both kernels read the group's inputs as the user gave them (one ids tensor per feature, with
// its offsets), so nothing is packed first:
//   fxrec::pooled_forward  writes every feature's pooled rows straight into its columns of the
//                          group's [B, sum of dims] output (no per-table outputs, no cat);
//   fxrec::sgd_update      adds -lr * gradient into the looked-up rows (fused SGD), never making
//                          a gradient tensor (with lr = -1 on zeros: the dense gradient);
//   fxrec::adagrad_update  Adagrad or row-wise Adagrad on the looked-up rows, each row's
//                          gradient summed over the batch first.
// Work is split over ATen's intra-op threads: the forward by (feature, bag), the update by
// (table, block of rows) so that no two threads write the same row.
//
// Semantics are those of PyTorch's nn.EmbeddingBag / nn.Embedding (+ sum or mean over dim 1):
//   form 0 "bag":        1-D ids with offsets (include_last_offset honoured), or 2-D [B, L] ids;
//                        the padding row is left out of the bag and of the mean's count.
//   form 1 "pooled_seq": 2-D [B, L] ids, every id counted (the padding row is looked up).
//   form 2 "single":     1-D [B] ids, one row per sample.
// Rows are summed in id order from zero, then a mean divides by the bag's count (bags: the ids
// that are not padding) or by L (pooled_seq), as PyTorch does. An empty bag gives zeros. Bad ids or offsets raise
// (the Python caller then names the feature); they are never read out of bounds.
//
// A table (and an element-wise Adagrad state) need not be contiguous, only its rows: stride(1)
// == 1 and stride(0) >= its dim, e.g. padded[:, :dim] of a table stored padded to a wider
// [rows, pad_dim] (fbgemm's TBE); row r starts at r * stride(0), the padding columns are never
// read or written.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Form : int64_t { kBag = 0, kPooledSeq = 1, kSingle = 2 };

struct Feature {
  const int64_t* ids = nullptr;
  const int64_t* offsets = nullptr;  // bag form with 1-D ids only
  const float* psw = nullptr;
  const float* weight = nullptr;
  float* weight_mut = nullptr;
  int64_t n_ids = 0;
  int64_t n_offsets = 0;
  int64_t fixed_len = 0;  // 2-D ids: L
  int64_t rows = 0;
  int64_t dim = 0;
  int64_t stride = 0;  // of the weight's rows (>= dim: a view of a wider, padded table)
  int64_t col = 0;
  int64_t padding = -1;  // meaningful only with has_padding
  bool has_padding = false;
  int64_t table = 0;
  int64_t form = kBag;
  bool include_last = false;
};

// Error codes recorded inside the parallel loops (exceptions cannot leave them safely).
enum Err : int { kOk = 0, kIdRange = 1, kOffsets = 2 };

struct ErrorFlag {
  std::atomic<int> code{kOk};
  std::atomic<int64_t> feature{-1};
  void set(int c, int64_t f) {
    int expected = kOk;
    if (code.compare_exchange_strong(expected, c)) feature.store(f);
  }
};

// [start, end) of bag b of feature f; false when the offsets do not describe a valid bag.
inline bool bag_range(const Feature& f, int64_t b, int64_t& start, int64_t& end) {
  if (f.offsets == nullptr) {
    const int64_t len = f.form == kSingle ? 1 : f.fixed_len;
    start = b * len;
    end = start + len;
    return true;
  }
  start = f.offsets[b];
  end = (b + 1 < f.n_offsets) ? f.offsets[b + 1] : f.n_ids;
  return start >= 0 && start <= end && end <= f.n_ids;
}

// The distance between rows of a 2-D tensor whose rows are each contiguous and do not overlap
// (stride(1) == 1, stride(0) >= size(1)), e.g. padded[:, :dim] of a contiguous [rows, pad_dim]
// table; -1 for any other layout. A dim of size 1 may carry any stride (as in is_contiguous).
int64_t row_stride(const at::Tensor& t) {
  if (t.dim() != 2) return -1;
  if (t.is_contiguous()) return t.size(1);
  if (t.stride(1) != 1 && t.size(1) > 1) return -1;
  if (t.size(0) <= 1) return t.size(1);
  return t.stride(0) >= t.size(1) ? t.stride(0) : -1;
}

// Bags of a feature with offsets, or single ids.
int64_t batch_of(const Feature& f) {
  if (f.offsets == nullptr) return f.n_ids;
  return f.include_last ? f.n_offsets - 1 : f.n_offsets;
}

std::vector<Feature> describe(
    at::TensorList weights, at::IntArrayRef table_of_feature, at::TensorList ids,
    const c10::List<std::optional<at::Tensor>>& offsets,
    const c10::List<std::optional<at::Tensor>>& psw, at::IntArrayRef include_last,
    at::IntArrayRef padding_idx, at::IntArrayRef form, int64_t& batch, int64_t& total_dim) {
  const int64_t nf = static_cast<int64_t>(ids.size());
  TORCH_CHECK(
      static_cast<int64_t>(table_of_feature.size()) == nf && static_cast<int64_t>(offsets.size()) == nf &&
          static_cast<int64_t>(psw.size()) == nf && static_cast<int64_t>(include_last.size()) == nf &&
          static_cast<int64_t>(padding_idx.size()) == nf && static_cast<int64_t>(form.size()) == nf,
      "fxrec kernel: one entry per feature expected in every list");
  std::vector<Feature> fs(nf);
  batch = -1;
  total_dim = 0;
  for (int64_t i = 0; i < nf; ++i) {
    Feature& f = fs[i];
    const int64_t t = table_of_feature[i];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(weights.size()), "fxrec kernel: bad table index");
    const at::Tensor& w = weights[t];
    const int64_t w_stride = row_stride(w);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w_stride >= 0,
                "fxrec kernel: weights must be row-contiguous 2-D float32 CPU tensors (stride(1) == 1, "
                "stride(0) >= size(1))");
    const at::Tensor& x = ids[i];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kLong && x.is_contiguous(),
                "fxrec kernel: ids must be contiguous int64 CPU tensors");
    f.table = t;
    f.weight = w.data_ptr<float>();
    f.weight_mut = w.data_ptr<float>();
    f.rows = w.size(0);
    f.dim = w.size(1);
    f.stride = w_stride;
    f.col = total_dim;
    total_dim += f.dim;
    f.ids = x.data_ptr<int64_t>();
    f.n_ids = x.numel();
    f.form = form[i];
    f.padding = padding_idx[i];
    f.has_padding = padding_idx[i] >= 0;  // -1: no padding row (ids are never negative)
    f.include_last = include_last[i] != 0;
    const std::optional<at::Tensor> off = offsets.get(i);
    if (f.form == kBag && off.has_value() && off->defined()) {
      TORCH_CHECK(x.dim() == 1, "fxrec kernel: ids with offsets must be 1-D");
      TORCH_CHECK(off->scalar_type() == at::kLong && off->is_contiguous() && off->dim() == 1,
                  "fxrec kernel: offsets must be contiguous 1-D int64");
      f.offsets = off->data_ptr<int64_t>();
      f.n_offsets = off->numel();
    } else if (f.form == kSingle) {
      TORCH_CHECK(x.dim() == 1, "fxrec kernel: single ids must be 1-D");
    } else {
      TORCH_CHECK(x.dim() == 2, "fxrec kernel: ids without offsets must be 2-D [B, L]");
      f.fixed_len = x.size(1);
    }
    const std::optional<at::Tensor> p = psw.get(i);
    if (p.has_value() && p->defined()) {
      TORCH_CHECK(p->scalar_type() == at::kFloat && p->is_contiguous() && p->numel() == f.n_ids,
                  "fxrec kernel: per-sample weights of feature ", i, " must be contiguous float32, one per id");
      f.psw = p->data_ptr<float>();
    }
    int64_t b = (f.offsets == nullptr && f.form != kSingle) ? x.size(0) : batch_of(f);
    if (f.offsets != nullptr && f.n_offsets > 0) {
      TORCH_CHECK(f.offsets[0] == 0, "fxrec kernel: offsets of feature ", i, " must start at 0");
      if (f.include_last) {
        TORCH_CHECK(f.offsets[f.n_offsets - 1] <= f.n_ids, "fxrec kernel: offsets of feature ", i,
                    " run past its ", f.n_ids, " ids");
      }
    }
    TORCH_CHECK(b >= 0, "fxrec kernel: feature ", i, " has no bags (include_last_offset needs offsets)");
    TORCH_CHECK(batch < 0 || b == batch, "fxrec kernel: feature ", i, " has batch size ", b, ", not ", batch);
    batch = b;
  }
  if (batch < 0) batch = 0;
  return fs;
}

void raise_if(const ErrorFlag& err) {
  const int c = err.code.load();
  if (c == kIdRange) {
    TORCH_CHECK_INDEX(false, "fxrec kernel: id out of range in feature ", err.feature.load());
  }
  if (c == kOffsets) {
    TORCH_CHECK(false, "fxrec kernel: offsets of feature ", err.feature.load(), " are not a valid bag list");
  }
}

// Rows ahead of the one being added whose cache lines are requested early (the ids are read in
// order, the rows they name are scattered over the table).
constexpr int64_t kPrefetch = 16;

// (lo, hi): only rows in this block (the update's threads each own a block of rows). D: the
// floats of the row to fetch, from its start at id * f.stride.
__attribute__((always_inline)) inline void prefetch_row(const Feature& f, int64_t j, int64_t D, int64_t lo = 0,
                                                        int64_t hi = -1) {
  if (j < f.n_ids) {
    const int64_t id = f.ids[j];
    if (id >= lo && id < (hi < 0 ? f.rows : hi)) {
      const char* p = reinterpret_cast<const char*>(f.weight + id * f.stride);
      for (int64_t k = 0; k < D * 4; k += 64) __builtin_prefetch(p + k, 0, 3);
    }
  }
}

// 8 floats in one register (GCC vector extension; unaligned loads and stores via memcpy).
typedef float f8 __attribute__((vector_size(32)));

__attribute__((always_inline)) inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((always_inline)) inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

// The pooled rows of bags [b0, b1) of one feature, into out. DC > 0 (a multiple of 8) is the
// dim known at compile time: the bag is summed in registers. DC == 0: any dim, summed in a
// local buffer. Either way each output row is stored once. Row id of the table starts at
// W + id * f.stride (the dim only sets how many floats are read from there).
template <int64_t DC>
void forward_bags(const Feature& f, int64_t fi, int64_t b0, int64_t b1, float* __restrict__ out_ptr,
                  int64_t out_stride, bool mean, ErrorFlag& err) {
  const int64_t D = DC > 0 ? DC : f.dim;
  constexpr int64_t V = DC > 0 ? DC / 8 : 1;
  std::vector<float> acc_heap(DC > 0 ? 0 : D);
  float* __restrict__ acc = acc_heap.data();
  const float* __restrict__ W = f.weight;
  for (int64_t b = b0; b < b1; ++b) {
    f8 vacc[V];
    if constexpr (DC > 0) {
      for (int64_t k = 0; k < V; ++k) vacc[k] = f8{};
    } else {
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    }
    int64_t s = 0, e = 0;
    float* __restrict__ o = out_ptr + b * out_stride + f.col;
    if (!bag_range(f, b, s, e)) {
      err.set(kOffsets, fi);
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      continue;
    }
    int64_t count = 0;
    for (int64_t j = s; j < e; ++j) {
      prefetch_row(f, j + kPrefetch, D);
      const int64_t id = f.ids[j];
      if (f.form == kBag && f.has_padding && id == f.padding) continue;
      if (id < 0 || id >= f.rows) {
        err.set(kIdRange, fi);
        break;
      }
      const float* __restrict__ r = W + id * f.stride;
      if constexpr (DC > 0) {
        if (f.psw != nullptr) {
          const float w = f.psw[j];
          for (int64_t k = 0; k < V; ++k) vacc[k] += w * load8(r + 8 * k);
        } else {
          for (int64_t k = 0; k < V; ++k) vacc[k] += load8(r + 8 * k);
        }
      } else if (f.psw != nullptr) {
        const float w = f.psw[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * r[d];
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] += r[d];
      }
      ++count;
    }
    if constexpr (DC > 0) {
      if (mean && f.form == kBag && count > 0) {
        const float n = static_cast<float>(count);
        for (int64_t k = 0; k < V; ++k) vacc[k] /= n;
      } else if (mean && f.form == kPooledSeq) {
        const float len = static_cast<float>(e - s);
        for (int64_t k = 0; k < V; ++k) vacc[k] /= len;
      }
      for (int64_t k = 0; k < V; ++k) store8(o + 8 * k, vacc[k]);
    } else if (mean && f.form == kBag && count > 0) {
      const float n = static_cast<float>(count);
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / n;
    } else if (mean && f.form == kPooledSeq) {
      const float len = static_cast<float>(e - s);
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / len;
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
    }
  }
}

void pooled_forward(
    at::Tensor out, at::TensorList weights, at::IntArrayRef table_of_feature, at::TensorList ids,
    const c10::List<std::optional<at::Tensor>>& offsets, const c10::List<std::optional<at::Tensor>>& psw,
    at::IntArrayRef include_last, at::IntArrayRef padding_idx, at::IntArrayRef form, int64_t mean) {
  int64_t batch = 0, total_dim = 0;
  std::vector<Feature> fs =
      describe(weights, table_of_feature, ids, offsets, psw, include_last, padding_idx, form, batch, total_dim);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.size(0) == batch && out.size(1) == total_dim && out.stride(1) == 1,
              "fxrec kernel: out must be a float32 [B, sum of dims] tensor with contiguous rows");
  if (batch == 0) return;
  float* out_ptr = out.data_ptr<float>();
  const int64_t out_stride = out.stride(0);
  const int64_t nf = static_cast<int64_t>(fs.size());
  ErrorFlag err;
  // Each thread takes a block of bags and runs it through every feature in order, so all threads
  // read the same table at about the same time (it stays in the shared cache).
  at::parallel_for(0, batch, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t fi = 0; fi < nf; ++fi) {
      const Feature& f = fs[fi];
      switch (f.dim) {
        case 16: forward_bags<16>(f, fi, b0, b1, out_ptr, out_stride, mean, err); break;
        case 32: forward_bags<32>(f, fi, b0, b1, out_ptr, out_stride, mean, err); break;
        case 64: forward_bags<64>(f, fi, b0, b1, out_ptr, out_stride, mean, err); break;
        case 128: forward_bags<128>(f, fi, b0, b1, out_ptr, out_stride, mean, err); break;
        default: forward_bags<0>(f, fi, b0, b1, out_ptr, out_stride, mean, err); break;
      }
    }
  });
  raise_if(err);
}

// r += sc * g over one row of D floats (8 at a time where D allows).
__attribute__((always_inline)) inline void add_scaled_row(float* __restrict__ r, const float* __restrict__ g,
                                                          float sc, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) store8(r + d, load8(r + d) + sc * load8(g + d));
  for (; d < D; ++d) r[d] += sc * g[d];
}

// Calls fn(id, j, g_row, scale) for every id of feature f whose row is in [lo, hi), bag by bag
// in order, the padding row skipped (PyTorch gives it no gradient). scale = base * per-sample
// weight * 1/count for a mean (count: the bag's ids that are not padding; L for pooled_seq).
template <typename Fn>
void visit_rows(const Feature& f, int64_t fi, int64_t batch, const float* g_ptr, int64_t g_stride, bool mean,
                float base, int64_t lo, int64_t hi, ErrorFlag& err, Fn&& fn) {
  for (int64_t b = 0; b < batch; ++b) {
    int64_t s = 0, e = 0;
    if (!bag_range(f, b, s, e)) {
      err.set(kOffsets, fi);
      return;
    }
    float bag_scale = base;
    if (mean) {
      if (f.form == kBag) {
        int64_t count = 0;
        for (int64_t j = s; j < e; ++j) count += !(f.has_padding && f.ids[j] == f.padding);
        if (count == 0) continue;
        bag_scale = base * (1.f / static_cast<float>(count));
      } else if (f.form == kPooledSeq) {
        bag_scale = base / static_cast<float>(e - s);
      }
    }
    const float* g = g_ptr + b * g_stride + f.col;
    for (int64_t j = s; j < e; ++j) {
      prefetch_row(f, j + kPrefetch, f.dim, lo, hi);
      const int64_t id = f.ids[j];
      if (f.has_padding && id == f.padding) continue;
      if (id < 0 || id >= f.rows) {
        err.set(kIdRange, fi);
        continue;
      }
      if (id < lo || id >= hi) continue;
      fn(id, j, g, f.psw != nullptr ? bag_scale * f.psw[j] : bag_scale);
    }
  }
}

struct UpdateSetup {
  std::vector<Feature> fs;
  std::vector<std::vector<int64_t>> feats_of_table;
  int64_t batch = 0;
  int64_t parts = 1;
  const float* g_ptr = nullptr;
  int64_t g_stride = 0;
};

UpdateSetup setup_update(at::TensorList weights, const at::Tensor& grad_out, at::IntArrayRef update_table,
                         at::IntArrayRef table_of_feature, at::TensorList ids,
                         const c10::List<std::optional<at::Tensor>>& offsets,
                         const c10::List<std::optional<at::Tensor>>& psw, at::IntArrayRef include_last,
                         at::IntArrayRef padding_idx, at::IntArrayRef form) {
  UpdateSetup u;
  TORCH_CHECK(update_table.size() == weights.size(), "fxrec kernel: one update flag per table");
  int64_t total_dim = 0;
  u.fs = describe(weights, table_of_feature, ids, offsets, psw, include_last, padding_idx, form, u.batch, total_dim);
  TORCH_CHECK(grad_out.device().is_cpu() && grad_out.scalar_type() == at::kFloat && grad_out.dim() == 2 &&
                  grad_out.size(0) == u.batch && grad_out.size(1) == total_dim && grad_out.stride(1) == 1,
              "fxrec kernel: grad_out must be float32 [B, sum of dims] with contiguous rows");
  u.g_ptr = grad_out.data_ptr<float>();
  u.g_stride = grad_out.stride(0);
  const int64_t nt = static_cast<int64_t>(weights.size());
  u.feats_of_table.resize(nt);
  // a table whose flag is 0 (frozen: requires_grad=False) is never written
  for (int64_t i = 0; i < static_cast<int64_t>(u.fs.size()); ++i) {
    if (update_table[u.fs[i].table]) u.feats_of_table[u.fs[i].table].push_back(i);
  }
  // Each table's rows are cut into `parts` blocks; a work item owns one block of one table, so
  // a row is only ever written by one thread, in the ids' order.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  u.parts = nt >= 2 * threads ? 1 : threads;
  return u;
}

// W[id] += (-lr * psw * 1/count) * grad_out[b, cols of the feature], for every looked-up id
// except the padding row (which gets no gradient in PyTorch). With lr = -1 on zero tensors:
// the dense gradient.
void sgd_update(
    at::TensorList weights, at::Tensor grad_out, double lr, at::IntArrayRef update_table,
    at::IntArrayRef table_of_feature, at::TensorList ids, const c10::List<std::optional<at::Tensor>>& offsets,
    const c10::List<std::optional<at::Tensor>>& psw, at::IntArrayRef include_last,
    at::IntArrayRef padding_idx, at::IntArrayRef form, int64_t mean) {
  UpdateSetup u = setup_update(weights, grad_out, update_table, table_of_feature, ids, offsets, psw, include_last,
                               padding_idx, form);
  const int64_t nt = static_cast<int64_t>(weights.size());
  const float neg_lr = static_cast<float>(-lr);
  ErrorFlag err;
  at::parallel_for(0, nt * u.parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / u.parts, p = item - t * u.parts;
      const int64_t rows = weights[t].size(0);
      const int64_t lo = rows * p / u.parts, hi = rows * (p + 1) / u.parts;
      for (const int64_t fi : u.feats_of_table[t]) {
        const Feature& f = u.fs[fi];
        float* W = f.weight_mut;
        const int64_t D = f.dim, ws = f.stride;
        visit_rows(f, fi, u.batch, u.g_ptr, u.g_stride, mean, neg_lr, lo, hi, err,
                   [&](int64_t id, int64_t, const float* g, float sc) { add_scaled_row(W + id * ws, g, sc, D); });
      }
    }
  });
  raise_if(err);
}

// Row -> slot map for one table's rows in a batch: open addressing over a power-of-two array of
// at least twice the lookups, so its size (and the time to clear it) follows the batch, not
// the table.
struct RowSlots {
  std::vector<int64_t> keys, vals;
  uint64_t mask = 0;
  void reset(int64_t lookups) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(2 * lookups)) cap <<= 1;
    keys.assign(cap, -1);
    vals.assign(cap, -1);
    mask = cap - 1;
  }
  // the slot of `row` (-1 when new: the caller stores its place there)
  int64_t& find(int64_t row) {
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 20;
    while (true) {
      h &= mask;
      if (keys[h] == row) return vals[h];
      if (keys[h] < 0) {
        keys[h] = row;
        return vals[h];
      }
      ++h;
    }
  }
};

// A row whose L2 norm exceeds max_norm scaled by max_norm / norm (fbgemm's max_norm).
inline void cap_norm(float* w, int64_t D, float max_norm) {
  float sq = 0.f;
  for (int64_t d = 0; d < D; ++d) sq += w[d] * w[d];
  const float norm = std::sqrt(sq);
  if (norm > max_norm) {
    const float m = max_norm / norm;
    for (int64_t d = 0; d < D; ++d) w[d] *= m;
  }
}

// torch.optim.Adagrad on the step's gradient (rowwise = 0), or fbgemm's row-wise Adagrad
// (rowwise = 1), applied to the looked-up rows only. The gradient of a row is first summed over
// all its lookups in the batch (every feature of the table, in order), as a sparse gradient's
// coalesce does, then:
//   exact:    state[r] += g*g;             W[r] -= lr * (g / (sqrt(state[r]) + eps))
//   row-wise: state[r] += mean(g*g);       W[r] -= (lr / (sqrt(state[r]) + eps)) * g
// Row-wise with weight decay (decay_mode as fbgemm's WeightDecayMode: 1 L2, 2 decoupled), as
// fbgemm writes it: L2 adds wd * W[r] to g in the sum of squares and c = mult * wd; decoupled
// c = lr * wd; then W[r] = (1 - c) * W[r] - mult * g. Row-wise with max_norm > 0, as fbgemm's
// max_norm: then a row whose L2 norm exceeds max_norm is scaled by max_norm / norm.
void adagrad_update(
    at::TensorList weights, at::TensorList states, at::Tensor grad_out, double lr, double eps, int64_t rowwise,
    double weight_decay, int64_t decay_mode, double max_norm,
    at::IntArrayRef update_table, at::IntArrayRef table_of_feature, at::TensorList ids,
    const c10::List<std::optional<at::Tensor>>& offsets, const c10::List<std::optional<at::Tensor>>& psw,
    at::IntArrayRef include_last, at::IntArrayRef padding_idx, at::IntArrayRef form, int64_t mean) {
  UpdateSetup u = setup_update(weights, grad_out, update_table, table_of_feature, ids, offsets, psw, include_last,
                               padding_idx, form);
  const int64_t nt = static_cast<int64_t>(weights.size());
  TORCH_CHECK(static_cast<int64_t>(states.size()) == nt, "fxrec kernel: one optimizer state per table");
  // per table, the distance between rows of its weight and of its element-wise state (either a
  // [rows, D] tensor of its own row stride, e.g. padded_state[:, :D], or contiguous rows * D)
  std::vector<int64_t> w_stride(nt, 0), s_stride(nt, 0);
  for (int64_t t = 0; t < nt; ++t) {
    if (!update_table[t]) continue;
    const at::Tensor& w = weights[t];
    w_stride[t] = row_stride(w);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w_stride[t] >= 0,
                "fxrec kernel: weights must be row-contiguous 2-D float32 CPU tensors (stride(1) == 1, "
                "stride(0) >= size(1))");
    const at::Tensor& st = states[t];
    const int64_t rows = w.size(0), D = w.size(1);
    const bool cpu_float = st.device().is_cpu() && st.scalar_type() == at::kFloat;
    if (rowwise) {
      TORCH_CHECK(cpu_float && st.is_contiguous() && st.numel() == rows, "fxrec kernel: the Adagrad state of table ",
                  t, " must be contiguous float32 with ", rows, " elements");
    } else if (cpu_float && st.dim() == 2 && st.size(0) == rows && st.size(1) == D && row_stride(st) >= 0) {
      s_stride[t] = row_stride(st);
    } else {
      TORCH_CHECK(cpu_float && st.is_contiguous() && st.numel() == rows * D, "fxrec kernel: the Adagrad state of table ",
                  t, " must be float32 [", rows, ", ", D, "] with contiguous rows (stride(1) == 1, stride(0) >= ", D,
                  "), or contiguous float32 with ", rows * D, " elements");
      s_stride[t] = D;
    }
  }
  TORCH_CHECK(decay_mode >= 0 && decay_mode <= 2 && (decay_mode == 0 || rowwise),
              "fxrec kernel: weight decay mode ", decay_mode, " (row-wise Adagrad takes 0, 1 or 2)");
  TORCH_CHECK(max_norm >= 0 && (max_norm == 0 || rowwise), "fxrec kernel: max_norm ", max_norm,
              " (row-wise Adagrad takes one >= 0)");
  const float flr = static_cast<float>(lr), feps = static_cast<float>(eps), fwd = static_cast<float>(weight_decay);
  const float fmax = static_cast<float>(max_norm);
  ErrorFlag err;
  at::parallel_for(0, nt * u.parts, 1, [&](int64_t begin, int64_t end) {
    RowSlots slots;             // row -> its place in `uniq` (open addressing, sized by the batch)
    std::vector<int64_t> uniq;  // rows of this block looked up in the batch, first seen first
    std::vector<float> grads;   // their summed gradients, D floats each
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / u.parts, p = item - t * u.parts;
      if (u.feats_of_table[t].empty()) continue;
      const int64_t rows = weights[t].size(0), D = weights[t].size(1);
      const int64_t lo = rows * p / u.parts, hi = rows * (p + 1) / u.parts;
      int64_t lookups = 0;
      for (const int64_t fi : u.feats_of_table[t]) lookups += u.fs[fi].n_ids;
      slots.reset(lookups);
      uniq.clear();
      grads.clear();
      // a row's lookups are summed in the batch's order (features, then bags, then ids)
      for (const int64_t fi : u.feats_of_table[t]) {
        visit_rows(u.fs[fi], fi, u.batch, u.g_ptr, u.g_stride, mean, 1.f, lo, hi, err,
                   [&](int64_t id, int64_t, const float* g, float sc) {
                     int64_t& k = slots.find(id);
                     if (k < 0) {
                       k = static_cast<int64_t>(uniq.size());
                       uniq.push_back(id);
                       grads.resize(grads.size() + D, 0.f);
                     }
                     add_scaled_row(grads.data() + k * D, g, sc, D);
                   });
      }
      float* W = weights[t].data_ptr<float>();
      float* S = states[t].data_ptr<float>();
      const int64_t ws = w_stride[t], ss = s_stride[t];
      for (size_t k = 0; k < uniq.size(); ++k) {
        const int64_t id = uniq[k];
        const float* acc = grads.data() + k * D;
        float* w = W + id * ws;
        if (rowwise && decay_mode != 0) {
          float sq = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float g = decay_mode == 1 ? acc[d] + fwd * w[d] : acc[d];
            sq += g * g;
          }
          S[id] += sq / static_cast<float>(D);
          const float mult = flr / (std::sqrt(S[id]) + feps);
          const float keep = 1.f - (decay_mode == 1 ? mult * fwd : flr * fwd);
          for (int64_t d = 0; d < D; ++d) w[d] = keep * w[d] - mult * acc[d];
          if (fmax > 0.f) cap_norm(w, D, fmax);
        } else if (rowwise) {
          f8 sq8 = f8{};
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) {
            const f8 a = load8(acc + d);
            sq8 += a * a;
          }
          float sq = 0.f;
          for (int j = 0; j < 8; ++j) sq += sq8[j];
          for (; d < D; ++d) sq += acc[d] * acc[d];
          S[id] += sq / static_cast<float>(D);
          const float mult = flr / (std::sqrt(S[id]) + feps);
          for (d = 0; d < D; ++d) w[d] -= mult * acc[d];
          if (fmax > 0.f) cap_norm(w, D, fmax);
        } else {
          float* s = S + id * ss;
          for (int64_t d = 0; d < D; ++d) {
            s[d] += acc[d] * acc[d];
            w[d] += -flr * (acc[d] / (std::sqrt(s[d]) + feps));
          }
        }
      }
    }
  });
  raise_if(err);
}

}  // namespace

TORCH_LIBRARY(fxrec, m) {
  m.def(
      "pooled_forward(Tensor(a!) out, Tensor[] weights, int[] table_of_feature, Tensor[] ids, "
      "Tensor?[] offsets, Tensor?[] per_sample_weights, int[] include_last_offset, int[] padding_idx, "
      "int[] form, int mean) -> ()");
  m.def(
      "sgd_update(Tensor(a!)[] weights, Tensor grad_out, float lr, int[] update_table, int[] table_of_feature, "
      "Tensor[] ids, "
      "Tensor?[] offsets, Tensor?[] per_sample_weights, int[] include_last_offset, int[] padding_idx, "
      "int[] form, int mean) -> ()");
  m.def(
      "adagrad_update(Tensor(a!)[] weights, Tensor(b!)[] states, Tensor grad_out, float lr, float eps, int rowwise, "
      "float weight_decay, int decay_mode, float max_norm, int[] update_table, int[] table_of_feature, Tensor[] ids, Tensor?[] offsets, Tensor?[] per_sample_weights, "
      "int[] include_last_offset, int[] padding_idx, int[] form, int mean) -> ()");
}

TORCH_LIBRARY_IMPL(fxrec, CPU, m) {
  m.impl("pooled_forward", pooled_forward);
  m.impl("sgd_update", sgd_update);
  m.impl("adagrad_update", adagrad_update);
}
