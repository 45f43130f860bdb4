// The compiled search step of fixed-width beam search with fairseq's finalization
// (beam_step_cpu.cpp), bound into the same extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

void register_beam_step(pybind11::module& m);
