// One query per row attending over the lean runner's caches and encoder keys (attention_cpu.cpp),
// bound into the same extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

void register_attention(pybind11::module& m);
