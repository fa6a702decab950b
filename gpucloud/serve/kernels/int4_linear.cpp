// Weight-only int4 matmul for CPU that reads the packed weight: y = x ((q - z) s)^T.
// The reference op dequantizes the whole [out, in] weight for every call, writing and then
// reading 4 bytes per weight; here each output channel's row is dequantized into a small
// buffer that stays in L1 and is used at once by every input row (four at a time, sharing
// its loads), so a decode step reads half a byte per weight from memory.
// ATen's own headers, not <torch/extension.h>: that one (pybind11 and the C++ frontend)
// costs 30 s of compiler time per source, these 4 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// x: [rows, in] fp32; qweight: [out, in / 2] uint8 (even input channel in the low nibble);
// scales: [out, groups] fp32; zeros: [out, ceil(groups / 2)] uint8 packed the same way;
// groups of `group_size` input channels, the last one possibly shorter.
at::Tensor int4_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                       at::Tensor zeros, int64_t group_size) {
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous() &&
                  zeros.is_contiguous(),
              "int4_linear: inputs must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat &&
                  qweight.scalar_type() == at::kByte && zeros.scalar_type() == at::kByte,
              "int4_linear: fp32 x and scales, uint8 qweight and zeros expected");
  const int64_t rows = x.size(0), in = x.size(1), out = qweight.size(0);
  const int64_t groups = scales.size(1), zcols = zeros.size(1), half = qweight.size(1);
  TORCH_CHECK(2 * half == in, "int4_linear: x has ", in, " channels, the weight ", 2 * half);
  auto y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();

  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(in);
    float* w = buffer.data();
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qp + n * half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        w[2 * j] = static_cast<float>(row[j] & 0xF);
        w[2 * j + 1] = static_cast<float>(row[j] >> 4);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t lo = g * group_size, hi = std::min(in, lo + group_size);
        const uint8_t zbyte = zp[n * zcols + g / 2];
        const float z = static_cast<float>(g % 2 ? zbyte >> 4 : zbyte & 0xF);
        const float s = sp[n * groups + g];
#pragma omp simd
        for (int64_t k = lo; k < hi; ++k) w[k] = (w[k] - z) * s;
      }
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4) {
        const float *x0 = xp + m * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < in; ++k) {
          a0 += w[k] * x0[k];
          a1 += w[k] * x1[k];
          a2 += w[k] * x2[k];
          a3 += w[k] * x3[k];
        }
        yp[m * out + n] = a0;
        yp[(m + 1) * out + n] = a1;
        yp[(m + 2) * out + n] = a2;
        yp[(m + 3) * out + n] = a3;
      }
      for (; m < rows; ++m) {
        const float* xm = xp + m * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < in; ++k) acc += w[k] * xm[k];
        yp[m * out + n] = acc;
      }
    }
  });
  return y;
}
