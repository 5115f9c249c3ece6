// Internal: libibverbs and libefa, loaded with dlopen at run time (no link-time dependency).
//
// Only the exported functions are resolved here. The data-path verbs (ibv_post_send,
// ibv_post_recv, ibv_poll_cq, ibv_wr_*) are inline in <infiniband/verbs.h> and call through the
// device context's function table, so they need no symbol. Header macros that would reference a
// library symbol behind our back (ibv_query_port, ibv_reg_mr) are replaced by the calls below.
#pragma once

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include <string>

namespace mk::transport::detail {

struct VerbsApi {
  void* handle = nullptr;
  std::string path;
  decltype(&::ibv_get_device_list) get_device_list = nullptr;
  decltype(&::ibv_free_device_list) free_device_list = nullptr;
  decltype(&::ibv_get_device_name) get_device_name = nullptr;
  decltype(&::ibv_open_device) open_device = nullptr;
  decltype(&::ibv_close_device) close_device = nullptr;
  decltype(&::ibv_query_device) query_device = nullptr;
  decltype(&::ibv_query_port) query_port_compat = nullptr;  // see query_port()
  decltype(&::ibv_query_gid) query_gid = nullptr;
  decltype(&::ibv_alloc_pd) alloc_pd = nullptr;
  decltype(&::ibv_dealloc_pd) dealloc_pd = nullptr;
  decltype(&::ibv_reg_mr) reg_mr = nullptr;
  decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr = nullptr;  // optional (rdma-core >= 34)
  decltype(&::ibv_dereg_mr) dereg_mr = nullptr;
  decltype(&::ibv_create_cq) create_cq = nullptr;
  decltype(&::ibv_destroy_cq) destroy_cq = nullptr;
  decltype(&::ibv_create_qp) create_qp = nullptr;
  decltype(&::ibv_modify_qp) modify_qp = nullptr;
  decltype(&::ibv_destroy_qp) destroy_qp = nullptr;
  decltype(&::ibv_create_ah) create_ah = nullptr;
  decltype(&::ibv_destroy_ah) destroy_ah = nullptr;
  decltype(&::ibv_qp_to_qp_ex) qp_to_qp_ex = nullptr;  // optional
  decltype(&::ibv_wc_status_str) wc_status_str = nullptr;
};

struct EfaApi {
  void* handle = nullptr;
  std::string path;
  decltype(&::efadv_query_device) query_device = nullptr;
  decltype(&::efadv_create_qp_ex) create_qp_ex = nullptr;
};

constexpr const char* kDefaultVerbsLibrary = "libibverbs.so.1";
constexpr const char* kDefaultEfaLibrary = "libefa.so.1";

// Loads libibverbs from `path` (empty: libibverbs.so.1) once per path and keeps it loaded.
// Throws mk::Error(kUnsupported) "the <backend> backend needs libibverbs (rdma-core); not found:
// <dlerror>", or naming the missing symbol when the library is too old. Thread-safe.
const VerbsApi& load_verbs(const std::string& backend, const std::string& path = "");
// The same for libefa (EFA direct verbs).
const EfaApi& load_efa(const std::string& path = "");

// ibv_query_port through the context's table, falling back to the library's compat entry point.
int query_port(const VerbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr);

// "IBV_WC_RETRY_EXC_ERR"-like text for a work completion status.
std::string wc_status_text(const VerbsApi& api, ibv_wc_status status);

}  // namespace mk::transport::detail
