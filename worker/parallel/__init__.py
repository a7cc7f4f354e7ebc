"""Tensor-parallel ranks of one worker (`--tensor-parallel-size N`): rank 0 is the worker process and
leads (`ranks.RankGroup`); ranks 1..N-1 are processes it spawns itself (worker/startup/follower.py) that
repeat its steps. The model's shards: worker/model/tensor_parallel.py."""
