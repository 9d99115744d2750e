"""Patching of other libraries' models onto fusetune's ops: :mod:`fusetune.integrations.peft`
(PEFT LoRA layers) and :mod:`fusetune.integrations.transformers` (``fusetune.apply``: a
transformers causal LM's norms, RoPE, MLP, loss and PEFT LoRA layers), and
:func:`fusetune.integrations.fsdp.shard_lora` (FSDP2 for LoRA: the base sharded, the adapters
replicated). Each submodule imports its library only when used."""
