"""Pipeline parallelism: a compiled program split into stages and run by ``torch.distributed.pipelining``."""
