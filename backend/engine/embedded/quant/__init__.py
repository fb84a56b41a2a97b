"""Quantized weights in the embedded engine (issue 25): the internal formats and their reference dequantizers
(formats.py), round-to-nearest quantization on load (quantize.py), the settings from model.yaml and from the
checkpoint (settings.py), the quantized linear layer (linear.py), its kernels (kernels.py), and the loader's side:
which projections are quantized (layout.py) and how each checkpoint format's tensors become the internal ones
(checkpoint.py). docs/quantization.md says what loads, what quantizes on load and what is refused."""
