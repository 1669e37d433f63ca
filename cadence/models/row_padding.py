"""Products computed on at least a given number of rows, for batch invariance.

A GEMM library may sum a row's products in another order when it is given
fewer rows (a one-row product is a matrix-vector kernel; MKL's float32
product treats an unfinished group of 4 rows apart). Appending zero rows up
to a floor where every row gets the value it has in any larger product makes
a row's result independent of how many rows came with it
(``cadence.runner.batch_invariance`` measures the floors and chooses them).
"""

from __future__ import annotations

from typing import Callable

import torch


def pad_rows_product(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     min_rows: int) -> torch.Tensor:
    """``product(x)`` for x [M, ...], computed on at least ``min_rows`` rows (zero rows
    appended, their results dropped)."""
    num_rows = x.shape[0]
    if num_rows >= min_rows:
        return product(x)
    padding = x.new_zeros(min_rows - num_rows, *x.shape[1:])
    return product(torch.cat([x, padding]))[:num_rows]
