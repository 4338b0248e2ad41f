"""CuPy's ``RawModule`` for the host: CUDA source compiled by g++ and launched on the CPU.

``RawModule(code=..., options=..., name_expressions=...)`` and ``get_function(expression)`` are
the calls :mod:`pacmpi.kernels.gpu` makes on CuPy. ``code`` is compiled exactly as given, after
:data:`HEADER`, which maps CUDA's built-ins to host code and nothing else: none of the kernels'
arithmetic is written here. A function called as ``kernel(grid, block, args)`` runs the whole
grid it is given: blocks one after another, each block's threads as cooperative fibers
(``ucontext``) on the calling thread. ``__shfl_down_sync`` is a real exchange between the 32
lanes of a warp (each lane waits at a per-warp barrier until every lane has posted its value);
a warp that cannot complete a shuffle (a lane exited, a partial warp) is an error, where a GPU
would hang or read garbage. ``atomicMax`` is an atomic compare-and-swap loop.

Arguments are passed as CuPy passes them: device arrays (``host_cupy``'s, an ``ndarray``
subclass; a plain NumPy array is host memory and refused, as CuPy refuses it) as data pointers,
NumPy scalars as their bytes. C++ deduces each kernel's parameter types from the instantiation
and every argument is checked against them (kind and size), so a scalar of the wrong C type is
an error here, not garbage on a GPU. Builds are cached by a hash of everything that goes into
them, in the temp directory.
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["RawModule", "HEADER", "compiler"]

HEADER = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 { unsigned x, y, z; };
typedef dim3 uint3;

static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline long long __double_as_longlong(double d) {
    long long u; std::memcpy(&u, &d, 8); return u;
}
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {}
    return old;
}
using std::fabs; using std::max; using std::min;

namespace host_cuda {
const unsigned WARP = 32;
const size_t STACK = 64 << 10;  // per thread; the kernels' frames take a few hundred bytes

struct Lane { ucontext_t context; dim3 index; unsigned shuffles; bool done; };
struct Warp { unsigned long long posted[2][WARP]; unsigned arrived[2], read[2]; };
struct Block {
    dim3 grid, dim, index;
    std::vector<Lane> lanes;
    std::vector<Warp> warps;
    std::vector<char> stacks;
    ucontext_t scheduler;
    Lane* lane;
    void (*body)(void*);
    void* closure;
    std::string error;
};
thread_local Block block;

inline void fail(const std::string& message) {  // stop this block for good
    if (block.error.empty()) block.error = message;
    block.lane->done = true;
    setcontext(&block.scheduler);
}

inline void run_lane() {
    block.body(block.closure);
    block.lane->done = true;  // uc_link returns to the scheduler
}

// Runs every thread of the current block, round robin, until all have returned.
inline void run_block() {
    size_t threads = block.lanes.size();
    for (size_t t = 0; t < threads; ++t) {
        Lane& lane = block.lanes[t];
        lane.index = {unsigned(t % block.dim.x), unsigned(t / block.dim.x % block.dim.y),
                      unsigned(t / block.dim.x / block.dim.y)};
        lane.shuffles = 0;
        lane.done = false;
        getcontext(&lane.context);
        lane.context.uc_stack.ss_sp = &block.stacks[t * STACK];
        lane.context.uc_stack.ss_size = STACK;
        lane.context.uc_link = &block.scheduler;
        makecontext(&lane.context, run_lane, 0);
    }
    std::fill(block.warps.begin(), block.warps.end(), Warp());
    for (size_t live = threads; live && block.error.empty();) {
        bool progress = false;
        live = 0;
        for (Lane& lane : block.lanes) {
            if (lane.done) continue;
            block.lane = &lane;
            unsigned shuffles = lane.shuffles;
            swapcontext(&block.scheduler, &lane.context);
            progress |= lane.done || lane.shuffles != shuffles;  // else still waiting
            live += !lane.done;
        }
        if (live && !progress && block.error.empty())
            block.error = "deadlock: a warp waits in __shfl_down_sync for lanes that exited";
    }
}

inline const char* run_grid(const unsigned* grid, const unsigned* dim, void (*body)(void*),
                            void* closure) {
    size_t threads = size_t(dim[0]) * dim[1] * dim[2];
    block.grid = {grid[0], grid[1], grid[2]};
    block.dim = {dim[0], dim[1], dim[2]};
    block.lanes.resize(threads);
    block.warps.resize((threads + WARP - 1) / WARP);
    block.stacks.resize(threads * STACK);
    block.body = body;
    block.closure = closure;
    block.error.clear();
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0] && block.error.empty(); ++x) {
                block.index = {x, y, z};
                run_block();
            }
    return block.error.empty() ? nullptr : block.error.c_str();
}

// Lane me posts its value and, once all 32 lanes have, reads lane me + delta's.
template<typename T> T shfl_down(unsigned mask, T value, int delta) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "a register value");
    size_t t = block.lane - block.lanes.data();
    unsigned me = t % WARP;
    if (mask != 0xFFFFFFFFu || t - me + WARP > block.lanes.size())
        fail("__shfl_down_sync: the mask must name all 32 lanes of a full warp");
    Warp& warp = block.warps[t / WARP];
    unsigned slot = block.lane->shuffles++ & 1;  // two slots: posting the next never overwrites
    std::memcpy(&warp.posted[slot][me], &value, sizeof(T));
    ++warp.arrived[slot];
    while (warp.arrived[slot] < WARP) swapcontext(&block.lane->context, &block.scheduler);
    if (me + delta < WARP) std::memcpy(&value, &warp.posted[slot][me + delta], sizeof(T));
    if (++warp.read[slot] == WARP) warp.arrived[slot] = warp.read[slot] = 0;
    return value;
}

// A parameter's kind and size: "f4", "u8", "*V2" (a pointer to a 2-byte struct), ...
template<typename T> std::string kind() {
    if (std::is_pointer<T>::value) return "*" + kind<typename std::remove_cv<
        typename std::remove_pointer<T>::type>::type>();
    char k = std::is_floating_point<T>::value ? 'f' : std::is_signed<T>::value ? 'i'
           : std::is_unsigned<T>::value ? 'u' : 'V';
    return k + std::to_string(sizeof(T));
}

template<typename... P> const char* signature(void (*)(P...)) {
    static std::string kinds;
    kinds.clear();
    for (const std::string& k : {std::string(), kind<P>()...}) kinds += k + ",";
    return kinds.c_str();
}

template<typename... P, size_t... I>
void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<P*>(args[I])...);
}

template<typename... P>
const char* launch(void (*kernel)(P...), const unsigned* grid, const unsigned* dim,
                   void** args) {
    struct Closure { void (*kernel)(P...); void** args; } closure{kernel, args};
    return run_grid(grid, dim, [](void* c) {
        Closure* it = static_cast<Closure*>(c);
        call(it->kernel, it->args, std::index_sequence_for<P...>{});
    }, &closure);
}
}  // namespace host_cuda

#define threadIdx (host_cuda::block.lane->index)
#define blockIdx (host_cuda::block.index)
#define blockDim (host_cuda::block.dim)
#define gridDim (host_cuda::block.grid)
#define __shfl_down_sync host_cuda::shfl_down
"""

# NVRTC options and their g++ equivalents; anything else is refused, not ignored.
_OPTIONS = {"--fmad=false": ["-ffp-contract=off"], "--fmad=true": ["-ffp-contract=fast"]}
_GXX = ["-O2", "-shared", "-fPIC", "-Wall", "-Werror"]


def compiler():
    """The C++ compiler (``CXX``, else g++), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _flags(options):
    flags = []
    for option in options:
        if option.startswith("--std="):
            flags.append("-std=" + option[len("--std="):])
        elif option in _OPTIONS:
            flags += _OPTIONS[option]
        else:
            raise ValueError(f"host_cuda: no g++ equivalent for the NVRTC option {option!r}")
    return flags


def _translation_unit(code, expressions):
    launchers = [f'extern "C" const char* signature_{n}() '
                 f'{{ return host_cuda::signature(&{e}); }}\n'
                 f'extern "C" const char* launch_{n}(const unsigned* grid, const unsigned* dim, '
                 f'void** args) {{ return host_cuda::launch(&{e}, grid, dim, args); }}'
                 for n, e in enumerate(expressions)]
    return "\n".join([HEADER, '#line 1 "code.cu"', code, '#line 1 "launchers.cpp"',
                      *launchers, ""])


@functools.lru_cache(maxsize=None)
def _library(code, options, expressions):
    """The shared library for this source, built once (cached on disk by its hash)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("host_cuda: no C++ compiler (set CXX or install g++)")
    command = [cxx, *_GXX, *_flags(options)]
    text = _translation_unit(code, expressions)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([version, *command, text]).encode()).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / "pacmpi-host-cuda"
    target = cache / f"{digest}.so"
    if not target.exists():
        cache.mkdir(exist_ok=True)
        source = cache / f"{digest}.{os.getpid()}.cpp"
        source.write_text(text)
        partial = source.with_suffix(".so")
        done = subprocess.run([*command, "-o", str(partial), str(source)], capture_output=True,
                              text=True)
        source.unlink()
        if done.returncode:
            raise RuntimeError(f"host_cuda: {' '.join(command)} failed:\n{done.stderr}")
        os.replace(partial, target)  # atomic: concurrent sessions never load half a file
    return ctypes.CDLL(str(target))


class RawModule:
    """``cupy.RawModule`` on the host: the kernels named by ``name_expressions``."""

    def __init__(self, code, options=(), name_expressions=()):
        self._expressions = tuple(name_expressions)
        self._library = _library(code, tuple(options), self._expressions)

    def get_function(self, name_expression):
        if name_expression not in self._expressions:
            raise KeyError(f"{name_expression!r} is not among the module's name_expressions")
        number = self._expressions.index(name_expression)
        return _Function(name_expression, getattr(self._library, f"signature_{number}"),
                         getattr(self._library, f"launch_{number}"))


def _dim3(shape):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return (ctypes.c_uint * 3)(*shape, *(1,) * (3 - len(shape)))


def _kind(dtype):
    return {"b": "u"}.get(dtype.kind, dtype.kind) + str(dtype.itemsize)


def _fits(given, parameter):
    """Same kind and size; a struct parameter (16-bit float storage) takes any same-size type."""
    pointer, letter = parameter.startswith("*"), parameter.lstrip("*")[0]
    return given == parameter or (letter == "V" and given.startswith("*") == pointer
                                  and given.lstrip("*")[1:] == parameter.lstrip("*")[1:])


class _Function:
    """One kernel; called as ``kernel(grid, block, args)``, like ``cupy.RawKernel``."""

    def __init__(self, name, signature, launch):
        signature.restype = launch.restype = ctypes.c_char_p
        self.name, self._launch = name, launch
        self.parameters = [p for p in signature().decode().split(",") if p]

    def __call__(self, grid, block, args, shared_mem=0):
        if shared_mem:
            raise ValueError(f"{self.name}: host kernels have no dynamic shared memory")
        if len(args) != len(self.parameters):
            raise TypeError(f"{self.name} takes {len(self.parameters)} arguments, "
                            f"got {len(args)}")
        values = [self._argument(n, a, p) for n, (a, p) in enumerate(zip(args, self.parameters))]
        pointers = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))
        error = self._launch(_dim3(grid), _dim3(block), pointers)
        if error:
            raise RuntimeError(f"{self.name}: {error.decode()}")

    def _argument(self, number, value, parameter):
        """The bytes CUDA would get for ``value``: a data pointer or a scalar's value."""
        if type(value) is np.ndarray:
            raise TypeError(f"{self.name}: argument {number} is a NumPy array, in host memory "
                            "(CuPy refuses it too)")
        if isinstance(value, np.ndarray):  # a device array of host_cupy
            given, buffer = "*" + _kind(value.dtype), ctypes.c_void_p(value.ctypes.data)
        elif hasattr(value, "data") and hasattr(value.data, "ptr"):  # a CuPy-like array
            given, buffer = "*" + _kind(value.dtype), ctypes.c_void_p(value.data.ptr)
        elif isinstance(value, np.generic):
            given, buffer = _kind(value.dtype), ctypes.create_string_buffer(value.tobytes())
        else:
            raise TypeError(f"{self.name}: argument {number} is a {type(value).__name__}; "
                            "pass an array or a NumPy scalar of the parameter's C type")
        if not _fits(given, parameter):
            raise TypeError(f"{self.name}: argument {number} is {given} "
                            f"({type(value).__name__}), the kernel takes {parameter}")
        return buffer
