"""Bad wrapper arguments and the error each must give, shared by the PyTorch and TensorFlow
adapter tests (docs/cross-rank-check.md#arguments)."""

BAD_WRAPPER_ARGS = [
    ({"backward_passes_per_step": "2"}, r"backward_passes_per_step='2' must be a whole number >= 1"),
    ({"backward_passes_per_step": 1.5}, r"backward_passes_per_step=1\.5 must be a whole number >= 1"),
    ({"backward_passes_per_step": 0}, r"backward_passes_per_step=0 must be >= 1"),
    ({"fusion_threshold": "25MB"}, r"fusion_threshold='25MB' is not a whole number of bytes: pass an int"),
    ({"fusion_threshold": -1}, r"fusion_threshold=-1 is negative"),
    ({"gradient_predivide_factor": "2"}, r"gradient_predivide_factor='2' must be a finite number > 0"),
]
