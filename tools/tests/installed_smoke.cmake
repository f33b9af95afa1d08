# Installs the build tree into a scratch prefix and runs the installed programs' --help: they must
# find their shared libraries (llama.cpp's) without LD_LIBRARY_PATH.
# cmake -DBINARY_DIR=<build> -DPROGRAMS="infkv-stream;infkv-capture" -P installed_smoke.cmake
set(prefix ${BINARY_DIR}/installed_smoke)
file(REMOVE_RECURSE ${prefix})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix} OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
foreach(p IN LISTS PROGRAMS)
  execute_process(COMMAND ${prefix}/bin/${p} --help RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "installed ${p} --help exited ${rc}: ${err}")
  endif()
endforeach()
