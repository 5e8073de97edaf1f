"""The compiled decode step: `Stepper` (stepper.py) runs the model's single-token step through an
ahead-of-time built library (aot.py), torch.compile, or CUDA graphs (graphs.py), with the
projections' matmul chosen by gemm.py (our packed kernel, model/kernels/) and low-precision
weights from lowp.py."""
from .stepper import AOT_MIN_ROWS, MAX_ROWS, MIN_ROWS, ONEDNN, PACKED, Stepper, compiler_missing

__all__ = ["AOT_MIN_ROWS", "MAX_ROWS", "MIN_ROWS", "ONEDNN", "PACKED", "Stepper", "compiler_missing"]
