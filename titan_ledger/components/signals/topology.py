"""Where this rank sits in the run: the one fact every ledger component is built from.

Design decision: the ledger's components (signal recorder, data-ledger writer,
spike guard) never look at a trainer, a device mesh or ``torch.distributed``
to decide who does what; they get a ``Topology``. ``Topology.from_trainer``
reads torchtitan's ``ParallelDims`` once; unit tests build one by hand
(``Topology.single()``, or any rank of any layout) and drive the components
in-process without torchrun.

Ownership rules (each counted once over the world):
  * loss sums: the last PP stage, TP rank 0; every CP rank holds a piece of the
    sequence's loss, so all CP ranks add theirs;
  * token counts: as loss, but one CP rank (every CP rank sees all labels);
  * the data ledger: one writer per DP rank, the rank with tp = cp = 0 on the
    first PP stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Topology:
    world: int = 1
    rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0
    first_stage: bool = True
    last_stage: bool = True
    pp_size: int = 1
    #: DP rank of every global rank (index = global rank), for per-DP-rank sums
    dp_rank_of: tuple[int, ...] = field(default=(0,))
    #: for every DP rank, the global rank that owns its loss and tokens (per-document losses)
    loss_rank_of_dp: tuple[int, ...] = field(default=(0,))

    @property
    def owns_loss(self) -> bool:
        return self.last_stage and self.tp_rank == 0

    @property
    def owns_tokens(self) -> bool:
        return self.owns_loss and self.cp_rank == 0

    @property
    def data_writer(self) -> bool:
        """Writes this DP rank's data ledger."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.first_stage

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls) -> Topology:
        return cls()

    @classmethod
    def from_trainer(cls, trainer) -> Topology:
        import torch.distributed as dist

        pd = trainer.parallel_dims
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if pd.dp_enabled:
            bm = pd.get_mesh("batch")
            dp_size, dp_rank = bm.size(), bm.get_local_rank()
        else:
            dp_size, dp_rank = 1, 0
        tp_mesh, cp_mesh, pp_mesh = (pd.get_optional_mesh(n) for n in ("tp", "cp", "pp"))
        topo = cls(
            world=world, rank=rank, dp_size=dp_size, dp_rank=dp_rank,
            tp_rank=tp_mesh.get_local_rank() if tp_mesh is not None else 0,
            cp_rank=cp_mesh.get_local_rank() if cp_mesh is not None else 0,
            first_stage=pp_mesh is None or pp_mesh.get_local_rank() == 0,
            last_stage=trainer.pp_has_last_stage if pd.pp_enabled else True,
            pp_size=pd.pp if pd.pp_enabled else 1,
        )
        mine = (dp_rank, topo.owns_tokens)
        every = [mine]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, mine)  # once, at setup
        return cls.with_ranks(topo, every)

    @classmethod
    def with_ranks(cls, topo: Topology, every: list[tuple[int, bool]]) -> Topology:
        """``topo`` completed from every rank's (DP rank, owns tokens)."""
        loss_rank = [0] * topo.dp_size
        for r, (dp, owns) in enumerate(every):
            if owns:
                loss_rank[dp] = r
        from dataclasses import replace

        return replace(topo, dp_rank_of=tuple(int(dp) for dp, _ in every), loss_rank_of_dp=tuple(loss_rank))
