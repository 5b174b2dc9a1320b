# Run by CTest after gtest_discover_tests' include file, which lists attn_tests' tests in
# attn_tests_TESTS (a parameterised test's name goes on with "  # GetParam() = ..."): the sweep
# cases whose names end in "_large" get the label "heavy", so that `ctest -LE heavy` (the
# sanitizer runs, scripts/sanitize.sh) leaves them to the optimised build.
foreach(test_name IN LISTS attn_tests_TESTS)
  if(test_name MATCHES "^[^ ]*_large( |$)")
    set_tests_properties("${test_name}" PROPERTIES LABELS heavy)
  endif()
endforeach()
