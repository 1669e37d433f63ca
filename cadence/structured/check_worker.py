"""The grammar checker's worker process (``isolated.py``):

    python -m cadence.structured.check_worker FD

FD is its end of a socket pair; the first message on it is (backend name,
tokenizer, vocabulary size), then ``worker_main`` answers checks until the
parent closes the pair. A module of its own, which nothing imports, so that
``-m`` runs it without the package already holding it.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from cadence.structured.isolated import worker_main


def main(fd: int) -> None:
    conn = Connection(fd)
    try:
        backend_name, tokenizer, vocab_size = conn.recv()
    except (EOFError, ConnectionError):  # the parent is gone before the worker started
        return
    worker_main(conn, backend_name, tokenizer, vocab_size)


if __name__ == "__main__":
    main(int(sys.argv[1]))
