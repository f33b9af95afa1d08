# infkv_skipped_test(NAME <test> REASON <text>): a test that cannot run in this configuration,
# registered anyway so that ctest reports it as skipped (exit 77, SKIP_RETURN_CODE) and prints its
# reason, instead of leaving it out without a word. scripts/test.sh fails under CI=true when one
# of these was skipped on a machine where the scripts install what it needs. The reason must not
# hold a single quote.
function(infkv_skipped_test)
  cmake_parse_arguments(arg "" "NAME;REASON" "" ${ARGN})
  add_test(NAME ${arg_NAME} COMMAND sh -c "echo 'skipped: ${arg_REASON}'; exit 77")
  set_tests_properties(${arg_NAME} PROPERTIES SKIP_RETURN_CODE 77 LABELS skipped_gate)
endfunction()
