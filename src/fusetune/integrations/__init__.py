"""Patching of other libraries' models onto fusetune's ops: :mod:`fusetune.integrations.peft`
(PEFT LoRA layers). Each submodule imports its library only when used."""
