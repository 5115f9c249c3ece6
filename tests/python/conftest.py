# tests/python: the Python package's tests (pytest). test_api.py runs anywhere the package is
# installed; test_torch_dist.py needs a Hopper GPU and spawns ranks as processes.
import os

# NVLink multicast must stay off on the shared GPU hosts (it can take their GPUs out of service).
# Set before any test starts processes, which inherit the environment.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("NCCL_NVLS_DISABLE", "1"),
                      ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value
