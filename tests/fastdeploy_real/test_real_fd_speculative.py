"""Speculative decoding (MTP) through fastkv on the snapshot's code: the config
with `speculative_config` method mtp, ResourceManagerV1's speculative scheduling
(one block more per allocation), the token processor's speculative output path
(several accepted tokens per step, `accept_num`), the MTP layer's caches made with
`initialize_mtp_kv_cache`. The stand-in runner verifies drafts each step: it
writes the KV of the last token and of every draft, other bytes for the rejected
ones (a wrong token's KV), and emits the accepted drafts plus one token.

fastkv's commit rule (k outputs prove the prompt and k - 1 outputs computed) holds
here: the rejected drafts' positions lie past it and are written again, right,
before any block holding them is committed. Requests admitted while the first one
decodes, whose prompts are its prompt and its outputs to come (what a multi-turn
client sends), hit the blocks committed so far and read them through the checker:
a block committed with a rejected draft's bytes in it would be read wrong."""

from __future__ import annotations

from typing import Any

from real_fd_config import BLOCK_SIZE
from real_fd_model import prompt

BS = BLOCK_SIZE


def test_mtp_drafts_accepted_and_rejected(make_engine: Any) -> None:
    engine = make_engine(
        spec_tokens=2,
        speculative_tokens=2,
        mtp_layers=1,
        num_gpu_blocks=48,
        num_cpu_blocks=16,
        max_model_len=96,
        max_num_seqs=8,
        max_num_batched_tokens=96,
    )
    assert engine.fd_config.speculative_config.method is not None
    first = prompt(40, 2 * BS + 3)
    a = engine.add_request("a", first, 4 * BS)
    truth = engine.expected["a"]
    seen = set()
    while len(a.output_token_ids) < 4 * BS - 4:
        engine.step()
        k = len(a.output_token_ids)
        if k and k not in seen:  # a follow-up turn that runs ahead of a's outputs
            seen.add(k)
            engine.add_request(f"b{k}", [*first, *truth[: k + 3], 7], 2)
    engine.run()
    rejected = sum(r.log.rejected_positions for r in engine.runners)
    assert rejected > 0, "no draft was rejected"
    assert len(seen) < len(truth) - 4, "every step accepted one token only"
    hits = [sum(engine.log.hits[f"b{k}"]) for k in sorted(seen)]
    assert max(hits) >= 4 * BS, hits  # blocks holding a's outputs were hit
    engine.check_clean()
