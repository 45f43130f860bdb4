// A quantized linear layer as one object: the packed weight, its scales and the kernel, applied to
// inputs of any leading shape. fairseq_stream/ops/quantized_linear.py makes these (the scale rules)
// and documents them; the arithmetic is int8_linear_cpu.cpp's and int16_linear_cpu.cpp's.

#include "quantized_linear_cpu.h"

#include <vector>

#include "int16_linear_cpu.h"
#include "int8_linear_cpu.h"

using torch::Tensor;

Tensor QuantizedLinear::operator()(const Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == in_features,
              "quantized linear: float32 CPU input of ", in_features, " features");
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  const Tensor rows = x.reshape({-1, in_features});
  const bool onednn = bits == 8 && weight_kn &&
                      (kernel == "onednn" || (kernel == "auto" && rows.size(0) >= onednn_from_rows));
  const Tensor y = onednn      ? int8_linear_onednn(rows, *weight_kn, weight_inv, bias)
                   : bits == 8 ? int8_linear(rows, packed, weight_inv, excess, bias, kernel, weight_max)
                               : int16_linear(rows, packed, weight_inv, a_max, bias, kernel);
  return y.view(shape);
}

void register_quantized_linear(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<QuantizedLinear>(m, "QuantizedLinear",
                              "x W^T + b on a weight quantized to int8 or int16 (see ops/quantized_linear.py)")
      .def(py::init([](int64_t bits, Tensor packed, Tensor weight_inv, std::optional<Tensor> excess, int64_t a_max,
                       std::optional<Tensor> bias, int64_t in_features, int64_t out_features, std::string kernel,
                       std::optional<Tensor> weight_kn, int64_t onednn_from_rows, int64_t weight_max) {
             TORCH_CHECK(bits == 8 || bits == 16, "QuantizedLinear: bits 8 or 16");
             TORCH_CHECK(bits == 16 || excess, "QuantizedLinear: int8 needs its excess");
             TORCH_CHECK(weight_inv.numel() == out_features, "QuantizedLinear: one scale per output row");
             TORCH_CHECK(kernel != "onednn" || weight_kn, "QuantizedLinear: kernel onednn needs weight_kn");
             return QuantizedLinear{bits, packed.contiguous(), weight_inv.contiguous(),
                                    excess ? excess->contiguous() : Tensor(), a_max, weight_max,
                                    bias ? std::optional<Tensor>(bias->contiguous()) : std::nullopt, in_features,
                                    out_features, kernel,
                                    weight_kn ? std::optional<Tensor>(weight_kn->contiguous()) : std::nullopt,
                                    onednn_from_rows};
           }),
           py::arg("bits"), py::arg("packed"), py::arg("weight_inv"), py::arg("excess"), py::arg("a_max"),
           py::arg("bias"), py::arg("in_features"), py::arg("out_features"), py::arg("kernel") = "auto",
           py::arg("weight_kn") = py::none(), py::arg("onednn_from_rows") = 0, py::arg("weight_max") = 127)
      .def_readonly("bits", &QuantizedLinear::bits)
      .def_readonly("packed", &QuantizedLinear::packed)
      .def_readonly("weight_inv", &QuantizedLinear::weight_inv)
      .def_readonly("bias", &QuantizedLinear::bias)
      .def_readonly("in_features", &QuantizedLinear::in_features)
      .def_readonly("out_features", &QuantizedLinear::out_features)
      .def_readonly("kernel", &QuantizedLinear::kernel)
      .def("__call__", &QuantizedLinear::operator(), py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &int8_linear,
        "(x float32 (rows, in), packed int8 (quantized_linear.packed_for), weight_inv float32 (out,), excess int32 (out,), bias or None, kernel, "
        "weight_max 127 or 63) "
        "-> float32 (rows, out); see fairseq_stream/ops/quantized_linear.py",
        py::arg("x"), py::arg("packed"), py::arg("weight_inv"), py::arg("excess"), py::arg("bias") = py::none(),
        py::arg("kernel") = "auto", py::arg("weight_max") = 127);
  m.def("int8_kernels", &int8_kernels,
        "the int8 kernels this CPU runs on weights of magnitude up to weight_max, the best (the 'auto' one) last",
        py::arg("weight_max") = 127);
  m.def("int8_onednn_exact", &int8_onednn_exact,
        "whether oneDNN's int8 GEMM (at::_int_mm) sums exactly on this CPU (AMX or VNNI, checked once)");
}
