"""Logits of an engine run fed given tokens instead of its samples: what the tests compare
across cache dtypes, memory and batching, where a sampled token that differs would make
the runs diverge from there on."""

from __future__ import annotations

import functools

import jax
import numpy as np

from mla_jax.engine.batch import build_batch
from mla_jax.engine.engine import Engine, EngineConfig, Request


def teacher_forced_logits(
    model, cfg: EngineConfig, prompts: list[list[int]], forced: list[list[int]]
) -> tuple[list[np.ndarray], int]:
    """Each request's logits at every generated position ``[new_tokens, vocab]``, through
    the engine's scheduler (preemptions included), packed step buffers, cache and model,
    feeding it the tokens ``forced`` instead of its own samples (each step is read before
    the next is scheduled, so no token is pending); and how many preemptions it took."""
    engine = Engine(model, cfg, log=lambda _: None)
    scheduler, runner = engine.schedulers[0], engine.runner

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def forward(layout, cache, packed):
        md, input_ids, *_ = layout.unpack(packed)
        return model(input_ids, cache, md, impl=cfg.impl)

    reqs = [Request(p, len(f)) for p, f in zip(prompts, forced, strict=True)]
    logits_of = {id(r): [] for r in reqs}
    for req in reqs:
        scheduler.add(req)
    cache = runner.cache
    while scheduler.has_work:
        batch = scheduler.schedule()
        layout, packed, (rows,), _ = runner.prepare([build_batch(batch, {})], engine.buckets)
        logits, cache = forward(layout, cache, packed)
        for entry, row in zip(batch, np.asarray(logits)[rows], strict=True):
            req = entry.request
            if not entry.samples:
                continue
            req.num_pending -= 1
            logits_of[id(req)].append(row)
            req.output_ids.append(forced[reqs.index(req)][len(req.output_ids)])
            if len(req.output_ids) == req.max_new_tokens:
                scheduler.finish(req)
    return [np.stack(logits_of[id(r)]) for r in reqs], scheduler.preemptions
