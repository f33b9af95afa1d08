// infkv's Python module (nanobind): the C++ API's policies, budgets, plans and CPU kernels over
// tensors taken without copying (DLPack: NumPy arrays, torch tensors). infkv::invalid_argument
// arrives as ValueError, infkv::engine_error as infkv.EngineError (a RuntimeError), with the
// same messages. The bindings are by topic: policies.cpp, pipeline.cpp, cache.cpp, archive.cpp, batch.cpp.
#include <infkv/version.hpp>

#include "bindings.hpp"

NB_MODULE(_infkv, m) {
  m.doc() = "infkv: KV-cache policies under a fixed memory budget (CPU backend)";
  m.attr("__version__") = infkv::cat(INFKV_VERSION_MAJOR, ".", INFKV_VERSION_MINOR, ".", INFKV_VERSION_PATCH);

  static nb::exception<infkv::engine_error> engine_exc(m, "EngineError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const infkv::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const infkv::engine_error& e) {
      PyErr_SetString(engine_exc.ptr(), e.what());
    } catch (const infkv::error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  nb::enum_<infkv::granularity>(m, "granularity", "What one keep decision covers.")
      .value("per_head", infkv::granularity::per_head)
      .value("per_layer", infkv::granularity::per_layer)
      .value("per_token", infkv::granularity::per_token);
  nb::enum_<infkv::reduction>(m, "reduction", "How rows combine below per_head.")
      .value("sum", infkv::reduction::sum)
      .value("mean", infkv::reduction::mean)
      .value("max", infkv::reduction::max);
  nb::enum_<infkv::pooling>(m, "pooling", "Pooling along time.")
      .value("none", infkv::pooling::none)
      .value("avg", infkv::pooling::avg)
      .value("max", infkv::pooling::max)
      .value("sum", infkv::pooling::sum);
  nb::enum_<infkv::modality>(m, "modality")
      .value("text", infkv::modality::text)
      .value("image", infkv::modality::image)
      .value("video", infkv::modality::video)
      .value("audio", infkv::modality::audio);
  nb::enum_<infkv::decay>(m, "decay")
      .value("linear", infkv::decay::linear)
      .value("exponential", infkv::decay::exponential);
  nb::enum_<infkv::age_unit>(m, "age_unit")
      .value("positions", infkv::age_unit::positions)
      .value("segments", infkv::age_unit::segments)
      .value("ranks", infkv::age_unit::ranks);
  nb::enum_<infkv::rope_style>(m, "rope_style")
      .value("normal", infkv::rope_style::normal)
      .value("neox", infkv::rope_style::neox);

  infkv_py::bind_policies(m);
  infkv_py::bind_pipeline(m);
  infkv_py::bind_cache(m);
  infkv_py::bind_archive(m);
  infkv_py::bind_batch(m);
}
