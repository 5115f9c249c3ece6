// Symmetric memory: cuMem allocations exported as POSIX file descriptors, passed to the other
// ranks of the node (dup() inside one process, SCM_RIGHTS over a Unix socket across processes),
// imported and mapped back to back in one reserved address range.
//
//   rank 0 VA: [ copy of local rank 0 | copy of local rank 1 | ... ]   (each mapped_size bytes)
//   rank 1 VA: [ copy of local rank 0 | copy of local rank 1 | ... ]
//
// Every step that can fail on one rank ends with an allgather of a status word, so a failure on
// any rank turns into an error on every rank instead of a peer waiting forever.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <string>

#include "mkernel/error.h"
#include "runtime/comm_state.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/socket_util.h"

namespace mk::detail {
namespace {

// Shares a fixed-size failure message across ranks; throws on every rank if any rank failed.
void agree(CommState& comm, const std::string& my_error, const char* step) {
  struct Msg {
    char text[200];
  } mine{};
  std::strncpy(mine.text, my_error.c_str(), sizeof(mine.text) - 1);
  std::vector<Msg> all(comm.topo.world_size);
  comm.bootstrap->allgather(&mine, all.data(), sizeof(Msg));
  for (int r = 0; r < comm.topo.world_size; ++r) {
    if (all[r].text[0] != '\0') {
      const bool oom = std::strstr(all[r].text, "out of GPU memory") != nullptr;
      throw Error(oom ? ErrorCode::kOutOfMemory : ErrorCode::kCuda,
                  std::string("symmetric alloc (") + step + ") failed on rank " +
                      std::to_string(r) + ": " + all[r].text);
    }
  }
}

CUmemAllocationProp allocation_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

std::string what_of(const std::exception& e) { return e.what(); }

}  // namespace

SymAllocation::~SymAllocation() {
  // Best effort: destructors must not throw. Unmapping our view of a peer's memory does not
  // affect the peer; the physical memory lives until every rank released its handle.
  const DriverApi& cu = driver();
  for (std::size_t i = 0; i < bases.size(); ++i) {
    if (bases[i] != 0) cu.MemUnmap(bases[i], mapped_size);
    if (handles[i] != 0) cu.MemRelease(handles[i]);
  }
  if (reserved != 0) cu.MemAddressFree(reserved, mapped_size * bases.size());
  if (d_peers != nullptr) cudaFree(d_peers);
}

std::shared_ptr<SymAllocation> create_symmetric(CommState& comm, std::size_t bytes) {
  const Topology& topo = comm.topo;
  const DriverApi& cu = driver();

  // 1. Every rank must ask for the same size.
  std::vector<uint64_t> sizes(topo.world_size);
  uint64_t mine = bytes;
  comm.bootstrap->allgather(&mine, sizes.data(), sizeof(mine));
  for (int r = 0; r < topo.world_size; ++r) {
    if (sizes[r] != sizes[0]) {
      throw Error(ErrorCode::kInvalidArgument,
                  "symmetric alloc: ranks disagree on the size: rank 0 asked for " +
                      std::to_string(sizes[0]) + " bytes, rank " + std::to_string(r) + " for " +
                      std::to_string(sizes[r]) + "; every rank must pass the same size");
    }
  }
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "symmetric alloc: size must be > 0 bytes");
  }

  auto alloc = std::make_shared<SymAllocation>();
  alloc->size = bytes;
  alloc->device = comm.device;
  alloc->local_rank = topo.local_rank;
  alloc->handles.assign(topo.local_size, 0);
  alloc->bases.assign(topo.local_size, 0);

  // 2. Create and export this rank's physical memory. The exported descriptor holds the memory
  //    too: it is closed on every path, a peer's failure included (then `agree` throws here).
  const CUmemAllocationProp prop = allocation_prop(comm.device);
  UniqueFd exported;
  int exported_fd = -1;
  std::string error;
  try {
    std::size_t granularity = 0;
    MK_CU_CHECK(
        cu.MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    if (bytes > std::numeric_limits<std::size_t>::max() - granularity) {  // (rounding wraps)
      throw Error(ErrorCode::kOutOfMemory,
                  "symmetric alloc: " + std::to_string(bytes) + " bytes cannot be allocated");
    }
    alloc->mapped_size = (bytes + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle handle = 0;
    CUresult rc = cu.MemCreate(&handle, alloc->mapped_size, &prop, 0);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      throw Error(ErrorCode::kOutOfMemory,
                  "out of GPU memory for " + std::to_string(alloc->mapped_size) + " bytes");
    }
    MK_CU_CHECK(rc);
    alloc->handles[topo.local_rank] = handle;
    MK_CU_CHECK(cu.MemExportToShareableHandle(&exported_fd, handle,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    exported.reset(exported_fd);
  } catch (const std::exception& e) {
    error = what_of(e);
  }
  agree(comm, error, "create");

  // 3. Hand the descriptor to every local peer. Same-process peers read the number through
  //    the bootstrap and dup() it; the others receive a copy over the Unix socket.
  std::vector<int32_t> fd_numbers(topo.world_size);
  int32_t my_fd = exported_fd;
  comm.bootstrap->allgather(&my_fd, fd_numbers.data(), sizeof(my_fd));
  std::vector<int> remote;  // local peers living in other processes (global ranks)
  for (int r : topo.node_ranks) {
    if (r != topo.rank && !topo.same_process[r]) remote.push_back(r);
  }
  std::vector<UniqueFd> received;  // the peers' descriptors, closed on every path
  error.clear();
  try {
    for (int fd : comm.fd_exchange->exchange(exported_fd, remote, remote, comm.next_tag++)) {
      received.emplace_back(fd);
    }
  } catch (const std::exception& e) {
    error = what_of(e);
  }
  agree(comm, error, "exchange");

  // 4. Import and map every local rank's copy into one reserved range.
  error.clear();
  try {
    MK_CU_CHECK(cu.MemAddressReserve(&alloc->reserved, alloc->mapped_size * topo.local_size,
                                     /*alignment=granularity*/ 0, 0, 0));
    std::size_t next_remote = 0;
    for (int i = 0; i < topo.local_size; ++i) {
      const int r = topo.node_ranks[i];
      if (r != topo.rank) {
        int fd = -1;
        if (topo.same_process[r]) {
          fd = dup(fd_numbers[r]);
          if (fd < 0) throw Error(ErrorCode::kSystem, "dup of a peer's memory handle failed");
        } else {
          fd = received[next_remote++].release();
        }
        CUmemGenericAllocationHandle h = 0;
        CUresult rc =
            cu.MemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd);
        MK_CU_CHECK(rc);
        alloc->handles[i] = h;
      }
      const CUdeviceptr va = alloc->reserved + alloc->mapped_size * i;
      MK_CU_CHECK(cu.MemMap(va, alloc->mapped_size, 0, alloc->handles[i], 0));
      alloc->bases[i] = va;
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = comm.device;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      MK_CU_CHECK(cu.MemSetAccess(va, alloc->mapped_size, &access, 1));
    }
    MK_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&alloc->d_peers), sizeof(void*) * topo.local_size));
    std::vector<void*> peers(topo.local_size);
    for (int i = 0; i < topo.local_size; ++i) peers[i] = reinterpret_cast<void*>(alloc->bases[i]);
    MK_CUDA_CHECK(cudaMemcpy(alloc->d_peers, peers.data(), sizeof(void*) * topo.local_size,
                             cudaMemcpyHostToDevice));
    // Fresh buffers read as zero, so a signal pad needs no further setup.
    MK_CUDA_CHECK(
        cudaMemset(reinterpret_cast<void*>(alloc->bases[topo.local_rank]), 0, alloc->mapped_size));
    MK_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    error = what_of(e);
  }
  received.clear();
  // Same-process peers dup()ed our descriptor before this allgather returns; only then close it
  // (`exported`, on leaving, whether it throws or not).
  agree(comm, error, "map");

  std::lock_guard<std::mutex> lock(comm.registry_mutex);
  comm.registry.push_back(alloc);
  return alloc;
}

}  // namespace mk::detail
