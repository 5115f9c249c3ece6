// The registry of kernel loaders (runtime/kernel_preload.h).
#include "runtime/kernel_preload.h"

#include <mutex>
#include <vector>

namespace mk::detail {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<KernelPreload> loaders;
};

// Constructed on first use: the ops register from their own static initialisers, in any order.
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

bool register_kernel_preload(KernelPreload preload) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.loaders.push_back(preload);
  return true;
}

void preload_kernels(bool across_nodes) {
  Registry& r = registry();
  std::vector<KernelPreload> loaders;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    loaders = r.loaders;
  }
  for (KernelPreload load : loaders) load(across_nodes);
}

}  // namespace mk::detail
