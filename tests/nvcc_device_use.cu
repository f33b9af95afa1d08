// Compiled by nvcc only (core_headers_nvcc): a kernel that calls every INFKV_HOST_DEVICE piece of
// the core, so a missing annotation or a host-only construct in one of them fails the build.
#include <infkv/infkv.hpp>

__global__ void infkv_device_use(infkv::tensor_view k, infkv::paged_rows p, infkv::score_view s, infkv::keep_view keep,
                                 float* out) {
  const auto* a = static_cast<const std::uint16_t*>(k.row(threadIdx.x, 0));
  const auto* b = static_cast<const std::uint16_t*>(p.row(threadIdx.x, 0));
  float x = infkv::f16_to_f32(a[0]) + infkv::bf16_to_f32(b[0]);
  x += infkv::bf16_to_f32(infkv::f32_to_bf16(x)) + infkv::f16_to_f32(infkv::f32_to_f16(x));
  x += s(0, threadIdx.x) + *s.rows_from(0, 1).row(0) + float(keep.size(0) + *keep.unit(0));
  x += infkv::keep_before(x, 1, 2, s(0, 0), 3, 4) ? 1.f : 0.f;
  x += float(infkv::size_of(k.type)) + (k.empty() || p.empty() ? 1.f : 0.f);
  out[threadIdx.x] = x;
}
