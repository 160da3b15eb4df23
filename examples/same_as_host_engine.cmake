# Runs offload_trainer (TRAINER) with ARGS on the CUDA engine and on the host engine and
# fails unless both succeed with the same master-weights digest (bit-identical training).
# FLAG_WAIT, when set, is passed as HOSTOPT_CUDA_FLAG_WAIT to the CUDA run.
# cmake -DTRAINER=... -DARGS="sync;60;2" [-DFLAG_WAIT=host_function] -P same_as_host_engine.cmake
foreach(engine cuda host)
  set(env HOSTOPT_EXAMPLE_ENGINE=${engine})
  if(engine STREQUAL "cuda" AND FLAG_WAIT)
    list(APPEND env HOSTOPT_CUDA_FLAG_WAIT=${FLAG_WAIT})
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${env} ${TRAINER} ${ARGS}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "offload_trainer on the ${engine} engine failed (${rc})")
  endif()
  if(NOT out MATCHES "on the ${engine} engine")
    message(FATAL_ERROR "offload_trainer did not run on the ${engine} engine")
  endif()
  if(NOT out MATCHES "master weights digest ([0-9a-f]+)")
    message(FATAL_ERROR "offload_trainer printed no digest")
  endif()
  set(digest_${engine} ${CMAKE_MATCH_1})
endforeach()
if(NOT digest_cuda STREQUAL digest_host)
  message(FATAL_ERROR "the CUDA engine's run differs from the host engine's: ${digest_cuda} vs ${digest_host}")
endif()
message("bit-identical on both engines: ${digest_cuda}")
