# Installs the build tree to a scratch prefix, then configures, builds and runs the
# consumer project against it (cmake -P script, run by ctest).
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${err}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${HOSTOPT_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}")
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
# The store's directory: under the build tree, a drive with O_DIRECT as the tests' are.
file(MAKE_DIRECTORY ${WORK_DIR}/store)
run(${WORK_DIR}/build/consumer_store ${WORK_DIR}/store)
