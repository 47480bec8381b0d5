"""The positive control of scripts/memcheck.sh (2 ranks under torchrun): gloo receives into a buffer that was freed.

This is the bug class a native heap-corruption abort in our job would come from (a receive, broadcast or all-gather
writing into a tensor after its memory went back to the allocator). The checker must report the write (ASan: a
heap-use-after-free by gloo's transport thread; valgrind: recvfrom into unaddressable bytes); if it does not, a clean
memcheck run means nothing on this machine.
Without the sanitizer the write silently lands in freed memory (that is the point: do not run this outside memcheck).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.send(torch.arange(8, dtype=torch.long), 1)
    else:
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        address = libc.malloc(64)
        buffer = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_int64 * 8).from_address(address)))
        libc.free(ctypes.c_void_p(address))  # the receive buffer's memory goes back to the allocator...
        dist.recv(buffer, 0)  # ...and gloo's transport thread writes into it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
