"""TensorFlow 2 / Keras 3 adapter of hvd_commopt (in progress: see the TF issue)."""
