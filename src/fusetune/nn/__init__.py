"""torch.nn.Module wrappers of fusetune's ops."""

from fusetune.nn.loss import CrossEntropyLoss

__all__ = ["CrossEntropyLoss"]
