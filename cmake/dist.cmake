# attn::dist: exact attention over a sequence split across MPI ranks (include/attn/dist.hpp).
# ATTN_WITH_MPI: AUTO builds it when CMake finds MPI, ON requires MPI (CI), OFF never builds it.
set(ATTN_WITH_MPI AUTO CACHE STRING "Build attn::dist (ring attention over MPI): AUTO, ON or OFF")
set(ATTN_HAVE_DIST OFF)
if(NOT ATTN_WITH_MPI STREQUAL "OFF")
  if(ATTN_WITH_MPI STREQUAL "AUTO")
    find_package(MPI QUIET COMPONENTS CXX)
  else()
    find_package(MPI REQUIRED COMPONENTS CXX)
  endif()
  if(MPI_CXX_FOUND)
    set(ATTN_HAVE_DIST ON)
  endif()
endif()
message(STATUS "attn::dist (MPI): ${ATTN_HAVE_DIST}")
if(NOT ATTN_HAVE_DIST)
  return()
endif()

add_library(attn_dist src/dist/comm.cpp src/dist/layout.cpp src/dist/ring_common.cpp
                      src/dist/ring_attention.cpp src/dist/ulysses_attention.cpp)
add_library(attn::dist ALIAS attn_dist)
target_link_libraries(attn_dist PUBLIC attn::attn MPI::MPI_CXX)
target_include_directories(attn_dist PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
target_compile_options(attn_dist PRIVATE -Wall -Wextra -Wpedantic)

# Launching as root (CI, containers) and more ranks than cores must both be allowed; Open MPI
# reads these, other MPIs ignore them.
set(ATTN_MPI_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none)

if(ATTN_BUILD_TESTS)
  add_executable(attn_dist_tests tests/dist/main.cpp tests/dist/test_ring.cpp tests/dist/test_layout.cpp)
  target_link_libraries(attn_dist_tests PRIVATE attn_dist GTest::gtest)
  target_include_directories(attn_dist_tests PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/tests)
  # The same suite on 1 to 4 ranks of this machine (oversubscribed), each rank one thread.
  foreach(np 1 2 3 4)
    add_test(NAME Dist.RingAttention.ranks${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} $<TARGET_FILE:attn_dist_tests>)
    set_tests_properties(Dist.RingAttention.ranks${np} PROPERTIES
      ENVIRONMENT "${ATTN_MPI_ENV};OMP_NUM_THREADS=1" TIMEOUT 600 RUN_SERIAL TRUE LABELS dist)
  endforeach()
  # A peer that stalls: the other rank ends with CommError within its timeout (2 ranks, ~8 s).
  add_test(NAME Dist.StalledPeerTimesOut
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:attn_dist_tests>
                   --gtest_also_run_disabled_tests --gtest_filter=DistStall.*)
  # A peer that dies: mpirun must end (non-zero) rather than hang (124: `timeout` stopped it).
  add_test(NAME Dist.DeadPeerEndsTheJob
           COMMAND sh -c "timeout 120 \"$0\" -np 2 \"$1\" --gtest_also_run_disabled_tests --gtest_filter=DistFaults.*; rc=$?; echo \"mpirun exit code $rc\"; [ $rc -ne 0 ] && [ $rc -ne 124 ]"
                   ${MPIEXEC_EXECUTABLE} $<TARGET_FILE:attn_dist_tests>)
  # Ranks in separate network namespaces, over a real (rate-limited) TCP path; needs root and
  # iproute2, else skipped with the reason printed (exit 77).
  add_test(NAME Dist.RingAttention.netns3
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/scripts/mpirun_netns.sh --rate 1gbit --launch-timeout 60 -np 3 --
                   $<TARGET_FILE:attn_dist_tests>)
  set_tests_properties(Dist.StalledPeerTimesOut Dist.DeadPeerEndsTheJob Dist.RingAttention.netns3 PROPERTIES
    ENVIRONMENT "${ATTN_MPI_ENV};OMP_NUM_THREADS=1" TIMEOUT 600 RUN_SERIAL TRUE LABELS dist SKIP_RETURN_CODE 77)
endif()

if(ATTN_BUILD_CLI)
  target_sources(attn_cli PRIVATE cli/ring.cpp)
  target_link_libraries(attn_cli PRIVATE attn_dist)
  target_compile_definitions(attn_cli PRIVATE ATTN_HAVE_DIST=1)
  if(ATTN_BUILD_TESTS)
    # `attn ring --check` on 3 ranks: the ring against the single-process kernel and float64.
    add_test(NAME Cli.RingCheck
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 3 $<TARGET_FILE:attn_cli> ring --seq 67 --heads 4
                     --kv-heads 2 --dim 16 --causal --dtype bf16 --repeats 1 --check)
    set_tests_properties(Cli.RingCheck PROPERTIES ENVIRONMENT "${ATTN_MPI_ENV};OMP_NUM_THREADS=1" TIMEOUT 300
      RUN_SERIAL TRUE LABELS dist PASS_REGULAR_EXPRESSION "grad_value .* ok")
  endif()
endif()
