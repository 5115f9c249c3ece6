// MK_HOST_DEVICE: functions usable from host code and, under nvcc, from device code.
#pragma once

#if defined(__CUDACC__)
#define MK_HOST_DEVICE __host__ __device__
#else
#define MK_HOST_DEVICE
#endif
