// Internal: the kernels a new communicator loads up front, registered by the ops that own them.
//
// Under CUDA's lazy loading a kernel's first launch loads it, and loading waits for the GPU's
// running kernels: with several ranks on one GPU in one process, a rank's first launch of a kernel
// would then wait behind a peer's persistent kernel that waits for it. So Communicator::create
// loads every op's kernels before the ranks meet. The runtime names no op: each op's translation
// unit registers its loader at static initialisation (an op the program never links needs none).
#pragma once

namespace mk::detail {

// Loads an op's kernels into the current context; `across_nodes`: the communicator spans several
// (virtual) nodes, so the op's across-node kernels are wanted too.
using KernelPreload = void (*)(bool across_nodes);

// Adds `preload` to the registry (call from a namespace-scope initialiser); returns true.
bool register_kernel_preload(KernelPreload preload);

// Runs every registered loader, in registration order (Communicator::create).
void preload_kernels(bool across_nodes);

}  // namespace mk::detail
