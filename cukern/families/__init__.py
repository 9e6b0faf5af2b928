"""Kernel families, one module per family of ``kernels/``: each declares its ops' policies
(how an op maps onto the family's kernels, and the planning rules that are its own) and owns
its kernels' signature (the C++ name expression of a plan, in the template-argument order the
``.cuh`` defines)."""
