// The self-attention caches' slots as rows move to the next beam: which slot each row takes, the copies a
// parent's later children need, and the compaction once most slots are free. One implementation for the
// lean runner's reorder on the CPU (runners/lean.py:_reorder_segment calls reorder_cache_slots_ through
// ops/attention.py:follow_parents_) and for the compiled search loop (search_loop_cpu.cpp), so that both
// place rows in the same slots by the same rule. Slot numbers change no result: every row attends over
// its own slot's written positions only.

#include "cache_slots_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <numeric>

#include "attention_cpu.h"

using at::Tensor;

std::vector<int64_t> follow_parent_slots(std::vector<Tensor>& caches, const std::vector<int64_t>& parent_slot,
                                         int64_t length) {
  const int64_t capacity = caches[0].size(1), rows = static_cast<int64_t>(parent_slot.size());
  TORCH_CHECK(rows <= capacity, "follow_parent_slots: ", rows, " rows in ", capacity, " slots");
  std::vector<char> used(capacity, 0);
  std::vector<int64_t> next(rows), children;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = parent_slot[r];
    TORCH_CHECK(s >= 0 && s < capacity, "follow_parent_slots: slot ", s, " out of range");
    if (used[s]) {
      children.push_back(r);
      continue;
    }
    used[s] = 1;
    next[r] = s;
  }
  if (children.empty()) return next;
  std::vector<int64_t> source, target;
  for (int64_t j = 0, c = 0; c < static_cast<int64_t>(children.size()); ++j) {
    if (used[j]) continue;
    source.push_back(parent_slot[children[c]]);
    target.push_back(j);
    next[children[c]] = j;
    ++c;
  }
  if (length > 0) {
    const auto lng = caches[0].options().dtype(at::kLong);
    const Tensor from = at::tensor(source, lng), to = at::tensor(target, lng);
    for (auto& cache : caches) copy_cache_slots_(cache, from, to, length);
  }
  return next;
}

void regather_slots(std::vector<Tensor>& caches, std::vector<int64_t>& slot, int64_t positions, int64_t length) {
  const Tensor from = at::tensor(slot, caches[0].options().dtype(at::kLong));
  for (auto& cache : caches) {
    // Not zeroed: positions past `length` are written before any row reads them.
    Tensor moved = at::empty({cache.size(0), from.size(0), cache.size(2), positions, cache.size(4)}, cache.options());
    moved.narrow(3, 0, length).copy_(cache.narrow(3, 0, length).index_select(1, from));
    cache = moved;
  }
  std::iota(slot.begin(), slot.end(), 0);
}

bool compacts(int64_t capacity, int64_t rows, int64_t compact_above) {
  return capacity >= 2 * compact_above && 2 * rows < capacity;
}

std::tuple<std::vector<Tensor>, Tensor> reorder_cache_slots(std::vector<Tensor> caches, const Tensor& parent_slot,
                                                           int64_t length, int64_t compact_above) {
  TORCH_CHECK(!caches.empty(), "reorder_cache_slots_: one cache per model");
  for (const auto& cache : caches)
    TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.device().is_cpu() &&
                    cache.size(1) == caches[0].size(1) && cache.size(3) >= length,
                "reorder_cache_slots_: contiguous CPU caches (2 * layers, slots, heads, capacity, head_dim), as "
                "many slots each, capacity >= length");
  TORCH_CHECK(parent_slot.device().is_cpu() && parent_slot.scalar_type() == at::kLong && parent_slot.dim() == 1,
              "reorder_cache_slots_: parent_slot must be a 1-d int64 CPU tensor");
  const Tensor parents = parent_slot.contiguous();
  const int64_t* p = parents.data_ptr<int64_t>();
  std::vector<int64_t> slot = follow_parent_slots(caches, std::vector<int64_t>(p, p + parents.numel()), length);
  if (compacts(caches[0].size(1), static_cast<int64_t>(slot.size()), compact_above))
    regather_slots(caches, slot, caches[0].size(3), length);
  return {caches, at::tensor(slot, parent_slot.options())};
}
