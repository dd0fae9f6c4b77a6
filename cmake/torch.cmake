# Finds the torch that the running interpreter imports, so the extension is
# built against exactly the libtorch it will be loaded with.
find_package(Python REQUIRED COMPONENTS Interpreter ${KVCHAT_PYTHON_COMPONENTS})

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
  OUTPUT_VARIABLE _kvchat_torch_out
  RESULT_VARIABLE _kvchat_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _kvchat_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "kvchat builds against the installed torch, but '${Python_EXECUTABLE}' cannot import it.\n"
    "Install torch first (pip install torch==2.13.0), then: "
    "pip install --no-build-isolation .")
endif()
string(REPLACE "\n" ";" _kvchat_torch_out "${_kvchat_torch_out}")
list(GET _kvchat_torch_out 0 _kvchat_torch_prefix)
list(GET _kvchat_torch_out 1 KVCHAT_TORCH_VERSION)
list(APPEND CMAKE_PREFIX_PATH "${_kvchat_torch_prefix}")
find_package(Torch REQUIRED)
message(STATUS "kvchat: building against torch ${KVCHAT_TORCH_VERSION}")

# pybind11's tensor casters live in libtorch_python, which find_package(Torch)
# does not export.
find_library(KVCHAT_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib"
             NO_DEFAULT_PATH)

# Torch's ABI flags (_GLIBCXX_USE_CXX11_ABI) must match on every target that
# shares std::string or std::vector with libtorch, GoogleTest included.
separate_arguments(KVCHAT_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
function(kvchat_use_torch target)
  target_compile_options(${target} PRIVATE ${KVCHAT_TORCH_CXX_FLAGS})
  target_include_directories(${target} SYSTEM PRIVATE ${TORCH_INCLUDE_DIRS})
  target_link_libraries(${target} PRIVATE ${TORCH_LIBRARIES})
endfunction()
