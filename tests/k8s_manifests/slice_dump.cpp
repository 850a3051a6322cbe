// Prints the ResourceSlice the kubelet plugin would publish for a node, from
// the control API's NODE object in a file (argv[1]): the plugin's own
// build_resource_slice, so check_manifests.py books the examples' claims on
// exactly what the plugin publishes, requestPolicy included.
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kube/resource_slice.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " NODE.json\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  nlohmann::json node = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!in || node.is_discarded()) {
    std::cerr << argv[1] << ": not a JSON NODE object\n";
    return 2;
  }
  std::vector<std::string> left_out;
  nlohmann::json slice = fracgpu::kube::build_resource_slice("node-a", node, 1, {}, &left_out);
  for (const auto& why : left_out) std::cerr << "left out: " << why << "\n";
  std::cout << slice.dump(2) << "\n";
  return 0;
}
