"""Stage 2, record: run a model with hooks and keep every node's tensor, detached, on the CPU.

:mod:`~parity.record.hooks` installs forward hooks, pre-hooks and :func:`~parity.record.hooks.tap`
(functional nodes) and substitutes the reference's tensors in isolated mode; :mod:`~parity.record.trace`
is what a recording fills; :mod:`~parity.record.store` holds its tensors in memory up to a budget and
spills the rest to safetensors files. :mod:`~parity.record.hf_capture` and :mod:`~parity.record.hf_kernels`
record what Transformers computes outside modules (attention internals, MoE experts, linear-attention
kernels)."""
