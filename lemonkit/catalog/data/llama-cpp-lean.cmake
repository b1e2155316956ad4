# Included by llama-cpp-python's CMake project (CMAKE_PROJECT_llama_cpp_INCLUDE): leaves out what the Python package
# never loads. llama-cpp-python forces LLAMA_BUILD_COMMON on (as a cache entry), but its wheel ships only libllama,
# libggml* and libmtmd; llama.cpp's common library (argument parsing, chat parsers, its HTTP client) and the
# cpp-httplib it links were 41% of the build's compile time on 2 cores. A normal variable outranks the cache entry
# (policy CMP0126), so this turns them off without patching the sdist. Vision (mtmd) and every model
# architecture stay.
set(LLAMA_BUILD_COMMON OFF)
