"""Pure-PyTorch twins of every fusetune op: same signatures, same semantics, obviously right.

They are the CPU path of the public ops and the oracle the tests compare the kernels with."""

from fusetune.reference.cross_entropy import cross_entropy

__all__ = ["cross_entropy"]
