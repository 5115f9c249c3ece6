// mkernel/mkernel.h - everything a user of the C++ API needs.
#pragma once

#include "mkernel/bootstrap.h"
#include "mkernel/collectives.h"
#include "mkernel/communicator.h"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "mkernel/gemm.h"
#include "mkernel/moe.h"
#include "mkernel/topology.h"
#include "mkernel/types.h"
