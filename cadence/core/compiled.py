"""Marks for the optional compiled build of the scheduler (mypyc); no-ops otherwise.

``make compiled`` compiles ``cadence/core`` and the simulator's loop to C
extension modules beside their sources (``cadence/compile.py`` lists them);
Python then imports those in place of the ``.py`` files. The source stays the
one source of truth and runs as plain Python without the build.

mypyc reads these decorators by name when it type-checks the source, so
they come from ``mypy_extensions`` for the type checker; at run time they
change nothing:

- ``trait``: a class that others inherit beside their first base (the
  scheduler's mixins): mypyc compiles multiple inheritance only over traits.
- ``mypyc_attr``: per-class options (``native_class=False`` keeps an
  exception class a plain Python class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr, trait
else:
    def trait(cls):
        return cls

    def mypyc_attr(*args, **kwargs):
        return lambda cls: cls

__all__ = ["mypyc_attr", "trait"]
