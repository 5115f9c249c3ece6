// The across-node checks of each fused GEMM, defined with the op's other tests (test_ag_gemm.cpp,
// test_gemm_rs.cpp, test_gemm_ar.cpp), for test_nodes_processes.cpp, which runs them as one
// process per rank. Every rank of a multi-node communicator calls them (collective).
#pragma once

#include "mkernel/communicator.h"

namespace mk::test {

void expect_ag_gemm_nodes(Communicator& comm);  // bench/run.sh's check shapes, growing workspaces
void expect_gemm_rs_nodes(Communicator& comm);  // the in-process suite's cases
void expect_gemm_ar_nodes(Communicator& comm);

}  // namespace mk::test
