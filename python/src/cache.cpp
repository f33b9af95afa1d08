// infkv's Python module: the cache after a decision: compaction in place, position compaction, RoPE
// re-rotation.
#include "bindings.hpp"

namespace infkv_py {

void bind_cache(nb::module_& m) {
  m.def(
      "compact",
      [](rw_array keys, std::optional<rw_array> values, tokens& t, const infkv::keep_set& keep,
         const std::string& lay) {
        const layout l = layout_of(lay);
        infkv::kv_view kv;
        kv.k = view_of<infkv::tensor_view>(keys, "keys", l);
        if (values) kv.v = view_of<infkv::tensor_view>(*values, "values", l);
        const std::int64_t n = kv.k.n_slots;
        INFKV_REQUIRE(std::int64_t(t.t.size()) == n, "tokens", t.t.size(), "must hold one token per slot (", n, ")");
        std::int64_t m;
        {
          nb::gil_scoped_release unlocked;
          m = infkv::cpu::compact(kv, t.t, keep);
        }
        t.t.resize(std::size_t(m));
        return m;
      },
      "keys"_a, "values"_a.none(), "tokens"_a, "keep"_a, nb::kw_only(), "layout"_a = "nhd",
      "Moves the kept slots of every head to slots [0, kept) in place (tokens alike, truncated); returns kept. "
      "Every unit must keep the same count (one unit, or one per KV head).");
  m.def(
      "compact_positions",
      [](tokens& t, std::int64_t first, std::int64_t max_gap) {
        return to_numpy(infkv::compact_positions(t.t, first, max_gap));
      },
      "tokens"_a, "first"_a = 0, nb::kw_only(), "max_gap"_a = 0,
      "Gives the slots positions first, first + 1, ... in time order (with max_gap > 0, each gap between "
      "two positions narrowed to at most max_gap free positions instead of closed); returns each slot's delta "
      "for rerotate.");
  m.def(
      "rerotate",
      [](rw_array keys, positions_array delta, const infkv::rope& r, const std::string& lay, int threads) {
        const auto k = view_of<infkv::tensor_view>(keys, "keys", layout_of(lay));
        nb::gil_scoped_release unlocked;
        infkv::cpu::rerotate(k, std::span<const std::int64_t>(delta.data(), delta.shape(0)), r, {.threads = threads});
      },
      "keys"_a, "delta"_a, "rope"_a, nb::kw_only(), "layout"_a = "nhd", "threads"_a = 1,
      "Turns every head of slot j by delta[j] positions, in place (keys after compaction in compact mode).");
}

}  // namespace infkv_py
