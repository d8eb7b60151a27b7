"""Notes of the report that :func:`fxrec.transform` and :func:`fxrec.explain` read from the graph
and their arguments (clamped gradients, placement in GPU memory, train()/eval())."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from . import meta
from .graph_module import MODES_KEY
from .pass_infra import PassContext


def clamp_note(max_gradient: Optional[float]) -> list:
    return [f"embedding outputs' gradients clamped to [-{max_gradient:g}, {max_gradient:g}] (max_gradient)"] \
        if max_gradient else []


def placement_note(gm: fx.GraphModule, hbm_budget) -> list:
    """A report note where ``hbm_budget=`` was given and no group runs on CUDA (it places GPU memory)."""
    if hbm_budget is None:
        return []
    devices = {n.meta[meta.DECISION].device for n in gm.graph.nodes if meta.DECISION in n.meta}
    if "cuda" in devices:
        return []
    return [f"hbm_budget= places tables in GPU memory, and no group runs on CUDA here "
            f"({', '.join(sorted(devices)) or 'no groups'}): it changed nothing"]


def rank_placements(ctx: PassContext, ranks: int) -> list:
    """Per rank, where its pieces of the tables live under ``hbm_budget=`` (on CUDA; an InputError
    naming a rank, any of them, whose pieces do not fit); notes for the first 8 ranks."""
    from .passes.place_shards import decide, rank_text
    from .planner.specs import format_bytes

    out = []
    for rank in range(ranks):
        placements, need, groups = decide(ctx, rank)
        cuda = [(gr, held) for gr, _, held, on in groups if on]
        if not cuda:
            return []
        if rank >= 8:
            continue
        where = "; ".join(f"{gr.name}: {rank_text(placements, held, ctx.config.cache_load_factor)}"
                          for gr, held in cuda if held)
        out.append(f"rank {rank} under hbm_budget={format_bytes(ctx.config.hbm_budget)}: its tables take "
                   f"{format_bytes(need)} of GPU memory; {where or 'no tables'}")
    return out


def modes_notes(gm: fx.GraphModule) -> list:
    info = gm.meta.get(MODES_KEY)
    if info is None:
        return []
    if not info.switchable:
        return [f"train()/eval(): {info.why_not}"]
    if info.flags:
        from .runtime.modes import as_captured_or_flipped

        together = [n.args[2] for n in gm.graph.nodes if n.op == "call_function" and n.target is as_captured_or_flipped]
        return [f"train()/eval() switch {sum(info.flags.values())} node(s) of {len(info.flags)} module(s) that follow "
                f"the mode (dropout, normalisation, numbers chosen by mode), as on the original model (captured in "
                f"{info.captured} mode)"
                + (f"; the flags of {'; of '.join(together)} decide values together: they must switch together "
                   "(another combination raises ModeError)" if together else "")]
    return []
