"""The ``Work`` object every flagos_shm collective returns."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ShmWork"]


class ShmWork(dist.Work):
    """Handle of one collective, completed when it is returned.

    Collectives currently run synchronously inside the call, so the work is already
    finished; a failure of the transfer is stored here and re-raised by :meth:`wait`
    (and carried by :meth:`get_future`), the way ``dist.*`` expects from asynchronous
    backends.

    Args:
        outputs: the caller's output tensors (the future's value).
        error: the exception the collective failed with, or ``None``.
    """

    def __init__(self, outputs: list[torch.Tensor], error: Optional[BaseException] = None):
        super().__init__()
        self._outputs = outputs
        self._error = error
        self._future: Optional[torch.futures.Future] = None  # made on demand (DDP asks for it)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Return ``True``; re-raise the collective's error if it failed. ``timeout`` is unused."""
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A completed future whose value is the list of output tensors (or which carries the error)."""
        if self._future is None:
            self._future = torch.futures.Future()
            if self._error is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(self._error)
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The list of output tensors; raises the collective's error if it failed."""
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """Nothing to do: host memory is written before the work is returned."""
