"""What a peer is: the types the peer modules share (apart, so that they need not import the
harness that imports them)."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass
class Peer:
    """One peer implementation, bound to one set of a case's inputs."""

    call: Callable[[int], None]  # the j-th call of a run: what the case's step i = j does
    outputs: Callable[[], list]  # its results, leaf for leaf beside the jaxkv step's output
    graph: bool = True  # timed as a CUDA graph of calls (False: eager calls)
    tolerance: float | None = None  # None: byte for byte; else the largest |peer - jaxkv|


@dataclasses.dataclass(frozen=True)
class Spec:
    """A peer a case has: its row name, the library it needs, and how to bind it to inputs."""

    name: str
    library: str  # "torch" or "flashinfer" (which needs torch too)
    make: Callable  # (case, carry, consts) -> Peer
