"""The C functions of the MPI library mpi4py runs on, through ctypes, for what mpi4py does not
wrap: ``MPI_Op_create`` over a compiled function's address (the half-precision sums), the
MPIX CUDA-support queries (:func:`pacmpi.collectives.cuda_support`) and MPI_T control
variables (:func:`pacmpi.collectives.allreduce_algorithm`).
"""
import ctypes
import ctypes.util
import functools
import os

__all__ = ["function", "user_op", "control_variable"]


def function(MPI, name):
    """``name`` from the MPI library mpi4py runs on, through ctypes.

    Looked up through mpi4py's extension module first: ``dlsym`` on its handle searches the
    libraries it was linked against, so this is the very library mpi4py calls.
    """
    for candidate in _candidates(MPI.__file__):
        try:
            return getattr(_library(candidate), name)
        except (OSError, AttributeError):
            continue
    raise RuntimeError(f"{name} not found in the MPI library mpi4py uses")


def _candidates(extension):
    """Where to look, in order: mpi4py's extension, the libmpi files this process has mapped,
    then ``find_library("mpi")``, reached only when those fail: it runs ``ldconfig`` and a
    compiler, about 0.2 s a call, and a job's start makes dozens of these lookups."""
    yield extension
    mapped = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi") and path not in mapped:
                    mapped.append(path)
    except OSError:
        pass
    yield from (path for path in mapped if path != extension)
    found = ctypes.util.find_library("mpi")
    if found:
        yield found


@functools.lru_cache(maxsize=None)
def _library(path):
    return ctypes.CDLL(path)


def user_op(MPI, address):
    """An mpi4py ``Op`` for the commutative MPI_User_function at ``address`` (mpi4py's
    ``Op.Create`` takes only Python callables)."""
    op_create = function(MPI, "MPI_Op_create")
    # mpi4py tells a handle's C size only through MPI._sizeof (no public way).
    handle_type = {8: ctypes.c_void_p, 4: ctypes.c_int}.get(MPI._sizeof(MPI.Op))
    if handle_type is None:
        raise RuntimeError(f"unexpected MPI_Op size {MPI._sizeof(MPI.Op)}")
    op_create.restype = ctypes.c_int
    op_create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(handle_type)]
    handle = handle_type()
    err = op_create(ctypes.c_void_p(address), 1, ctypes.byref(handle))
    if err != 0:
        raise RuntimeError(f"MPI_Op_create failed with error {err}")
    return MPI.Op.fromhandle(handle.value or 0)


_NAME_LEN = 256
_DESC_LEN = 8192  # MPICH's algorithm selectors describe every value: about 1 KiB


def control_variable(MPI, name):
    """``(value, item)`` of the MPI_T control variable ``name`` as the MPI library itself sees
    it (after ``MPI_Init``: the value it read from ``--mca``, the environment or its parameter
    files): an int (a boolean as 0/1) and the name of its value (``None`` when the library
    names none), or a string and ``None``; ``None`` when the library has no such variable.
    mpi4py wraps no MPI_T."""
    provided = ctypes.c_int()
    if function(MPI, "MPI_T_init_thread")(0, ctypes.byref(provided)) != 0:
        raise RuntimeError("MPI_T_init_thread failed")
    try:
        index = ctypes.c_int()
        if function(MPI, "MPI_T_cvar_get_index")(name.encode(), ctypes.byref(index)) != 0:
            return None
        datatype, enumtype, description = _cvar_info(MPI, index)
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if function(MPI, "MPI_T_cvar_handle_alloc")(index, None, ctypes.byref(handle),
                                                    ctypes.byref(count)) != 0:
            raise RuntimeError(f"MPI_T_cvar_handle_alloc({name}) failed")
        try:
            # The C handle of MPI_CHAR, to compare with MPI_T's; mpi4py's only way to it.
            if datatype == MPI._handleof(MPI.CHAR):
                text = ctypes.create_string_buffer(max(count.value, 1))
                function(MPI, "MPI_T_cvar_read")(handle, text)
                return text.value.decode(), None
            value = ctypes.c_int64(0)  # zeroed: a boolean fills only its first byte
            function(MPI, "MPI_T_cvar_read")(handle, ctypes.byref(value))
        finally:
            function(MPI, "MPI_T_cvar_handle_free")(ctypes.byref(handle))
        value = ctypes.c_int(value.value & 0xFFFFFFFF).value  # an int fills 4 bytes
        return value, (_enum_item(MPI, enumtype, value) if enumtype.value else
                       _listed_item(description, value))
    finally:
        function(MPI, "MPI_T_finalize")()


def _cvar_info(MPI, index):
    """``(datatype handle, enum handle, description)`` of control variable ``index``."""
    texts = [ctypes.create_string_buffer(_NAME_LEN), ctypes.create_string_buffer(_DESC_LEN)]
    lengths = [ctypes.c_int(_NAME_LEN), ctypes.c_int(_DESC_LEN)]
    verbosity, bind, scope = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    datatype, enumtype = ctypes.c_void_p(), ctypes.c_void_p()
    function(MPI, "MPI_T_cvar_get_info")(
        index, texts[0], ctypes.byref(lengths[0]), ctypes.byref(verbosity),
        ctypes.byref(datatype), ctypes.byref(enumtype), texts[1], ctypes.byref(lengths[1]),
        ctypes.byref(bind), ctypes.byref(scope))
    return datatype.value or 0, enumtype, texts[1].value.decode(errors="replace")


def _listed_item(description, value):
    """The name of ``value`` where an int variable's description lists its values in order, one
    ``name - what it does`` line each after a first line (MPICH's algorithm selectors: no MPI_T
    enum, ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring`` reads back as 8); else ``None``."""
    lines = description.splitlines()[1:]
    if 0 <= value < len(lines) and all(" - " in line for line in lines):
        return lines[value].partition(" - ")[0].strip()
    return None


def _enum_item(MPI, enumtype, value):
    """The name of ``value`` in enum ``enumtype``, or ``None`` (no enum, or not in it)."""
    text = ctypes.create_string_buffer(_NAME_LEN)
    items, length = ctypes.c_int(), ctypes.c_int(_NAME_LEN)
    function(MPI, "MPI_T_enum_get_info")(enumtype, ctypes.byref(items), text,
                                         ctypes.byref(length))
    for item in range(items.value):
        number, length = ctypes.c_int(), ctypes.c_int(_NAME_LEN)
        function(MPI, "MPI_T_enum_get_item")(enumtype, item, ctypes.byref(number), text,
                                             ctypes.byref(length))
        if number.value == value:
            return text.value.decode()
    return None
