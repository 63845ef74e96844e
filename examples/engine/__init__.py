"""An example engine around fastkv, shaped like FastDeploy: a scheduler process that
batches requests and owns the CacheManager, and a worker process that owns the
CacheController and a small deterministic Paddle transformer. It exists to prove
the cache end to end (outputs identical to recomputation) and to be read as a
reference integration; it is not part of the library core.

Only `worker` and `model` import paddle; the scheduler side never does.
"""
