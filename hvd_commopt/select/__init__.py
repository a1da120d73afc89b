"""Selection: which elements of a bucket a sparse compressor sends, and the kernels that find them.

* the algorithms: :mod:`.exact_topk` (exact, deterministic top-|x|), :mod:`.strategies` (exact or
  threshold reuse, and the fused memory step), :mod:`.sampled` (DGC's sampled threshold),
  :mod:`.layerwise` / :mod:`.layerwise_host` (per-layer k inside a bucket), :mod:`.addend` (the
  momentum correction's addend made in the selection's pass), :mod:`.grad_parts` (a bucket's
  gradients read where they are);
* the kernel seam: :mod:`.kernels` (:class:`~.kernels.SelectionKernels` and ``kernels_for``), with
  :mod:`.host` (NumPy and the C extension on host views) and :mod:`.portable` (the same contracts
  on TensorOps primitives, for device tensors and frameworks without host views) beside each other.

The package imports no framework and nothing above it (tests/unit/test_layering.py); the modules
are imported by name (``from hvd_commopt.select.kernels import kernels_for``).
"""
