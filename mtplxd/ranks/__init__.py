"""Several ranks: one daemon serving a model sharded with mx.distributed.

Rank 0 is the whole daemon (HTTP, MCP, LSP, the scheduler, the session bank);
every other rank follows (`follower.py`): it loads the same model, takes its slice
(engine/distributed.py), and runs exactly the engine work rank 0 announces, in the
same order, so the collectives inside each sharded forward meet.

    world.py     who is who: ranks started here (`mtplxd start --ranks N`, ring
                 backend on loopback) or by `mlx.launch` (MLX_RANK, MLX_HOSTFILE)
    channel.py   the commands rank 0 announces, carried by the ranks' own collectives
    leader.py    rank 0's side: announce, notice a lost or silent rank, report them
    follower.py  the other ranks' loop
"""
