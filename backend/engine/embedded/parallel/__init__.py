"""Tensor parallelism for the embedded engine over torch.distributed (gloo on CPU, NCCL on CUDA).

environment.py reads the launcher's rank variables, group.py joins the process group, sharding.py says which slice
of each checkpoint tensor a rank holds, sharded_load.py reads only those slices, layers.py adds the collectives to
the model, step_sync.py keeps the followers' forwards in step with rank 0's, and setup.py ties them to the engine."""
