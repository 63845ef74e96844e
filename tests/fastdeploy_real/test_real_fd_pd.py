"""FastDeploy's disaggregated prefill/decode on its real ResourceManagerV1s, served by
fastkv's PD path (`real_fd_pd.PDPair`): P and D instances, each with its stand-in
runners checking every KV position they read, per layer; fastkv's in-process transport
between the ranks (Mooncake TE: `test_real_fd_pd_te.py`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from real_fd_config import build_fd_config
from real_fd_engine import Engine
from real_fd_pd import PDPair

import fastkv.integrations.fastdeploy as fkv_fd
from fastkv.pd.inproc import InProcFabric

BS = 8
PROMPT_A = list(range(100, 100 + 3 * BS + 3))  # 4 blocks, the last partial
SYSTEM = list(range(300, 300 + 2 * BS))  # a shared system prompt of 2 blocks


@pytest.fixture
def make_pair(
    installed: list[str], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., PDPair]]:
    """A P engine and a D engine over fresh FDConfigs (each its own results
    channel), their ranks on one in-process fabric."""
    engines: list[Engine] = []

    def engine(role: str, **config: Any) -> Engine:
        name = f"fd-pd-{role}-{os.getpid()}-{os.urandom(4).hex()}"
        monkeypatch.setenv(fkv_fd.CHANNEL_ENV, name)
        config.setdefault("num_gpu_blocks", 24)
        e = Engine(build_fd_config(model_dir, splitwise_role=role, **config))
        engines.append(e)
        return e

    def make(
        *,
        tp: int = 1,
        p_config: dict[str, Any] | None = None,
        d_config: dict[str, Any] | None = None,
        fabric: InProcFabric | None = None,
        **settings: Any,
    ) -> PDPair:
        p = engine("prefill", tensor_parallel_size=tp, **(p_config or {}))
        d = engine("decode", tensor_parallel_size=tp, **(d_config or {}))
        fab = fabric or InProcFabric()
        transports = (
            [fab.endpoint(f"p{r}") for r in range(tp)],
            [fab.endpoint(f"d{r}") for r in range(tp)],
        )
        settings.setdefault("deployment_secret", b"s" * 32)
        return PDPair(p, d, transports, **settings)

    yield make
    for e in engines:
        e.close()


def positions_checked(engine: Engine) -> int:
    return sum(r.log.positions_checked for r in engine.runners)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_request_prefilled_on_p_decodes_on_d_with_its_kv(make_pair: Any, tp: int) -> None:
    pair = make_pair(tp=tp)
    prompt_b = list(range(500, 500 + 2 * BS + 5))
    served = pair.serve([("a", PROMPT_A, 6), ("b", prompt_b, 4)])
    assert [s.first_token_error for s in served] == [None, None]
    # D read every prompt position of both requests from what P wrote, per layer.
    assert pair.d.mismatches() == 0
    assert positions_checked(pair.d) >= tp * (len(PROMPT_A) + len(prompt_b)) * 2
    assert [len(s.dest_block_ids) for s in served] == [4, 3]
    assert all(b >= 0 for s in served for b in s.dest_block_ids)
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()
    assert pair.p.cache_manager.pd.counters["sends_finished"] == 2


def test_d_reuses_its_own_prefix_and_p_sends_only_the_tail(make_pair: Any) -> None:
    pair = make_pair()
    first = SYSTEM + list(range(700, 700 + BS + 2))
    second = SYSTEM + list(range(800, 800 + BS + 4))
    pair.serve([("first", first, 3)])
    sent_before = sum(w.sender.bytes_sent for w in pair.p_workers)
    (served,) = pair.serve([("second", second, 5)])
    # FastDeploy's convention: -1 for each block D holds, then the blocks P writes.
    assert served.dest_block_ids[:2] == [-1, -1]
    assert all(b >= 0 for b in served.dest_block_ids[2:])
    assert len(served.dest_block_ids) == 4
    sent = sum(w.sender.bytes_sent for w in pair.p_workers) - sent_before
    per_block = sent // 2  # two blocks of the tail
    assert sent == 2 * per_block and per_block > 0
    assert pair.d.cache_manager.pd.counters["prefix_blocks"] == 2
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def kill_after_layer(pair: PDPair, fabric: InProcFabric, layer: int) -> None:
    """P's rank 0 dies once it handed layer `layer` over (its endpoint: later writes
    and every notice fail; from D's side P is gone)."""
    ctrl = pair.p.runners[0].cache_controller
    hook = ctrl.after_layer

    def after_layer(n: int) -> None:
        hook(n)
        if n == layer:
            fabric.kill("p0", land_fraction=1.0)

    ctrl.after_layer = after_layer


@pytest.mark.parametrize("tp", [1, 2])
def test_p_killed_mid_transfer_d_recomputes_after_its_deadline(make_pair: Any, tp: int) -> None:
    fabric = InProcFabric()
    pair = make_pair(tp=tp, fabric=fabric, timeout_s=1.0, fence_grace_s=0.5)
    kill_after_layer(pair, fabric, 0)
    served = pair.start(pair.request("a", PROMPT_A, 5))
    pair.prefill([served])
    pair.first_tokens.sent = []  # P is dead: its first token never reaches D
    d_pd = pair.d.cache_manager.pd
    assert d_pd.counters["committed"] == 0
    pair.decode()  # D's deadline passes: it recomputes the prompt, samples all tokens
    assert d_pd.counters["recomputed"] == 1
    assert pair.d.mismatches() == 0
    pair.wait_idle()  # receiving blocks freed once fenced (deadline + grace)
    pair.d.check_clean()
    assert pair.p.cache_manager.pd.counters["sends_failed"] == 1  # P settles, not hangs
    pair.check_no_leaks()


def test_d_full_answers_error_msg_and_p_asks_again(make_pair: Any) -> None:
    pair = make_pair(d_config={"num_gpu_blocks": 12})
    big = list(range(900, 900 + 7 * BS))  # 7 of D's 12 blocks (8 with enc_dec)
    other = list(range(1000, 1000 + 5 * BS + 3))  # 6 blocks: no room while big runs
    first = pair.start(pair.request("big", big, 2))
    pair.prefill([first])
    second_req = pair.request("other", other, 3)
    assert pair.p.rm.preallocate_resource_in_p(second_req)
    info = pair.ask_d(second_req)
    assert info == {"request_id": "other", "error_msg": "Not enough resources"}
    d_cm = pair.d.cache_manager
    assert not d_cm.manager.is_active("other")  # nothing held for it on D
    assert "other" not in d_cm.pd._accepted
    pair.deliver_first_tokens([first])  # big decodes and ends: room again
    pair.decode()
    info = pair.ask_d(second_req)  # FastDeploy's P asks again
    assert "dest_block_ids" in info
    pair.pump()
    pair.p.rm.add_request_in_p([second_req])
    from real_fd_pd import Served

    served = Served("other")
    pair.prefill([served])
    pair.deliver_first_tokens([served])
    pair.decode()
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


@pytest.mark.parametrize("tp", [1, 2])
def test_abort_on_d_while_receiving_frees_the_tail_once_fenced(make_pair: Any, tp: int) -> None:
    pair = make_pair(tp=tp)
    served = pair.start(pair.request("a", PROMPT_A, 5))
    d_cm = pair.d.cache_manager
    receiving = d_cm.manager.num_receiving_blocks
    assert receiving == 4
    pair.d.rm.pre_recycle_resource("a")  # D gives the request up (FastDeploy's call)
    assert not d_cm.manager.is_active("a")
    assert d_cm.manager.num_receiving_blocks == receiving  # P may still write: fenced
    pair.prefill([served])  # P sends; its notice fences D's tail
    pair.deliver_first_tokens([served])  # "not found" on D: dropped
    pair.wait_idle()
    assert d_cm.manager.num_receiving_blocks == 0
    assert d_cm.pd.counters["aborted"] == 1
    del pair.d.expected["a"]
    pair.check_no_leaks()


def test_d_deadline_passing_ends_in_recompute_and_p_reports_the_failure(
    make_pair: Any,
) -> None:
    import time

    pair = make_pair(timeout_s=0.5, fence_grace_s=0.3)
    served = pair.start(pair.request("a", PROMPT_A, 5))
    time.sleep(0.9)  # P is slow: D's deadline and fence pass before P prefills
    pair.decode()  # D recomputes the prompt and finishes the request itself
    assert pair.d.cache_manager.pd.counters["recomputed"] == 1
    assert pair.d.cache_manager.manager.num_receiving_blocks == 0
    pair.prefill([served])  # P's send is past its own deadline: reported failed
    assert pair.p.cache_manager.pd.counters["sends_failed"] == 1
    out = pair.first_tokens.sent[0]
    assert out.error_code == 501 and "PD Error" in out.error_msg
    pair.deliver_first_tokens([served])  # D: the request is done, nothing to recycle
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_p_first_token_before_the_commit_waits_outside_running(make_pair: Any) -> None:
    """add_prefilled_request keeps the request out of running until the transfer's
    success was applied, whatever P's first-token message says."""
    fabric = InProcFabric()
    pair = make_pair(fabric=fabric)
    fabric.hold_notices = True  # P's notice to D is late: D has not verified
    served = pair.start(pair.request("a", PROMPT_A, 4))
    pair.prefill([served])
    pair.deliver_first_tokens([served])
    d = pair.d
    d.step()
    assert [r.request_id for r in d.rm.running] == []  # held: no KV verified yet
    assert d.cache_manager.pd.counters["committed"] == 0
    fabric.hold_notices = False
    fabric.pump()
    pair.decode()
    assert d.cache_manager.pd.counters["committed"] == 1
    assert d.mismatches() == 0
    pair.wait_idle()
    d.check_clean()
    pair.check_no_leaks()


def test_request_finish_on_p_settles_instead_of_freeing_blocks_a_send_reads(
    make_pair: Any,
) -> None:
    # Deadlines far away: what settles the send here is P's ranks, told at once.
    pair = make_pair(send_timeout_s=60.0, timeout_s=60.0)
    req = pair.request("a", PROMPT_A, 4)
    assert pair.p.rm.preallocate_resource_in_p(req)
    assert "dest_block_ids" in pair.ask_d(req)
    pair.pump()
    p_cm = pair.p.cache_manager
    held = p_cm.manager.num_blocks("a")
    # FastDeploy's P drops a task after its cache info went out (common_engine's
    # delete_tasks_list: pre_recycle_resource) while the send may read its blocks.
    pair.p.rm.pre_recycle_resource("a")
    assert p_cm.manager.is_active("a") and p_cm.manager.num_blocks("a") == held
    pair.d.rm.pre_recycle_resource("a")
    del pair.d.expected["a"]
    # Never prefilled: the ranks get the send and its abort with the drained
    # tasks, settle it failed and tell D, which fences its tail: no deadline waited.
    pair.wait_idle(timeout=10.0)
    assert not p_cm.manager.is_active("a")
    (finished,) = pair.finished.get_finished_req()
    assert finished[0] == "a" and finished[1] != "finished"  # reported failed
    assert pair.d.cache_manager.manager.num_receiving_blocks == 0
    pair.check_no_leaks()


def test_a_chunked_prefill_whose_first_chunk_d_holds_sends_only_the_tail(
    make_pair: Any,
) -> None:
    """D holds the system prompt, P does not (its cache was reset): P prefills in
    chunks of 2 blocks, the first of them all inside D's prefix, so its step
    announces no block to send; the later chunks send the tail, and D decodes."""
    pair = make_pair(p_config={"max_num_batched_tokens": 2 * BS})
    pair.serve([("first", SYSTEM + list(range(700, 700 + BS + 2)), 3)])
    pair.wait_idle()
    assert pair.p.cache_manager.reset_cache() is True  # P forgets the prefix
    sent_before = sum(w.sender.bytes_sent for w in pair.p_workers)
    (served,) = pair.serve([("second", SYSTEM + list(range(800, 800 + 2 * BS + 3)), 4)])
    assert served.first_token_error is None
    assert served.dest_block_ids[:2] == [-1, -1] and len(served.dest_block_ids) == 5
    assert pair.p.log.chunked_prefills >= 2
    sent = sum(w.sender.bytes_sent for w in pair.p_workers) - sent_before
    assert sent == 3 * (sent_before // 4)  # 3 tail blocks; the first request sent 4
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_a_batch_delivered_twice_is_refused_on_p_and_starts_nothing_twice(
    make_pair: Any,
) -> None:
    """A step's payload read twice off the queue (a replay): P's rank refuses the
    second copy whole, naming the task it expected; the send it started once
    decodes on D as if nothing happened."""
    import pickle

    from fastkv.integrations import fd_pd_tasks

    pair = make_pair()
    runner = pair.p.runners[0]
    receive = runner.receive
    refused: list[str] = []

    def twice(blob: bytes) -> None:
        receive(blob)
        ((batch, _),) = pickle.loads(blob)
        meta = batch.cache_evict_metadata
        if meta is not None and any(fd_pd_tasks.is_pd_entry(h) for h in meta.hash_values):
            with pytest.raises(ValueError, match="batch route: expected task") as e:
                receive(blob)
            refused.append(str(e.value))

    runner.receive = twice
    (served,) = pair.serve([("a", PROMPT_A, 4)])
    assert served.first_token_error is None
    assert refused and "ran already" in refused[0], refused
    assert pair.p.cache_manager.pd.counters["sends_finished"] == 1
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_a_chunked_prefill_on_p_sends_each_chunk_with_the_step_that_writes_it(
    make_pair: Any,
) -> None:
    """P's token budget is below the prompt: FastDeploy prefills it in chunks, and
    each chunk's step batch carries the chunk to P's ranks (fd_pd_tasks), so D
    receives every block once it is final."""
    import pickle

    from fastkv.integrations import fd_pd_tasks

    prompt = list(range(700, 700 + 5 * BS + 2))  # 6 blocks, 42 tokens
    pair = make_pair(p_config={"max_num_batched_tokens": 2 * BS})
    seen: list[tuple[str, Any]] = []
    runner = pair.p.runners[0]
    receive = runner.receive

    def spy(blob: bytes) -> None:  # what rank 0 reads off the queue, as it reads it
        ((batch, _),) = pickle.loads(blob)
        meta = batch.cache_evict_metadata
        seen.extend(t for _, t in fd_pd_tasks.split(meta, 0, 1)[1] if meta is not None)
        receive(blob)

    runner.receive = spy
    served = pair.serve([("c", prompt, 3)])
    assert served[0].first_token_error is None
    chunks = [arg for kind, arg in seen if kind == "chunk"]
    assert [kind for kind, _ in seen].count("send") == 1 and seen[0][0] == "send"
    assert len(chunks) >= 3, chunks  # 42 tokens at 16 a step
    assert [c[2] for c in chunks] == sorted(c[2] for c in chunks)  # blocks only grow
    assert [c[3] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1][2] == 6
    assert pair.d.mismatches() == 0
    assert positions_checked(pair.d) >= len(prompt) * 2
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


@pytest.mark.parametrize("secret", [b"d" * 32, None])
def test_the_notice_key_rides_the_zmq_message_only_without_a_deployment_secret(
    make_pair: Any, secret: bytes | None
) -> None:
    pair = make_pair(deployment_secret=secret)
    (served,) = pair.serve([("a", PROMPT_A, 3)])
    key = served.dest_block_ids.fastkv["secret"]  # as P read it off cache_sync
    assert (key == b"") == (secret is not None)
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_a_malformed_acceptance_from_d_changes_nothing_on_p(make_pair: Any) -> None:
    from fastkv.integrations.fd_pd import DestBlockIds

    pair = make_pair()
    req = pair.request("a", PROMPT_A, 3)
    assert pair.p.rm.preallocate_resource_in_p(req)
    bad = DestBlockIds([1, 2, 3, 4], {"transfer_id": 1})  # no epoch, blocks, ...
    with pytest.raises(ValueError, match="not an acceptance"):
        pair.p.cache_manager.pd_cache_info([{"request_id": "a", "dest_block_ids": bad}])
    assert "a" not in pair.p.cache_manager.pd._chunks  # no send planned
    assert "dest_block_ids" in pair.ask_d(req)  # the real answer still works
    pair.pump()
    pair.p.rm.add_request_in_p([req])
    from real_fd_pd import Served

    served = Served("a")
    pair.prefill([served])
    pair.deliver_first_tokens([served])
    pair.decode()
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_p_sends_each_layer_from_the_runners_hook_before_computing_the_next(
    make_pair: Any,
) -> None:
    pair = make_pair()
    served = pair.start(pair.request("a", PROMPT_A, 3))
    dst = list(served.dest_block_ids)
    p_req = pair.p.rm.requests["a"]
    src = list(p_req.block_tables)[: len(dst)]  # P also holds enc_dec blocks past them
    p_run, d_run = pair.p.runners[0], pair.d.runners[0]
    roles = p_run.roles
    seen: list[bool] = []
    d_layer1_then: list[Any] = []
    ctrl = p_run.cache_controller
    hook = ctrl.after_layer

    def after_layer(n: int) -> None:
        hook(n)
        if n == 0:  # layer 0 handed over; layer 1 not computed yet on P
            seen.append(
                all((d_run.views[r][dst] == p_run.views[r][src]).all() for r in range(roles))
            )
            d_layer1_then.extend(d_run.views[roles + r][dst].copy() for r in range(roles))

    ctrl.after_layer = after_layer
    pair.prefill([served])
    assert seen == [True]  # D had layer 0's bytes once P's hook for layer 0 ran ...
    for r, then in enumerate(d_layer1_then):  # ... and none of layer 1's P wrote later
        assert not (then == p_run.views[roles + r][src]).all(axis=(1, 2, 3)).any()
    pair.deliver_first_tokens([served])
    pair.decode()
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()


def test_freeing_the_kv_cache_mid_send_waits_for_p_s_writes_and_detaches_pd(
    make_pair: Any,
) -> None:
    """FastDeploy's KV sleep (the runner's `clear_cache`: free_gpu_cache) while P's
    writes of a send are in flight (here: while P's token processor waits for the
    send, as a sleep from another thread would find it). The writes read the KV,
    so they settle before the tensors go; the send's report reaches the scheduler
    (the reporter thread is stopped by then); the rank's transport is closed (it
    lets go of the registered tensors) and the rank has no PD until `attach_pd` on
    the new cache. D decodes from what landed. On D the same drops what it
    expected."""
    from fastkv.pd.transport import Piece, TransportError

    fab = InProcFabric(write_timeout_s=30.0)
    pair = make_pair(fabric=fab, send_timeout_s=30.0, timeout_s=30.0)
    p_run, worker = pair.p.runners[0], pair.p_workers[0]
    seen: list[tuple[int, int, int]] = []
    wait_for_send = pair.finished.get_finished_req

    def sleep_while_waiting() -> list[list[Any]]:
        if fab.num_queued and not seen:  # the send's writes are in flight
            open_before = worker.num_open
            stop = threading.Event()

            def others() -> None:  # the transport and P's engine loop run meanwhile
                while not stop.wait(0.005):
                    fab.pump()
                    pair.p.cache_manager.poll_results()

            thread = threading.Thread(target=others)
            thread.start()
            try:
                p_run.clear_cache()
            finally:
                stop.set()
                thread.join()
            seen.append((open_before, worker.num_open, fab.num_queued))
        return wait_for_send()

    pair.finished.get_finished_req = sleep_while_waiting
    served = pair.start(pair.request("a", PROMPT_A, 3))
    fab.hold_writes = True
    t0 = time.monotonic()
    pair.prefill([served])
    assert time.monotonic() - t0 < 10  # the report came, not the 30 s deadline
    assert seen == [(1, 0, 0)]  # open, then settled with no write left, before the free
    assert p_run.cache_controller.pd is None
    with pytest.raises(TransportError, match="closed"):
        worker.transport.write(pair.d_workers[0].transport.address, [Piece(1, 1, 1)])
    fab.hold_writes = False
    pair.deliver_first_tokens([served])
    pair.decode()  # D's runner checks every KV position it reads
    assert served.first_token_error is None
    d_run, d_worker = pair.d.runners[0], pair.d_workers[0]
    d_run.clear_cache()
    assert d_run.cache_controller.pd is None and d_worker.num_open == 0
