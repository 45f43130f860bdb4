// The Python binding of the fused output layer's entry, one text for both devices: the CPU module
// (cpu/bindings_cpu.cpp) and the CUDA one (cuda/output_layer_cuda_binding.cpp) bind their topk_log_softmax
// under the same name, arguments and documentation, which fairseq_stream/ops/output_layer.py calls alike.
#pragma once

#include <torch/python.h>

template <class F>
void def_topk_log_softmax(pybind11::module& m, F* topk_log_softmax) {
  namespace py = pybind11;
  m.def("topk_log_softmax", topk_log_softmax,
        "(logits list, bias list, n, pad, eos, unk (-1: none), unk_penalty, temperature, ban_all, "
        "ban_eos, force_eos, add) -> [values (rows, n), indices (rows, n), eos (rows,)]; "
        "see fairseq_stream/ops/output_layer.py",
        py::arg("logits"), py::arg("bias"), py::arg("n"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::arg("ban_all"), py::arg("ban_eos"),
        py::arg("force_eos"), py::arg("add"));
}
