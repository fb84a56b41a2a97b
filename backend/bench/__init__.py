"""Measurements a library can run: what an engine setting costs in quality (accuracy), against a baseline run in the
same process. The `tritonllm bench` commands sit on top and only parse flags and print."""
