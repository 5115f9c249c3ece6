// Which RDMA device a GPU's transport uses: the one closest to the GPU on the PCIe tree (NCCL
// calls the levels PIX / PXB / PHB / SYS). Pure logic over sysfs, so that it is tested on any
// machine with a fake sysfs tree (tests/cpu/test_nic_affinity.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mk::transport::detail {

// Where a PCI device sits: the components of its sysfs device path below /sys/devices (root
// complex first, the device itself last), and its NUMA node (-1: unknown).
struct PciPlace {
  std::vector<std::string> path;
  int numa_node = -1;
};

// The place of a PCI function by bus id ("0000:1b:00.0"; also as cudaDeviceGetPCIBusId and NVML
// write it: upper case, eight-digit domain), through <sysfs>/bus/pci/devices. Empty when unknown.
std::optional<PciPlace> pci_place_of_bus_id(const std::string& bus_id,
                                            const std::string& sysfs = "/sys");
// The place of an RDMA device by verbs name ("mlx5_0"), through <sysfs>/class/infiniband.
std::optional<PciPlace> pci_place_of_rdma_device(const std::string& name,
                                                 const std::string& sysfs = "/sys");

// How close two places are: twice the number of leading path components they share (same root
// complex, bridge, switch, ...) plus one on the same NUMA node. Larger is closer.
int pci_closeness(const PciPlace& a, const PciPlace& b);

// The order in which to try `nics` for a GPU at `gpu`: closest first; among equally close ones,
// rotated by `spread` (e.g. the local rank: GPUs behind one switch use its NICs in turn); NICs
// whose place is unknown last, in their given order. Without a GPU place: the given order.
std::vector<int> nic_order(const std::optional<PciPlace>& gpu,
                           const std::vector<std::optional<PciPlace>>& nics, int spread);

}  // namespace mk::transport::detail
