// The self-attention caches' slots as rows move (cache_slots_cpu.cpp): one implementation for the lean
// runner's reorder on the CPU (fairseq_stream/runners/lean.py:_reorder_segment, through
// fairseq_stream/ops/attention.py:follow_parents_) and for the compiled search loop (search_loop_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

// Rows that continue the rows in slots parent_slot[r] (rows <= the caches' slots): a row keeps its parent's
// slot; a parent's second and later children take the free slots, lowest first, with a copy of its written
// positions 0..length-1. Returns each row's slot.
std::vector<int64_t> follow_parent_slots(std::vector<at::Tensor>& caches, const std::vector<int64_t>& parent_slot,
                                         int64_t length);

// The caches in new tensors of slot.size() slots and `positions` positions, row r holding what slot[r] held
// (written positions 0..length-1 only); then every row is its own slot (slot becomes 0..rows-1).
void regather_slots(std::vector<at::Tensor>& caches, std::vector<int64_t>& slot, int64_t positions,
                    int64_t length);

// Whether caches of `capacity` slots held by `rows` rows are compacted (most slots free: sentences ended):
// at least 2 * compact_above slots and more than twice the rows.
bool compacts(int64_t capacity, int64_t rows, int64_t compact_above);

// A reorder's cache move: rows follow their parents' slots (follow_parent_slots), then the caches are
// compacted where `compacts` says so (regather_slots, keeping their positions). Returns (the caches, each
// row's slot): new tensors where compacted, else the same ones, written in place.
std::tuple<std::vector<at::Tensor>, at::Tensor> reorder_cache_slots(std::vector<at::Tensor> caches,
                                                                          const at::Tensor& parent_slot,
                                                                          int64_t length, int64_t compact_above);
