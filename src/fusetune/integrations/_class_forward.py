"""Give a module a forward through its class, not its instance: ``install`` swaps the
module's class for a subclass whose ``forward`` is the given function, one subclass per
(class, function) for the whole process, as FSDP2's ``fully_shard`` does. Every module patched
with the same function then runs the same forward object, and what differs between them lives
in the module's attributes. Dynamo guards a per-instance forward (a ``functools.partial``, a
bound method in the instance dict) by identity, so compiling layer by layer recompiled for every
layer; a class forward is guarded by the class, the same for all of them.

A copy or a pickle of a patched module rebuilds the subclass from (class, function), so it needs
the function to be importable (a module-level function) and nothing else of this process."""

from __future__ import annotations

from collections.abc import Callable

import torch

_SUBCLASSES: dict[tuple[type, Callable], type] = {}


def subclass(cls: type, forward: Callable) -> type:
    """The subclass of ``cls`` whose forward is ``forward``; its name and qualname are ``cls``'s
    (repr, name-based lookups and ``isinstance`` see the class they saw before)."""
    key = (cls, forward)
    found = _SUBCLASSES.get(key)
    if found is None:
        namespace = {
            "forward": forward,
            "__reduce_ex__": _reduce_ex,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_fusetune_base": cls,
        }
        found = _SUBCLASSES[key] = type(cls.__name__, (cls,), namespace)
    return found


def install(module: torch.nn.Module, forward: Callable) -> tuple[type, Callable | None, bool]:
    """Make ``forward`` ``module``'s forward through its class. Returns what ``restore`` needs:
    (the class before, the instance-level forward it had, whether it had one). That instance
    forward leaves the instance dict, where it would hide the class's."""
    cls = type(module)
    had_instance_forward = "forward" in module.__dict__
    instance_forward = module.__dict__.pop("forward", None)
    module.__class__ = subclass(cls, forward)
    return cls, instance_forward, had_instance_forward


def restore(module: torch.nn.Module, cls: type, instance_forward, had_instance_forward) -> None:
    """Undo :func:`install`: the class and the instance forward (or none) back. A module whose
    class was subclassed again since (FSDP2 shards it) keeps that class, whose forward then
    hands every call to the original class's (see :func:`base_forward`)."""
    if type(module).__dict__.get("_fusetune_base") is cls:
        module.__class__ = cls
    if had_instance_forward:
        module.forward = instance_forward
    else:
        module.__dict__.pop("forward", None)


def base_forward(module: torch.nn.Module) -> Callable:
    """The forward of the class ``module`` had before :func:`install`, bound to it."""
    return type(module)._fusetune_base.forward.__get__(module)


def _reduce_ex(self, protocol):
    """Copies and pickles name the class by (class before, forward), not by itself: a
    subclass made at run time cannot be found by its name."""
    reduced = object.__reduce_ex__(self, max(protocol, 2))
    cls = type(self)
    if "_fusetune_base" not in cls.__dict__:  # subclassed again since (FSDP2): that class's
        return reduced
    return (_rebuild, (cls._fusetune_base, cls.forward), *reduced[2:])


def _rebuild(cls: type, forward: Callable) -> torch.nn.Module:
    found = subclass(cls, forward)
    return found.__new__(found)
