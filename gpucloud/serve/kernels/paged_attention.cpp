// Paged decode attention for CPU: one query token per sequence against its cached keys,
// read straight from the block pool through the block table. The reference torch op gathers
// the blocks into a padded copy first; reading them in place moves a third of the bytes.
// ATen's own headers, not <torch/extension.h>: that one (pybind11 and the C++ frontend)
// costs 30 s of compiler time per source, these 4 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <vector>

// q: [seqs, heads, dim] fp32 contiguous; caches: [kv_heads, blocks, block_size, dim];
// block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "paged_decode: float32 q/cache and int64 tables expected");
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = lp[b];
      const float* qb = qp + (b * heads + h * group) * dim;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tp[b * max_blocks + t / bs];
        const float* k = kp + ((h * blocks + block) * bs + t % bs) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qb + g * dim;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < dim; ++d) acc += qg[d] * k[d];
          scores[g * len + t] = acc * s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float top = *std::max_element(row, row + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (row[t] = std::exp(row[t] - top));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      float* ob = op + (b * heads + h * group) * dim;
      std::fill(ob, ob + group * dim, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tp[b * max_blocks + t / bs];
        const float* v = vp + ((h * blocks + block) * bs + t % bs) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* o = ob + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}
