// NIC choice by PCIe affinity (src/transport/nic_affinity.h) on a fake sysfs tree: a two-socket
// host, each socket a root complex with two PCIe switches, a GPU and a NIC under each switch (the
// layout of an 8-GPU H100/H200 server, halved), plus a NIC without PCI information.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "transport/nic_affinity.h"

namespace mk::transport::detail {
namespace {

namespace fs = std::filesystem;

class FakeSysfs {
 public:
  FakeSysfs() {
    root_ = fs::temp_directory_path() /
            ("mk-sysfs-" + std::to_string(getpid()) + "-" + std::to_string(counter_++));
    fs::create_directories(root_ / "bus" / "pci" / "devices");
    fs::create_directories(root_ / "class" / "infiniband");
  }
  ~FakeSysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // A PCI function at devices/<path...>, NUMA node `numa`; returns its directory.
  fs::path add_pci(const std::vector<std::string>& path, int numa) {
    fs::path dir = root_ / "devices";
    for (const std::string& part : path) dir /= part;
    fs::create_directories(dir);
    std::ofstream(dir / "numa_node") << numa << "\n";
    fs::create_directory_symlink(dir, root_ / "bus" / "pci" / "devices" / path.back());
    return dir;
  }
  void add_nic(const std::string& name, const fs::path& pci_dir) {
    fs::create_directories(root_ / "class" / "infiniband" / name);
    fs::create_directory_symlink(pci_dir, root_ / "class" / "infiniband" / name / "device");
  }
  std::string root() const { return root_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path root_;
};

// Socket 0: root pci0000:00, switches under 0000:00:01.0 (GPU 0000:1b, NIC 0000:1a) and
// 0000:00:02.0 (GPU 0000:2b, NIC 0000:2a). Socket 1: root pci0000:80, one switch with GPU
// 0000:9b and two NICs 0000:9a, 0000:9c.
struct Host {
  FakeSysfs sys;
  Host() {
    sys.add_pci({"pci0000:00", "0000:00:01.0", "0000:10:00.0", "0000:1b:00.0"}, 0);
    sys.add_nic("mlx5_0",
                sys.add_pci({"pci0000:00", "0000:00:01.0", "0000:10:00.0", "0000:1a:00.0"}, 0));
    sys.add_pci({"pci0000:00", "0000:00:02.0", "0000:20:00.0", "0000:2b:00.0"}, 0);
    sys.add_nic("mlx5_1",
                sys.add_pci({"pci0000:00", "0000:00:02.0", "0000:20:00.0", "0000:2a:00.0"}, 0));
    sys.add_pci({"pci0000:80", "0000:80:01.0", "0000:90:00.0", "0000:9b:00.0"}, 1);
    sys.add_nic("mlx5_2",
                sys.add_pci({"pci0000:80", "0000:80:01.0", "0000:90:00.0", "0000:9a:00.0"}, 1));
    sys.add_nic("mlx5_3",
                sys.add_pci({"pci0000:80", "0000:80:01.0", "0000:90:00.0", "0000:9c:00.0"}, 1));
  }
  std::vector<std::optional<PciPlace>> nics() const {
    std::vector<std::optional<PciPlace>> out;
    for (const char* name : {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "efa_9"}) {
      out.push_back(pci_place_of_rdma_device(name, sys.root()));
    }
    return out;
  }
};

TEST(NicAffinity, PlacesComeFromSysfs) {
  Host host;
  // cudaDeviceGetPCIBusId's spelling (upper case) and NVML's (eight-digit domain) both resolve.
  for (const char* id : {"0000:1b:00.0", "0000:1B:00.0", "00000000:1B:00.0"}) {
    const auto gpu = pci_place_of_bus_id(id, host.sys.root());
    ASSERT_TRUE(gpu.has_value()) << id;
    EXPECT_EQ(gpu->path, (std::vector<std::string>{"pci0000:00", "0000:00:01.0", "0000:10:00.0",
                                                   "0000:1b:00.0"}));
    EXPECT_EQ(gpu->numa_node, 0);
  }
  const auto nic = pci_place_of_rdma_device("mlx5_2", host.sys.root());
  ASSERT_TRUE(nic.has_value());
  EXPECT_EQ(nic->path.back(), "0000:9a:00.0");
  EXPECT_EQ(nic->numa_node, 1);
  EXPECT_FALSE(pci_place_of_bus_id("0000:ff:00.0", host.sys.root()).has_value());
  EXPECT_FALSE(pci_place_of_rdma_device("efa_9", host.sys.root()).has_value());
  EXPECT_FALSE(pci_place_of_bus_id("", host.sys.root()).has_value());
}

TEST(NicAffinity, ClosestNicFirst) {
  Host host;
  const auto nics = host.nics();
  auto order_for = [&](const char* gpu, int spread) {
    return nic_order(pci_place_of_bus_id(gpu, host.sys.root()), nics, spread);
  };
  // GPU under switch 0000:10 -> its NIC, then the other switch of its socket, then socket 1;
  // the NIC without PCI information last.
  EXPECT_EQ(order_for("0000:1b:00.0", 0), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(order_for("0000:2b:00.0", 0), (std::vector<int>{1, 0, 2, 3, 4}));
  // Two NICs under the GPU's switch: `spread` (the local rank) takes them in turn; the rest of
  // the order stays.
  EXPECT_EQ(order_for("0000:9b:00.0", 0), (std::vector<int>{2, 3, 0, 1, 4}));
  EXPECT_EQ(order_for("0000:9b:00.0", 1), (std::vector<int>{3, 2, 1, 0, 4}));
  EXPECT_EQ(order_for("0000:9b:00.0", 2), (std::vector<int>{2, 3, 0, 1, 4}));
  // Unknown GPU place: the given order.
  EXPECT_EQ(nic_order(std::nullopt, nics, 3), (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(NicAffinity, ClosenessCountsSharedBridgesThenNuma) {
  PciPlace a{{"pci0000:00", "0000:00:01.0", "0000:10:00.0", "0000:1b:00.0"}, 0};
  PciPlace same_switch{{"pci0000:00", "0000:00:01.0", "0000:10:00.0", "0000:1a:00.0"}, 0};
  PciPlace same_root{{"pci0000:00", "0000:00:02.0", "0000:20:00.0", "0000:2a:00.0"}, 0};
  PciPlace other_socket{{"pci0000:80", "0000:80:01.0"}, 1};
  PciPlace other_root_same_numa{{"pci0000:40", "0000:40:01.0"}, 0};
  EXPECT_GT(pci_closeness(a, same_switch), pci_closeness(a, same_root));
  EXPECT_GT(pci_closeness(a, same_root), pci_closeness(a, other_root_same_numa));
  EXPECT_GT(pci_closeness(a, other_root_same_numa), pci_closeness(a, other_socket));
  EXPECT_EQ(pci_closeness(a, other_socket), 0);
  PciPlace unknown_numa = same_switch;
  unknown_numa.numa_node = -1;
  EXPECT_EQ(pci_closeness(a, unknown_numa), pci_closeness(a, same_switch) - 1);
}

}  // namespace
}  // namespace mk::transport::detail
