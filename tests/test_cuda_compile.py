"""The CUDA kernels compiled by nvcc for the GPUs the Docker image serves (A100: sm_80,
H100/H200: sm_90), every instantiation gpu.py launches, with NVRTC's options and every warning
(front end, host compiler, ptxas) an error; the cubin must hold exactly one kernel entry per
instantiation. Skipped only where no nvcc is found (PATH, CUDA_HOME/bin, /usr/local/cuda/bin).
"""
import os
import re
import shutil
import struct
import subprocess

import pytest

from pacmpi.kernels import gpu

ARCHS = ["sm_80", "sm_90"]
STRICT = ["--Werror", "all-warnings", "-Xptxas", "--warning-as-error",
          "-Xcompiler", "-Wall,-Wextra,-Werror"]


def _nvcc():
    places = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    return shutil.which("nvcc") or next(
        (path for path in (os.path.join(p, "bin", "nvcc") for p in places if p)
         if os.access(path, os.X_OK)), None)


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc (PATH, CUDA_HOME/bin, "
                                                     "/usr/local/cuda/bin): CUDA not installed")


def instantiated(source, expressions):
    """``source`` plus the kernels' addresses taken in host code, which instantiates them as
    NVRTC's name expressions do."""
    addresses = "".join(f"    (void*)&{e},\n" for e in expressions)
    return f'{source}\nextern "C" void* const instantiated[] = {{\n{addresses}}};\n'


def compile_cubin(tmp_path, code, arch):
    """nvcc -c with gpu.OPTIONS and every warning an error; returns the kept cubin's bytes."""
    (tmp_path / "kernels.cu").write_text(code)
    done = subprocess.run([NVCC, "-c", *gpu.OPTIONS, *STRICT,
                           "-gencode", f"arch=compute_{arch[3:]},code={arch}",
                           "--keep", "--keep-dir", str(tmp_path), "-o", str(tmp_path / "k.o"),
                           str(tmp_path / "kernels.cu")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "kernels.cubin").read_bytes()


def kernel_entries(elf):
    """Mangled names of the kernel entry points in a cubin (ELF64 symbols that are functions
    with NVIDIA's STO_CUDA_ENTRY flag)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + n * shentsize)
                for n in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info, other = struct.unpack_from("<IBB", elf, at)
            if info & 0xF == 2 and other & 0x10:  # STT_FUNC, STO_CUDA_ENTRY
                names.append(elf[strings + name:elf.index(b"\0", strings + name)].decode())
    return names


def demangled(names):
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                          check=True).stdout.splitlines()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_instantiation_compiles_without_warnings(tmp_path, arch):
    expressions = list(gpu.expressions())
    entries = kernel_entries(compile_cubin(tmp_path, instantiated(gpu.SOURCE, expressions),
                                           arch))
    kernels = [re.match(r"void (\w+<.*>)\(", name).group(1) for name in demangled(entries)]
    assert sorted(kernels) == sorted(expressions)


def test_only_instantiated_kernels_are_entries(tmp_path):
    """The cubin check counts kernels, not device functions or templates never instantiated."""
    code = instantiated("template<int N> __global__ void put(int* p) { *p = N; }\n"
                        "__device__ int twice(int x) { return 2 * x; }\n"
                        "template<int N> __global__ void unused(int* p) { *p = twice(N); }",
                        ["put<1>", "put<2>"])
    entries = kernel_entries(compile_cubin(tmp_path, code, ARCHS[-1]))
    assert sorted(demangled(entries)) == ["void put<1>(int*)", "void put<2>(int*)"]


@pytest.mark.parametrize("injected, name, message", [
    ("__global__ void unused(int* p) { int never; *p = 1; }", "unused", r"#177-D"),
    ("__global__ void __launch_bounds__(1024, 64) unmet(int* p) { *p = 1; }", "unmet",
     r"ptxas error"),
    ("bool mixed(int a, unsigned b) { return a < b; }", "mixed", r"-Werror=sign-compare")],
    ids=["front end", "ptxas", "host compiler"])
def test_a_warning_fails_the_compile(tmp_path, injected, name, message):
    """Negative control: one warning from each stage makes the compile fail."""
    with pytest.raises(AssertionError, match=message):
        compile_cubin(tmp_path, instantiated(injected, [name]), ARCHS[-1])


def ftz_instructions(tmp_path, code):
    """The PTX instructions with ``.ftz`` when ``code`` is compiled with ``-ftz=true``, as CuPy
    compiles every module (it appends the option to any given)."""
    (tmp_path / "ftz.cu").write_text(code)
    done = subprocess.run([NVCC, "-ptx", *gpu.OPTIONS, "-ftz=true", "-arch=sm_90", "-o",
                           str(tmp_path / "ftz.ptx"), str(tmp_path / "ftz.cu")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "ftz.ptx").read_text().splitlines()
    return {op for op in (line.split()[0] for line in lines if line.strip()) if ".ftz" in op}


def test_float32_arithmetic_keeps_subnormals_under_cupys_ftz(tmp_path):
    """Under CuPy's -ftz=true every float32 operation of the kernels keeps subnormals as the
    NumPy reference does: the only .ftz instruction left is the NaN test (x != x), which
    flushing cannot change. Negative control: a plain division and comparison get .ftz."""
    found = ftz_instructions(tmp_path, instantiated(gpu.SOURCE, list(gpu.expressions())))
    assert found <= {"setp.nan.ftz.f32"}, found
    plain = ("__global__ void plain(float* p) { "
             "p[0] = p[1] / p[2]; p[3] = p[4] < p[5] ? 1.0f : 0.0f; }")
    assert {"div.rn.ftz.f32", "setp.lt.ftz.f32"} <= ftz_instructions(
        tmp_path, instantiated(plain, ["plain"]))
