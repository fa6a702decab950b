// The Python module of the CPU serving kernels (gpucloud.serve.cpu_kernels builds it).
// pybind11 and torch's tensor caster only: <torch/extension.h> costs four times the compile.
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor context_lens, double scale);
at::Tensor int4_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                       at::Tensor zeros, int64_t group_size);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("int4_linear", &int4_linear);
}
