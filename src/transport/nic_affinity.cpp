// NIC choice by PCIe affinity (nic_affinity.h).
#include "transport/nic_affinity.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>

namespace mk::transport::detail {
namespace {

namespace fs = std::filesystem;

// "00000000:1B:00.0" -> "0000:1b:00.0" (sysfs spells domains with four digits, lower case).
std::string normalize_bus_id(std::string id) {
  std::transform(id.begin(), id.end(), id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const auto colon = id.find(':');
  if (colon != std::string::npos && colon > 4) id.erase(0, colon - 4);
  return id;
}

// The place of the device whose sysfs directory `link` resolves to.
std::optional<PciPlace> place_of(const fs::path& link, const std::string& sysfs) {
  std::error_code ec;
  const fs::path real = fs::canonical(link, ec);
  if (ec) return std::nullopt;
  const fs::path devices = fs::canonical(fs::path(sysfs) / "devices", ec);
  if (ec) return std::nullopt;
  const fs::path below = real.lexically_relative(devices);
  if (below.empty() || *below.begin() == "..") return std::nullopt;
  PciPlace place;
  for (const fs::path& part : below) place.path.push_back(part.string());
  std::ifstream numa(real / "numa_node");
  if (!(numa >> place.numa_node)) place.numa_node = -1;
  return place;
}

}  // namespace

std::optional<PciPlace> pci_place_of_bus_id(const std::string& bus_id, const std::string& sysfs) {
  if (bus_id.empty()) return std::nullopt;
  return place_of(fs::path(sysfs) / "bus" / "pci" / "devices" / normalize_bus_id(bus_id), sysfs);
}

std::optional<PciPlace> pci_place_of_rdma_device(const std::string& name,
                                                 const std::string& sysfs) {
  if (name.empty()) return std::nullopt;
  return place_of(fs::path(sysfs) / "class" / "infiniband" / name / "device", sysfs);
}

int pci_closeness(const PciPlace& a, const PciPlace& b) {
  std::size_t shared = 0;
  while (shared < a.path.size() && shared < b.path.size() && a.path[shared] == b.path[shared]) {
    ++shared;
  }
  const bool same_numa = a.numa_node >= 0 && a.numa_node == b.numa_node;
  return 2 * static_cast<int>(shared) + (same_numa ? 1 : 0);
}

std::vector<int> nic_order(const std::optional<PciPlace>& gpu,
                           const std::vector<std::optional<PciPlace>>& nics, int spread) {
  std::vector<int> order;
  if (!gpu) {
    for (int i = 0; i < static_cast<int>(nics.size()); ++i) order.push_back(i);
    return order;
  }
  // Closeness -> the NICs at it, in their given order; closest group first.
  std::map<int, std::vector<int>, std::greater<>> groups;
  std::vector<int> unknown;
  for (int i = 0; i < static_cast<int>(nics.size()); ++i) {
    if (nics[i]) {
      groups[pci_closeness(*gpu, *nics[i])].push_back(i);
    } else {
      unknown.push_back(i);
    }
  }
  for (auto& [closeness, members] : groups) {
    const int n = static_cast<int>(members.size());
    const int shift = ((spread % n) + n) % n;
    std::rotate(members.begin(), members.begin() + shift, members.end());
    order.insert(order.end(), members.begin(), members.end());
  }
  order.insert(order.end(), unknown.begin(), unknown.end());
  return order;
}

}  // namespace mk::transport::detail
