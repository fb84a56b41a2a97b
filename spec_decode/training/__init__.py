"""Training speculative drafters and their data: Medusa heads (train_medusa.py), EAGLE-1/2 and EAGLE-3 draft layers
(train_eagle.py, train_eagle3.py) on a frozen Hugging Face base (frozen_base.py), with the shared step loop
(training_loop.py) and the self-distillation data (distill.py, with the shipped texts in data/).

The one part of tritonllm.spec_decode that imports the engine (the EAGLE layers are the engine's own modules, in
tritonllm.engine.embedded.speculation); nothing in the engine imports it."""
