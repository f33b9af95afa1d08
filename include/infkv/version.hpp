// infkv: library version.
#pragma once

#define INFKV_VERSION_MAJOR 0
#define INFKV_VERSION_MINOR 1
#define INFKV_VERSION_PATCH 0

namespace infkv {
inline constexpr const char* version = "0.1.0";
}
