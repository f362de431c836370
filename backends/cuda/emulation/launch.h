// Launch entry points of the emulation: for each kernel, `emu_<name>` runs it over a grid with
// its parameters passed as cuLaunchKernel passes them (an array of pointers to each value), and
// `emu_params_<name>` reports its parameter sizes so the caller's packing is checked.

#pragma once

#include <cstddef>
#include <utility>

namespace npu_emu {

int run_grid(const unsigned* g, const unsigned* b, unsigned smem, void (*body)(void*), void* arg,
             char* err, size_t err_len);

template <class... A> struct Call {
    void (*kernel)(A...);
    void** params;
};

template <class... A, size_t... I> void invoke(Call<A...>* c, std::index_sequence<I...>) {
    c->kernel(*static_cast<A*>(c->params[I])...);
}

template <class... A> void body(void* arg) {
    invoke(static_cast<Call<A...>*>(arg), std::index_sequence_for<A...>{});
}

template <class... A>
int launch(void (*kernel)(A...), const unsigned* g, const unsigned* b, unsigned smem,
           void** params, char* err, size_t err_len) {
    Call<A...> c{kernel, params};
    return run_grid(g, b, smem, &body<A...>, &c, err, err_len);
}

template <class... A> int param_sizes(void (*)(A...), unsigned* out, int cap) {
    const unsigned sizes[] = {0u, (unsigned)sizeof(A)...};
    const int n = (int)sizeof...(A);
    for (int i = 0; i < n && i < cap; ++i) {
        out[i] = sizes[i + 1];
    }
    return n;
}

} // namespace npu_emu

#define NPU_EMU_KERNEL(name)                                                                       \
    extern "C" int emu_##name(const unsigned* g, const unsigned* b, unsigned smem, void** p,      \
                              char* err, size_t err_len) {                                         \
        return npu_emu::launch(name, g, b, smem, p, err, err_len);                                \
    }                                                                                              \
    extern "C" int emu_params_##name(unsigned* out, int cap) {                                     \
        return npu_emu::param_sizes(name, out, cap);                                               \
    }
