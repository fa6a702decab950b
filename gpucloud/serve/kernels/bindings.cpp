// The Python module of the CPU serving kernels (gpucloud.serve.cpu_kernels builds it).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          torch::Tensor zeros, int64_t group_size);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("int4_linear", &int4_linear);
}
