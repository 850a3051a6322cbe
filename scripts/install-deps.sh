#!/usr/bin/env bash
# Installs the Debian packages fracgpu builds and tests with (as root; the CUDA toolkit
# is expected at /usr/local/cuda). Does nothing when all are present.
#
#   bash scripts/install-deps.sh           # everything the full build and the test suite need
#   bash scripts/install-deps.sh --demo    # only what examples/demo.sh builds and runs: the
#                                          # daemon, the CLI, the interposer, the simulated driver
#                                          # and NVML, the demo's workloads (no recommends)
set -euo pipefail
demo=0
case ${1:-} in
  "") ;;
  --demo) demo=1 ;;
  *) echo "install-deps: unknown argument $1 (--demo, or none)" >&2; exit 2 ;;
esac
# The demo's: compiler and CMake; fmt, spdlog, toml++, CLI11 and nlohmann-json for
# the daemon and the CLI; python3 for bench/e2e/e2e.py, which reports GPU time.
packages=(cmake g++ make libfmt-dev libspdlog-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev python3)
apt_options=(--no-install-recommends)
if ((demo == 0)); then
  # The rest of the build (pkg-config, GoogleTest, Google Benchmark; libcurl,
  # yaml-cpp, gRPC and protobuf for the Kubernetes parts) and the tests (strace,
  # PyYAML, jsonschema, podman, runc and busybox for containers, openssl,
  # debootstrap, tmux).
  packages+=(pkg-config libgtest-dev libgmock-dev libbenchmark-dev strace python3-yaml
             podman runc busybox-static libcurl4-openssl-dev libyaml-cpp-dev openssl
             libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc python3-jsonschema
             debootstrap tmux python3-pip)
  apt_options=()
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq ${apt_options[@]+"${apt_options[@]}"} "${missing[@]}"
fi
if [ ! -f /usr/local/cuda/include/cuda.h ]; then
  echo "the CUDA toolkit is expected at /usr/local/cuda (cuda.h not found)" >&2
  exit 1
fi
if ((demo)); then exit 0; fi
# The Kubernetes manifests are validated against the 1.36 schemas that this
# release of kubernetes-validate carries (tests/k8s_manifests/). Without it
# that test is skipped, not failed: warn, do not stop the build. Debian's own
# Python refuses installs from PyPI into it (PEP 668, "externally managed"):
# there it goes into a directory of its own, which the test adds to its path.
kubernetes_validate_version=1.37.0
kubernetes_validate=kubernetes-validate==$kubernetes_validate_version
kubernetes_validate_dir=/usr/local/lib/fracgpu-tests/python
if [ "$(PYTHONPATH=$kubernetes_validate_dir python3 -c \
        'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" \
     != "$kubernetes_validate_version" ]; then
  echo "installing: $kubernetes_validate (PyPI)"
  pip=(python3 -m pip install --quiet --root-user-action=ignore)
  "${pip[@]}" "$kubernetes_validate" 2>/dev/null ||
    "${pip[@]}" --upgrade --target "$kubernetes_validate_dir" "$kubernetes_validate" ||
    echo "warning: could not install $kubernetes_validate: the manifest schema test will be skipped" >&2
fi
