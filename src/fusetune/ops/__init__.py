"""Triton ops: one module per op (kernels, host launcher, custom ops, autograd, public function)."""
