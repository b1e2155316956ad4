# Included by llama-cpp-python's CMake project (CMAKE_PROJECT_llama_cpp_INCLUDE): leaves out what the Python package
# never loads. llama-cpp-python forces LLAMA_BUILD_COMMON on (as a cache entry), but its wheel ships only libllama,
# libggml* and libmtmd; llama.cpp's common library (argument parsing, chat parsers, its HTTP client) and the
# cpp-httplib it links were 41% of the build's compile time on 2 cores. A normal variable outranks the cache entry
# (policy CMP0126), so this turns them off without patching the sdist. Vision (mtmd) and every model
# architecture stay.
set(LLAMA_BUILD_COMMON OFF)

# Batch-invariant flash attention for ggml's CPU reference mode (the mode lemonkit switches on for batch invariance):
# lemonkit-invariant-fa.inc is copied next to ggml-cpu's ops.cpp and #included there, and the flash-attention entry
# calls it first when use_ref is set. The anchor is the exact text of the llama.cpp that llama-cpp-python 0.3.36
# vendors; any other text leaves the source as it is (the build then has plain reference attention, and no
# lemonkit_invariant_fa_version symbol for lemonkit to find).
set(_lemonkit_fa_dir "${CMAKE_CURRENT_SOURCE_DIR}/vendor/llama.cpp/ggml/src/ggml-cpu")
set(_lemonkit_fa_ops "${_lemonkit_fa_dir}/ops.cpp")
set(_lemonkit_fa_anchor "static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
")
# The copy starts with the SHA-256 of the .inc it was made from, which the build exports (lemonkit_invariant_fa_source):
# lemonkit compares it with its own .inc to tell a wheel built from an older kernel (pip's wheel cache keys on the
# sdist, not on CMAKE_ARGS or this file, so it can hand one back).
set(_lemonkit_fa_inc "${CMAKE_CURRENT_LIST_DIR}/lemonkit-invariant-fa.inc")
if(NOT EXISTS "${_lemonkit_fa_inc}")
    message(WARNING "lemonkit: lemonkit-invariant-fa.inc is missing; flash attention left unpatched")
elseif(EXISTS "${_lemonkit_fa_ops}")
    file(READ "${_lemonkit_fa_ops}" _lemonkit_fa_src)
    string(FIND "${_lemonkit_fa_src}" "lemonkit-invariant-fa.inc" _lemonkit_fa_done)
    string(FIND "${_lemonkit_fa_src}" "${_lemonkit_fa_anchor}" _lemonkit_fa_at)
    file(SHA256 "${_lemonkit_fa_inc}" _lemonkit_fa_sha256)
    file(READ "${_lemonkit_fa_inc}" _lemonkit_fa_code)
    set(_lemonkit_fa_copy "#define LK_FA_SOURCE_SHA256 \"${_lemonkit_fa_sha256}\"\n${_lemonkit_fa_code}")
    if(NOT _lemonkit_fa_done EQUAL -1)
        file(WRITE "${_lemonkit_fa_dir}/lemonkit-invariant-fa.inc" "${_lemonkit_fa_copy}")
        message(STATUS "lemonkit: ggml-cpu flash attention already patched")
    elseif(_lemonkit_fa_at EQUAL -1)
        message(WARNING "lemonkit: ggml-cpu/ops.cpp is not the expected llama.cpp; flash attention left unpatched")
    else()
        file(WRITE "${_lemonkit_fa_dir}/lemonkit-invariant-fa.inc" "${_lemonkit_fa_copy}")
        string(REPLACE "${_lemonkit_fa_anchor}" "#include \"lemonkit-invariant-fa.inc\"

${_lemonkit_fa_anchor}    if (params->use_ref && lk_fa_invariant(params, dst)) { return; }
" _lemonkit_fa_src "${_lemonkit_fa_src}")
        file(WRITE "${_lemonkit_fa_ops}" "${_lemonkit_fa_src}")
        message(STATUS "lemonkit: ggml-cpu flash attention patched for batch invariance")
    endif()
endif()
