"""The default process group of the torchrun scenario modules. Several of them may run in one
launch (tests/mpi_util.py: SHARED_LAUNCHES), and a process starts its default group once: the
first module imported starts it, the others join it."""
import torch
import torch.distributed as dist


def join(backend="gloo"):
    """``(rank, size)`` of the default group, started on ``backend`` unless a module already
    started it; one thread per rank, as the ranks share the host's cores."""
    if not dist.is_initialized():
        dist.init_process_group(backend)
    elif dist.get_backend() != backend:
        raise RuntimeError(f"the default process group runs {dist.get_backend()}, and this "
                           f"module needs {backend}: run it in a launch of its own")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()
