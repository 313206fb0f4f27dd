# The layering of src/, enforced: every `#include "dir/..."` in a file under
# src/<layer>/ must name the same layer or one the rules below allow. Run by
# every library target (CMakeLists.txt: flashmoe_check_layers), so a wrong
# include fails `cmake --build`; by hand:
#   cmake -DSRC=src -P scripts/check_layers.cmake
#
# Order: core -> format -> tokenizer, kv, experts -> model -> backend/cpu,
# backend/cuda -> runtime -> engine -> server -> cli. Includes that name no
# layer (a file beside the includer, "test_util.h") are not checked.

cmake_minimum_required(VERSION 3.22)

if(NOT SRC)
  set(SRC "${CMAKE_CURRENT_LIST_DIR}/../src")
endif()
get_filename_component(SRC "${SRC}" ABSOLUTE)

set(LAYERS core format tokenizer kv experts model backend/cpu backend/cuda runtime engine server cli)

# What each layer may include besides itself.
set(ALLOW_core)
set(ALLOW_format core)
set(ALLOW_tokenizer core format)  # format: a GGUF file carries its tokenizer
set(ALLOW_kv core format)
set(ALLOW_experts core format)
set(ALLOW_model core format kv experts)
set(ALLOW_backend/cpu core format kv experts model)
set(ALLOW_backend/cuda core format kv experts model)
set(ALLOW_runtime core format tokenizer kv experts model backend/cpu backend/cuda)
set(ALLOW_engine core format tokenizer kv experts model runtime)
set(ALLOW_server ${ALLOW_engine} engine)
set(ALLOW_cli ${ALLOW_server} server)

# TEMPORARY exceptions, "<layer>|<regex over the included path>". Each goes
# when its move is done; the check says when one no longer matches anything.
set(EXCEPTIONS)

function(layer_of path out)  # "backend/cuda/x.cu" -> backend/cuda, "kv/a.h" -> kv, "x.h" -> ""
  string(REGEX MATCH "^(backend/[^/]+|[^/]+)/" m "${path}")
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE files RELATIVE "${SRC}" "${SRC}/*.h" "${SRC}/*.hpp" "${SRC}/*.cpp" "${SRC}/*.cc"
     "${SRC}/*.cu" "${SRC}/*.cuh" "${SRC}/*.inc")
list(SORT files)
if(NOT files)
  message(FATAL_ERROR "check_layers: no sources under ${SRC}")
endif()
set(errors "")
set(used "")
foreach(f ${files})
  layer_of("${f}" layer)
  if(NOT layer OR NOT layer IN_LIST LAYERS)
    string(APPEND errors "  src/${f}: src/${layer} is not a layer the checker knows; add it to LAYERS and the rules in scripts/check_layers.cmake\n")
    continue()
  endif()
  file(STRINGS "${SRC}/${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line ${lines})
    if(NOT line MATCHES "#[ \t]*include[ \t]*\"([^\"]+)\"")
      continue()
    endif()
    set(inc "${CMAKE_MATCH_1}")
    layer_of("${inc}" target)
    if(NOT target OR NOT target IN_LIST LAYERS OR target STREQUAL layer OR target IN_LIST ALLOW_${layer})
      continue()
    endif()
    set(excepted FALSE)
    foreach(e ${EXCEPTIONS})
      string(REPLACE "|" ";" e_parts "${e}")
      list(GET e_parts 0 e_layer)
      list(GET e_parts 1 e_regex)
      if(e_layer STREQUAL layer AND inc MATCHES "^${e_regex}$")
        set(excepted TRUE)
        list(APPEND used "${e}")
      endif()
    endforeach()
    if(excepted)
      continue()
    endif()
    string(REPLACE ";" ", " allowed "${ALLOW_${layer}}")
    if(NOT allowed)
      set(allowed "nothing outside itself")
    endif()
    string(APPEND errors "  src/${f}: #include \"${inc}\": ${layer} may not include ${target} (${layer} may include ${allowed})\n")
  endforeach()
endforeach()

foreach(e ${EXCEPTIONS})
  if(NOT e IN_LIST used)
    message(STATUS "check_layers: the temporary exception \"${e}\" matches no include any more; delete it from scripts/check_layers.cmake")
  endif()
endforeach()

if(errors)
  message(FATAL_ERROR "Layering violations (rules in scripts/check_layers.cmake):\n${errors}")
endif()
