# Controller tests: config validation, the daemon end to end on the simulated
# driver, and the status CLI. Included from tests/CMakeLists.txt after
# add_subdirectory(simcuda) (GTest and GoogleTest are already loaded there).

add_executable(controller_config_test controller_config_test.cpp)
target_link_libraries(controller_config_test PRIVATE fracgpu_controller GTest::gtest_main)
# The shipped example config is tested too, so it cannot rot.
target_compile_definitions(controller_config_test PRIVATE FRACGPU_EXAMPLES_DIR="${PROJECT_SOURCE_DIR}/examples")
gtest_discover_tests(controller_config_test DISCOVERY_TIMEOUT 30)

# The control API without a daemon: SPEC checks, the one book, the API
# tenants' file, a config read beside API tenants, socket access rules.
add_executable(control_api_test control_api_test.cpp)
target_link_libraries(control_api_test PRIVATE fracgpu_controller GTest::gtest_main)
gtest_discover_tests(control_api_test DISCOVERY_TIMEOUT 30)

# The daemon and CLI tests run the real binaries against temporary run dirs;
# fracgpud finds GPUs through simcuda's libcuda.so.1 (LD_LIBRARY_PATH).
foreach(name controller_daemon_test controller_cli_test)
  add_executable(${name} ${name}.cpp)
  target_link_libraries(${name} PRIVATE fracgpu_controller GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE
    FRACGPUD_PATH="$<TARGET_FILE:fracgpud>"
    FRACGPU_CLI_PATH="$<TARGET_FILE:fracgpu_cli>"
    SIMCUDA_DIR="$<TARGET_FILE_DIR:simcuda>")
  add_dependencies(${name} fracgpud fracgpu_cli simcuda)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 30 PROPERTIES TIMEOUT 120)
endforeach()

# `fracgpu status --watch` and `fracgpu top` in a real terminal: tmux, with
# fracgpud on the simulated driver and loads under the interposer (about
# 25 s); skipped (77) where tmux is not installed.
add_test(NAME cli_watch_tmux
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_watch_tmux_test.sh $<TARGET_FILE:fracgpu_cli>
                 $<TARGET_FILE:fracgpud> $<TARGET_FILE_DIR:simcuda> $<TARGET_FILE_DIR:simnvml>
                 $<TARGET_FILE:fracgpu> $<TARGET_FILE:gputime_load>)
set_tests_properties(cli_watch_tmux PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120)

# NVML discovery, GPU health and the bypass audit, against the stand-in NVML
# (tests/simnvml) sharing one simulated driver state with fracgpud and the
# probes. And the control API end to end: fracgpud on the simulated driver
# and NVML, spoken to by root and unprivileged peers, tenant processes
# through the interposer, `fracgpu tenant`.
foreach(name controller_nvml_test controller_control_test)
  add_executable(${name} ${name}.cpp)
  target_link_libraries(${name} PRIVATE fracgpu_controller GTest::gtest_main Threads::Threads)
  target_compile_definitions(${name} PRIVATE
    FRACGPUD_PATH="$<TARGET_FILE:fracgpud>"
    FRACGPU_CLI_PATH="$<TARGET_FILE:fracgpu_cli>"
    FRACGPU_LIB="$<TARGET_FILE:fracgpu>"
    PROBE_PATH="$<TARGET_FILE:fracgpu_probe>"
    SIMCUDA_DIR="$<TARGET_FILE_DIR:simcuda>"
    SIMNVML_DIR="$<TARGET_FILE_DIR:simnvml>"
    LOAD_PATH="$<TARGET_FILE:gputime_load>")
  add_dependencies(${name} fracgpud fracgpu_cli fracgpu fracgpu_probe simcuda simnvml gputime_load)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 30 PROPERTIES TIMEOUT 120)
endforeach()

# Placement policies and the [daemon] keys of node operations (no daemon).
add_executable(controller_placement_test controller_placement_test.cpp)
target_link_libraries(controller_placement_test PRIVATE fracgpu_controller GTest::gtest_main)
gtest_discover_tests(controller_placement_test DISCOVERY_TIMEOUT 30)

# Metrics scraped over loopback with a real tenant process (the probe under
# the interposer), and placement kept across restarts and reloads.
add_executable(controller_ops_test controller_ops_test.cpp)
target_link_libraries(controller_ops_test PRIVATE fracgpu_controller GTest::gtest_main)
target_compile_definitions(controller_ops_test PRIVATE
  FRACGPUD_PATH="$<TARGET_FILE:fracgpud>"
  FRACGPU_CLI_PATH="$<TARGET_FILE:fracgpu_cli>"
  FRACGPU_LIB="$<TARGET_FILE:fracgpu>"
  PROBE_PATH="$<TARGET_FILE:fracgpu_probe>"
  SIMCUDA_DIR="$<TARGET_FILE_DIR:simcuda>")
add_dependencies(controller_ops_test fracgpud fracgpu_cli fracgpu fracgpu_probe simcuda)
gtest_discover_tests(controller_ops_test DISCOVERY_TIMEOUT 30 PROPERTIES TIMEOUT 120)

# deploy/grafana's dashboard queries only metrics and labels fracgpud serves:
# a daemon on the simulated driver and the stand-in NVML, scraped, against
# every PromQL expression of the dashboard (and broken copies of it, which
# must be reported). A few seconds.
add_test(NAME grafana_dashboard
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/check_dashboard.py --source ${PROJECT_SOURCE_DIR}
                 --fracgpud $<TARGET_FILE:fracgpud> --simcuda $<TARGET_FILE_DIR:simcuda>
                 --simnvml $<TARGET_FILE_DIR:simnvml>)
set_tests_properties(grafana_dashboard PROPERTIES TIMEOUT 60)

# `cmake --install` layout, the installed daemon and CLI, and the container
# recipes (docs/containers.md, examples/k8s) checked against that install.
add_test(NAME install_layout_and_recipes
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install_test.sh ${CMAKE_BINARY_DIR} ${PROJECT_SOURCE_DIR}
                 $<TARGET_FILE_DIR:simcuda>)
set_tests_properties(install_layout_and_recipes PROPERTIES TIMEOUT 120)

# The config loader against hostile files and a few hundred seeded mutations
# of the example configs, in-process and through fracgpud --check.
add_executable(config_fuzz_test config_fuzz_test.cpp)
target_link_libraries(config_fuzz_test PRIVATE fracgpu_controller GTest::gtest_main Threads::Threads)
target_compile_definitions(config_fuzz_test PRIVATE
  FRACGPU_EXAMPLES_DIR="${PROJECT_SOURCE_DIR}/examples"
  FRACGPUD_PATH="$<TARGET_FILE:fracgpud>"
  SIMCUDA_DIR="$<TARGET_FILE_DIR:simcuda>")
add_dependencies(config_fuzz_test fracgpud simcuda)
gtest_discover_tests(config_fuzz_test DISCOVERY_TIMEOUT 30 PROPERTIES TIMEOUT 240)

# The same in-process cases with the config sources compiled under
# AddressSanitizer and UBSan, as ledger_test_tsan does for the ledger: no
# separate sanitizer build needed. toml++'s parser is compiled in too
# (header-only mode), so the sanitizers watch it as well, not only our code;
# the rest of the controller library links in uninstrumented. fracgpud --check
# is not run from here (the plain build covers it).
set(FRACGPU_CONFIG_SOURCES
  ${PROJECT_SOURCE_DIR}/controller/config/config.cpp
  ${PROJECT_SOURCE_DIR}/controller/config/config_file.cpp
  ${PROJECT_SOURCE_DIR}/controller/config/placement.cpp
  ${PROJECT_SOURCE_DIR}/controller/config/tenant_rules.cpp
  ${PROJECT_SOURCE_DIR}/controller/config/api_tenant.cpp
  ${PROJECT_SOURCE_DIR}/controller/common/units.cpp
  ${PROJECT_SOURCE_DIR}/controller/common/uuid.cpp)
add_executable(config_fuzz_test_asan config_fuzz_test.cpp ${FRACGPU_CONFIG_SOURCES})
target_include_directories(config_fuzz_test_asan PRIVATE
  $<TARGET_PROPERTY:tomlplusplus::tomlplusplus,INTERFACE_INCLUDE_DIRECTORIES>)
target_compile_definitions(config_fuzz_test_asan PRIVATE TOML_HEADER_ONLY=1
  FRACGPU_EXAMPLES_DIR="${PROJECT_SOURCE_DIR}/examples")
target_compile_options(config_fuzz_test_asan PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all
                       -fno-omit-frame-pointer -O1 -g)
target_link_options(config_fuzz_test_asan PRIVATE -fsanitize=address,undefined)
target_link_libraries(config_fuzz_test_asan PRIVATE fracgpu_controller GTest::gtest_main Threads::Threads)
# Leak checking is off: LeakSanitizer needs ptrace, which some CI containers
# refuse, and what this test is after is crashes, overflows and UB.
add_test(NAME config_fuzz_test_asan COMMAND config_fuzz_test_asan)
set_tests_properties(config_fuzz_test_asan PROPERTIES TIMEOUT 300
                     ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0;UBSAN_OPTIONS=print_stacktrace=1")

# fracgpud SIGKILLed at random instants of 100 reloads and starts: every
# tenant sees the whole old policy or the whole new one (about 20 s).
add_executable(reload_kill_test reload_kill_test.cpp)
target_link_libraries(reload_kill_test PRIVATE fracgpu_controller GTest::gtest_main)
target_compile_definitions(reload_kill_test PRIVATE
  FRACGPUD_PATH="$<TARGET_FILE:fracgpud>"
  SIMCUDA_DIR="$<TARGET_FILE_DIR:simcuda>")
add_dependencies(reload_kill_test fracgpud simcuda)
gtest_discover_tests(reload_kill_test DISCOVERY_TIMEOUT 30 PROPERTIES TIMEOUT 180)

# `fracgpud --version` names the release (what an admin checks in the image).
add_test(NAME fracgpud_version COMMAND $<TARGET_FILE:fracgpud> --version)
set_tests_properties(fracgpud_version PROPERTIES PASS_REGULAR_EXPRESSION "^fracgpud ${PROJECT_VERSION}\n$")
