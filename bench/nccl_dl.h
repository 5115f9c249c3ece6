// NCCL loaded at run time (dlopen), for baselines and cross-checks only: mkernel itself never
// uses NCCL. MKERNEL_NCCL_LIB names the library; otherwise libnccl.so.2 from the loader's path.
#pragma once

#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace mk::bench {

struct Nccl {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  std::string path;

  // Throws std::runtime_error if NCCL cannot be loaded.
  static const Nccl& get() {
    static const Nccl nccl = load();
    return nccl;
  }
  // No NCCL at all (a run that never calls it: ranks sharing a GPU).
  static const Nccl& none() {
    static const Nccl nothing;
    return nothing;
  }

  void check(ncclResult_t r, const char* what) const {
    if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + GetErrorString(r));
  }

 private:
  template <typename F>
  static void sym(void* lib, F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (f == nullptr) throw std::runtime_error(std::string("NCCL lacks ") + name);
  }
  static Nccl load() {
    Nccl n;
    const char* env = std::getenv("MKERNEL_NCCL_LIB");
    n.path = env ? env : "libnccl.so.2";
    void* lib = dlopen(n.path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) throw std::runtime_error("cannot load NCCL (" + n.path + "): " + dlerror());
    sym(lib, n.GetVersion, "ncclGetVersion");
    sym(lib, n.GetUniqueId, "ncclGetUniqueId");
    sym(lib, n.CommInitRank, "ncclCommInitRank");
    sym(lib, n.CommDestroy, "ncclCommDestroy");
    sym(lib, n.AllGather, "ncclAllGather");
    sym(lib, n.ReduceScatter, "ncclReduceScatter");
    sym(lib, n.AllReduce, "ncclAllReduce");
    sym(lib, n.GetErrorString, "ncclGetErrorString");
    return n;
  }
};

}  // namespace mk::bench
