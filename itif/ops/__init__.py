"""The per-row ops of the fused forward: each row of the token buffer reads its own tenant's
parameters through its *slot* (``reference.RotParam``), whatever the other rows' tenants.

* ``dispatch``: one class per op (``dispatch.Op``): the op's contract, said once in the class's
  docstring (semantics in index notation; shape, dtype and in place per argument), its torch
  reference and CUDA forwards side by side, and the backend choice with its recorded fallbacks.
  Callers use the instances: ``from itif.ops import dispatch as ops; ops.bias_act(...)``.
* ``reference``: the torch forwards (the spec, the CPU path, the kernels' oracle).
* ``cuda``: the CUDA forwards (RawKernels from ``kernels/*.cu``), with ``cuda_loader`` (build and
  launch), ``launch`` (launch configurations) and ``validate`` (argument checks).
* ``selftest``: the start-up check of each kernel against its reference.
* ``rows``: the per-row parameter views the reference and the runtime's GEMMs share.
"""
