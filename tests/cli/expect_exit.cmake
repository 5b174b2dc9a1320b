# Runs a command and checks how it ends: `cmake -DCMD=prog;arg;... -DEXPECT_CODE=n
# [-DSTDERR_REGEX=re] [-DONE_LINE=ON] -P expect_exit.cmake`.
#
# Unlike add_test's WILL_FAIL, which passes on any failure, the exit code must be exactly
# EXPECT_CODE: a crash, an abort or a sanitizer report (exit code 1 only if the sanitizer is set
# up that way, and then its report on stderr breaks ONE_LINE and the pattern) fails the test.
# ONE_LINE=ON: stderr must be exactly one line (the tool's error format), with no stack dump.
cmake_minimum_required(VERSION 3.25)

if(NOT DEFINED CMD OR NOT DEFINED EXPECT_CODE)
  message(FATAL_ERROR "expect_exit.cmake: pass -DCMD=<program;args...> and -DEXPECT_CODE=<n>")
endif()

execute_process(COMMAND ${CMD}
                RESULT_VARIABLE code
                OUTPUT_VARIABLE out
                ERROR_VARIABLE err)

set(problems "")
if(NOT "${code}" STREQUAL "${EXPECT_CODE}")
  string(APPEND problems "exit code '${code}', expected ${EXPECT_CODE}\n")
endif()
if(DEFINED STDERR_REGEX AND NOT err MATCHES "${STDERR_REGEX}")
  string(APPEND problems "stderr does not match '${STDERR_REGEX}'\n")
endif()
if(ONE_LINE)
  string(REGEX REPLACE "\n$" "" trimmed "${err}")
  if(trimmed STREQUAL "" OR trimmed MATCHES "\n" OR NOT err MATCHES "\n$")
    string(APPEND problems "stderr is not exactly one line\n")
  endif()
endif()
if(err MATCHES "Sanitizer|runtime error:|terminate called|Aborted")
  string(APPEND problems "stderr has a crash or sanitizer report\n")
endif()

if(problems)
  string(REPLACE ";" " " shown "${CMD}")
  message(FATAL_ERROR "${shown}\n${problems}--- stderr ---\n${err}--- stdout ---\n${out}")
endif()
string(REPLACE ";" " " shown "${CMD}")
message(STATUS "ok: `${shown}` exited ${code}")
