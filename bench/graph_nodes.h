// The benchmarks' view of a call as a CUDA graph: which kernels it launches (their names, from the
// driver), and what each of them adds to the call's time (time_prefixes).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench_check.h"

namespace mk::bench {

// A graph node's name: a kernel's (cuFuncGetName / cuKernelGetName, CUDA 12.3; "?" where the
// driver cannot name it), else the node's kind.
inline std::string node_name(cudaGraphNode_t node) {
  const auto entry = [](const char* symbol, int version) -> void* {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return fn;
  };
  using NodeParams = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  using FuncName = CUresult (*)(const char**, CUfunction);
  using KernelName = CUresult (*)(const char**, CUkernel);
  static const auto node_params =
      reinterpret_cast<NodeParams>(entry("cuGraphKernelNodeGetParams", 12000));
  static const auto func_name = reinterpret_cast<FuncName>(entry("cuFuncGetName", 12030));
  static const auto kernel_name = reinterpret_cast<KernelName>(entry("cuKernelGetName", 12030));
  cudaGraphNodeType type{};
  CK(cudaGraphNodeGetType(node, &type));
  switch (type) {
    case cudaGraphNodeTypeKernel:
      break;
    case cudaGraphNodeTypeMemset:
      return "(memset)";
    case cudaGraphNodeTypeMemcpy:
      return "(memcpy)";
    default:
      return "(node of type " + std::to_string(static_cast<int>(type)) + ")";
  }
  const char* name = nullptr;
  CUDA_KERNEL_NODE_PARAMS p{};
  if (node_params != nullptr && node_params(node, &p) == CUDA_SUCCESS) {
    if (p.func != nullptr && func_name != nullptr) {
      func_name(&name, p.func);
    } else if (p.kern != nullptr && kernel_name != nullptr) {
      kernel_name(&name, p.kern);
    }
  }
  return name != nullptr ? name : "?";
}

// The graph's nodes, each after the nodes it depends on (for a one-stream capture: stream order).
inline std::vector<cudaGraphNode_t> nodes_in_order(cudaGraph_t g) {
  std::size_t count = 0;
  CK(cudaGraphGetNodes(g, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  CK(cudaGraphGetNodes(g, nodes.data(), &count));
  std::map<cudaGraphNode_t, std::size_t> waiting;  // unplaced dependencies
  std::map<cudaGraphNode_t, std::vector<cudaGraphNode_t>> dependents;
  // (A programmatic edge - cuBLAS's graphs at some shapes, moe_dispatch_gemm's kernels with
  // programmatic launches - carries data, and asking for its node without the data is refused
  // as lossy. CUDA 12.3 added the call with the data; 13 made it the only one.)
  const auto dependencies = [](cudaGraphNode_t n, cudaGraphNode_t* from, std::size_t* deps) {
#if CUDART_VERSION >= 12030
    std::vector<cudaGraphEdgeData> edges(from != nullptr ? *deps : 0);
#if CUDART_VERSION >= 13000
    return cudaGraphNodeGetDependencies(n, from, from != nullptr ? edges.data() : nullptr, deps);
#else
    return cudaGraphNodeGetDependencies_v2(n, from, from != nullptr ? edges.data() : nullptr, deps);
#endif
#else
    return cudaGraphNodeGetDependencies(n, from, deps);
#endif
  };
  for (cudaGraphNode_t n : nodes) {
    std::size_t deps = 0;
    CK(dependencies(n, nullptr, &deps));
    std::vector<cudaGraphNode_t> from(deps);
    if (deps > 0) CK(dependencies(n, from.data(), &deps));
    waiting[n] = deps;
    for (cudaGraphNode_t f : from) dependents[f].push_back(n);
  }
  std::vector<cudaGraphNode_t> order;
  for (cudaGraphNode_t n : nodes) {
    if (waiting[n] == 0) order.push_back(n);
  }
  for (std::size_t i = 0; i < order.size(); ++i) {
    for (cudaGraphNode_t d : dependents[order[i]]) {
      if (--waiting[d] == 0) order.push_back(d);
    }
  }
  return order;
}

// What each node of one call of `op` (launched on `s`) adds to the call's time: the call
// captured once, then for each node i a copy of the graph without the nodes after i (stream
// order), replayed `iters` times a round; `rounds` rounds in which the prefixes alternate, the
// median of each. A node's increment is its prefix's time less the one before: its own time and
// its launch's gap, less whatever of it overlaps the node before (a programmatic launch). Every
// prefix of a call must be a valid call itself (what a later kernel expects of an earlier one,
// the earlier one has done).
struct PrefixTime {
  std::string node;
  double ms = 0;         // the prefix ending at this node
  double increment = 0;  // ms less the prefix before
};
inline std::vector<PrefixTime> time_prefixes(cudaStream_t s, const std::function<void()>& op,
                                             int iters, int rounds) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  op();
  CK(cudaStreamEndCapture(s, &g));
  const std::vector<cudaGraphNode_t> order = nodes_in_order(g);
  std::vector<cudaGraphExec_t> execs;
  std::vector<PrefixTime> out;
  for (std::size_t i = 0; i < order.size(); ++i) {
    cudaGraph_t prefix;
    CK(cudaGraphClone(&prefix, g));
    for (std::size_t j = i + 1; j < order.size(); ++j) {
      cudaGraphNode_t in_clone;
      CK(cudaGraphNodeFindInClone(&in_clone, order[j], prefix));
      CK(cudaGraphDestroyNode(in_clone));
    }
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, prefix, 0));
    CK(cudaGraphDestroy(prefix));
    execs.push_back(exec);
    out.push_back({node_name(order[i])});
  }
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<std::vector<double>> ms(execs.size());
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t i = 0; i < execs.size(); ++i) {
      CK(cudaGraphLaunch(execs[i], s));  // warm
      CK(cudaEventRecord(start, s));
      for (int it = 0; it < iters; ++it) CK(cudaGraphLaunch(execs[i], s));
      CK(cudaEventRecord(stop, s));
      CK(cudaEventSynchronize(stop));
      float t = 0;
      CK(cudaEventElapsedTime(&t, start, stop));
      ms[i].push_back(static_cast<double>(t) / iters);
    }
  }
  for (std::size_t i = 0; i < execs.size(); ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    out[i].ms = ms[i][ms[i].size() / 2];
    out[i].increment = out[i].ms - (i == 0 ? 0.0 : out[i - 1].ms);
    CK(cudaGraphExecDestroy(execs[i]));
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaGraphDestroy(g));
  return out;
}

// A kernel's name for a table: demangled, without its parameter list, at most `width`
// characters (the end kept: the policy is the last template argument).
inline std::string short_name(const std::string& name, std::size_t width = 72) {
  int status = 0;
  char* plain = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  std::string s = status == 0 && plain != nullptr ? plain : name;
  std::free(plain);
  s = s.substr(0, s.find('('));
  if (s.size() > width) s = "..." + s.substr(s.size() - (width - 3));
  return s;
}

}  // namespace mk::bench
