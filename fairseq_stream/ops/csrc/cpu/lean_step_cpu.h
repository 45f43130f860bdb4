// The lean runner's decoder layers for one step of one model, in one call (lean_step_cpu.cpp),
// bound into the same extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

void register_lean_step(pybind11::module& m);
