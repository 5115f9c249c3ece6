// dlopen / dlsym of libibverbs and libefa (see verbs_loader.h).
#include "transport/verbs_loader.h"

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "mkernel/error.h"

namespace mk::transport::detail {
namespace {

std::string last_dlerror() {
  const char* text = dlerror();
  return text != nullptr ? text : "unknown dlopen error";
}

template <class Fn>
void resolve(void* handle, const char* name, Fn* out, bool required, const std::string& library,
             const std::string& backend) {
  dlerror();
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr && required) {
    throw Error(ErrorCode::kUnsupported,
                "the " + backend + " backend needs " + name + " from " + library +
                    ", which does not provide it (rdma-core too old?): " + last_dlerror());
  }
  *out = reinterpret_cast<Fn>(symbol);
}

std::mutex g_mutex;

// The loaded library at `path` (cached, never unloaded): dlopen, then resolve(api) fills the
// entry points; a library that cannot be opened throws kUnsupported saying `missing`.
template <class Api, class Resolve>
const Api& load_library(std::map<std::string, std::unique_ptr<Api>>& cache, const std::string& path,
                        const std::string& missing, Resolve&& resolve_all) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = cache.find(path); it != cache.end()) return *it->second;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    throw Error(ErrorCode::kUnsupported, missing + "; not found: " + last_dlerror());
  }
  auto api = std::make_unique<Api>();
  api->handle = handle;
  api->path = path;
  try {
    resolve_all(*api);
  } catch (...) {
    dlclose(handle);
    throw;
  }
  return *cache.emplace(path, std::move(api)).first->second;
}

}  // namespace

const VerbsApi& load_verbs(const std::string& backend, const std::string& path_in) {
  static std::map<std::string, std::unique_ptr<VerbsApi>> cache;
  const std::string path = path_in.empty() ? kDefaultVerbsLibrary : path_in;
  return load_library(
      cache, path, "the " + backend + " backend needs libibverbs (rdma-core)", [&](VerbsApi& api) {
        void* handle = api.handle;
        resolve(handle, "ibv_get_device_list", &api.get_device_list, true, path, backend);
        resolve(handle, "ibv_free_device_list", &api.free_device_list, true, path, backend);
        resolve(handle, "ibv_get_device_name", &api.get_device_name, true, path, backend);
        resolve(handle, "ibv_open_device", &api.open_device, true, path, backend);
        resolve(handle, "ibv_close_device", &api.close_device, true, path, backend);
        resolve(handle, "ibv_query_device", &api.query_device, true, path, backend);
        resolve(handle, "ibv_query_port", &api.query_port_compat, true, path, backend);
        resolve(handle, "ibv_query_gid", &api.query_gid, true, path, backend);
        resolve(handle, "ibv_alloc_pd", &api.alloc_pd, true, path, backend);
        resolve(handle, "ibv_dealloc_pd", &api.dealloc_pd, true, path, backend);
        resolve(handle, "ibv_reg_mr", &api.reg_mr, true, path, backend);
        resolve(handle, "ibv_reg_dmabuf_mr", &api.reg_dmabuf_mr, false, path, backend);
        resolve(handle, "ibv_dereg_mr", &api.dereg_mr, true, path, backend);
        resolve(handle, "ibv_create_cq", &api.create_cq, true, path, backend);
        resolve(handle, "ibv_destroy_cq", &api.destroy_cq, true, path, backend);
        resolve(handle, "ibv_create_qp", &api.create_qp, true, path, backend);
        resolve(handle, "ibv_modify_qp", &api.modify_qp, true, path, backend);
        resolve(handle, "ibv_destroy_qp", &api.destroy_qp, true, path, backend);
        resolve(handle, "ibv_create_ah", &api.create_ah, true, path, backend);
        resolve(handle, "ibv_destroy_ah", &api.destroy_ah, true, path, backend);
        resolve(handle, "ibv_qp_to_qp_ex", &api.qp_to_qp_ex, false, path, backend);
        resolve(handle, "ibv_wc_status_str", &api.wc_status_str, true, path, backend);
      });
}

const EfaApi& load_efa(const std::string& path_in) {
  static std::map<std::string, std::unique_ptr<EfaApi>> cache;
  const std::string path = path_in.empty() ? kDefaultEfaLibrary : path_in;
  return load_library(
      cache, path, "the efa backend needs libefa (rdma-core's EFA provider)", [&](EfaApi& api) {
        resolve(api.handle, "efadv_query_device", &api.query_device, true, path, "efa");
        resolve(api.handle, "efadv_create_qp_ex", &api.create_qp_ex, true, path, "efa");
      });
}

int query_port(const VerbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr) {
  // What ___ibv_query_port in <infiniband/verbs.h> does, with the fallback through dlsym.
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx == nullptr) {
    std::memset(attr, 0, sizeof(*attr));
    return api.query_port_compat(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(context, port, attr, sizeof(*attr));
}

std::string wc_status_text(const VerbsApi& api, ibv_wc_status status) {
  const char* text = api.wc_status_str != nullptr ? api.wc_status_str(status) : nullptr;
  return (text != nullptr ? std::string(text) : "status") + " (" +
         std::to_string(static_cast<int>(status)) + ")";
}

}  // namespace mk::transport::detail
