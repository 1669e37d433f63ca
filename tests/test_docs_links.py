"""The documents lead to the code: README -> ARCHITECTURE.md -> every package,
kernel and hot path, one link each, and every relative link resolves.

A new package or kernel fails here until ARCHITECTURE.md links it; a moved
or renamed file fails here until the link follows it.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cadence"
DOCS = ("README.md", "ARCHITECTURE.md")
KERNEL_SUFFIXES = (".c", ".py")
# The code every step runs (ARCHITECTURE.md, "Hot paths"), besides the kernels.
HOT_PATHS = (
    "cadence/engine/core.py",             # EngineCore.step
    "cadence/core/sched/scheduler.py",    # Scheduler.schedule
    "cadence/runner/model_runner.py",     # ModelRunner.execute_model
    "cadence/runner/fused_decoder.py",    # the one-call decoder
    "cadence/runner/attention.py",        # PagedAttention
    "cadence/models/quantized.py",        # products on GGUF blocks
)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def links(doc: str) -> list[str]:
    """The link targets of a document, fenced code left out."""
    return LINK.findall(FENCE.sub("", (ROOT / doc).read_text()))


def relative(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ...


def anchors(doc: str) -> set[str]:
    """GitHub's ids of the document's headings: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", (ROOT / doc).read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def linked_paths(doc: str) -> set[Path]:
    """Files and folders the document links to (anchors cut), resolved."""
    paths = set()
    for target in filter(relative, links(doc)):
        path = target.split("#", 1)[0]
        if path:
            paths.add((ROOT / doc).parent.joinpath(path).resolve())
    return paths


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    found = [t for t in links(doc) if relative(t)]
    assert found, f"{doc} has no relative links"
    missing = []
    for target in found:
        path, _, anchor = target.partition("#")
        if path and not (ROOT / doc).parent.joinpath(path).exists():
            missing.append(target)
        elif anchor and not path and anchor not in anchors(doc):
            missing.append(target)
    assert not missing, f"{doc}: links to nothing: {missing}"


def test_readme_links_the_architecture():
    assert (ROOT / "ARCHITECTURE.md").resolve() in linked_paths("README.md")


def packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE)


def kernels() -> list[Path]:
    return sorted(path for path in (PACKAGE / "kernels").rglob("*")
                  if path.suffix in KERNEL_SUFFIXES and path.name != "__init__.py")


def test_what_the_architecture_must_link_is_found():
    """The lists below are read from the tree; make sure they read something."""
    names = {path.name for path in kernels()}
    assert {"decoder_stack.c", "decoder_stack.py", "paged_attention.c", "quant_matmul.py"} <= names
    assert PACKAGE / "core" / "sched" in packages()


@pytest.mark.parametrize("kind, paths", [
    ("package", packages),
    ("kernel", kernels),
    ("hot path", lambda: [ROOT / path for path in HOT_PATHS]),
])
def test_the_architecture_links_every(kind, paths):
    linked = linked_paths("ARCHITECTURE.md")
    unlinked = [str(path.relative_to(ROOT)) for path in paths() if path.resolve() not in linked]
    assert not unlinked, f"ARCHITECTURE.md links no {kind} {unlinked}"
