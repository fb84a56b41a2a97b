"""Quantized weights: the internal formats (fp8, int8, int4), their reference dequantizers and the matmul kernels."""
