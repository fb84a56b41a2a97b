"""Tensor and pipeline parallelism for the embedded engine over torch.distributed (gloo on CPU, NCCL on CUDA).

environment.py reads the launcher's rank variables, layout.py places a rank in its stage and says which layers each
stage runs, group.py joins the process group, sharding.py says which slice of each checkpoint tensor a tensor rank
holds, sharded_load.py reads only a rank's slices of its stage's layers, layers.py adds the collectives to the
model, stages.py runs a stage's share of a forward and cuts a step into micro-batches, step_sync.py keeps every
rank's forward in step with rank 0's, and setup.py ties them to the engine."""
