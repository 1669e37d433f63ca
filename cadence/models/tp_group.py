"""``TensorParallelGroup``: the collectives the K ranks of one split model run together.

A sharded model needs three collectives (see ``tensor_parallel``):

    all_reduce(x)         sum of every rank's partial x, in place (after a
                          row-parallel linear, after the vocabulary-split embedding)
    all_gather(x)         every rank's x, in rank order (the LM head's logits)
    broadcast_object(o)   rank 0's Python object on every rank (the step's sampled tokens)

The group is a ``torch.distributed`` process group made directly from a
store, never through ``init_process_group``: no global state, so one
process may hold several engines (tests do), each with its own group.
The backend is gloo on the CPU; NCCL would be the one for CUDA devices
(``cadence.runner.tp_workers.collective_backend``), whose path is not built yet.

A rank that dies closes its sockets: the others' collectives raise at once
(gloo: "Connection closed by peer") instead of waiting for ``timeout``,
which only bounds a rank that hangs.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

LOCALHOST = "127.0.0.1"


def make_store(rank: int, size: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous: rank 0 serves it (``port`` 0: any free port, read back from
    ``store.port``), the other ranks connect to that port on this machine."""
    if rank == 0:
        return dist.TCPStore(LOCALHOST, port, size, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(LOCALHOST, port, size, False, timeout=timeout)


class TensorParallelGroup:
    """This process's rank among the ``size`` ranks of one model, and their collectives."""

    def __init__(self, process_group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.process_group = process_group
        self.rank = rank
        self.size = size

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, *, backend: str,
                timeout: datetime.timedelta) -> "TensorParallelGroup":
        """Join the group; returns once all ``size`` ranks have joined (or raises after ``timeout``)."""
        if backend != "gloo":
            raise ValueError(f"tensor_parallel_size: the {backend} backend is not built; "
                             f"ranks run on the CPU over gloo")
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Every rank is a process of this machine: talk over the loopback only.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
        return cls(dist.ProcessGroupGloo(store, rank, size, options), rank, size)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine core's own rank, which samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must be contiguous); returns x."""
        self.process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on each), in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        return parts

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (the others pass nothing): its length, then its bytes."""
        data = pickle.dumps(obj) if self.is_driver else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.process_group.broadcast([length]).wait()
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver
                  else torch.empty(int(length), dtype=torch.uint8))
        self.process_group.broadcast([buffer]).wait()
        return obj if self.is_driver else pickle.loads(buffer.numpy().tobytes())
