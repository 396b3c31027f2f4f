"""Planned mode on two gloo ranks: every decision is the same on every rank, or every rank stops
with the same clear error; nothing rank-specific (a policy file one rank cannot see, a shape one
rank runs) can make the ranks call different collectives and hang."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from .net import close_group, run_ranks


def _worker(rank: int, world: int, port: int, scenario: str, tmp: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {}
    try:
        import tapesac
        from tapesac.autoplan import PlanConfig

        from .loops import Model, forwards_first, tokens

        model = Model()
        seq = 48
        config: dict = {}
        if scenario == "divergent_shape":
            seq = 48 if rank == 0 else 40
        elif scenario == "policy_on_one_rank":
            # Only rank 0's path holds the policy; rank 1's does not exist.
            config["policy_path"] = os.path.join(tmp, "policy.json" if rank == 0 else f"missing{rank}.json")
        elif scenario == "garbage_policy_on_rank_1":
            path = os.path.join(tmp, f"policy_rank{rank}.json")
            if rank == 1:
                with open(path, "wb") as f:
                    f.write(os.urandom(300))
            config["policy_path"] = path
        limit = 10**8 if scenario == "over_on_rank_1" else 10**12
        handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=limit, **config))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loop = forwards_first(2)
        if scenario == "over_on_rank_1":
            inner = loop

            def loop(model, step, seq):  # from the first planned step on, 1 GB more on rank 1 only
                scratch = torch.empty(10**9, dtype=torch.uint8) if rank == 1 and step >= 2 else None
                losses = inner(model, step, seq)
                del scratch
                return losses
        if scenario.startswith("retain_graph"):
            def loop(model, step, seq):  # a graph retained for a second backward every third step
                losses = [model(tokens(step, m, seq)) / 2 for m in range(2)]
                twice = step % 3 == 0 and (rank == 1 or scenario == "retain_graph")
                for loss in losses:
                    loss.backward(retain_graph=twice)
                    if twice:
                        (0.5 * loss).backward()
                return losses
        losses = []
        try:
            for step in range(7 if scenario.startswith("retain_graph") else 5):
                opt.zero_grad()
                losses += [float(x).hex() for x in loop(model, step, seq)]
                opt.step()
        except tapesac.TapeSACError as e:
            result["error"] = str(e)
        planner = handle.planner
        result.update(losses=losses, loaded=planner.loaded_policy, plans=sorted(planner.plans),
                      steps=planner.steps, history=planner.history, mode=planner.last_step_mode,
                      retained=[e.retained for e in planner.plans.values()],
                      keep=[sorted(map(tuple, s.keep or ())) for s in handle.blocks])
    except Exception:  # noqa: BLE001 - report, don't hang the other rank's queue.get
        result["crash"] = traceback.format_exc()
    finally:
        queue.put((rank, result))
        close_group()


def _run(scenario: str, tmp) -> dict[int, dict]:
    results = run_ranks(_worker, scenario, str(tmp))
    for r in results.values():
        assert "crash" not in r, r["crash"]
    return results


def test_ranks_plan_once_and_apply_the_same_plan(tmp_path):
    r = _run("same", tmp_path)
    assert r[0]["plans"] == r[1]["plans"] and len(r[0]["plans"]) == 1
    assert r[0]["keep"] == r[1]["keep"]
    assert r[0]["history"] == r[1]["history"] and r[0]["history"]
    assert "error" not in r[0] and "error" not in r[1]


def test_a_rank_with_another_shape_stops_every_rank_with_the_same_error(tmp_path):
    r = _run("divergent_shape", tmp_path)
    assert r[0]["error"] == r[1]["error"]
    assert "ranks ran different steps" in r[0]["error"]


def test_a_policy_file_only_rank_0_can_read_is_loaded_on_every_rank(tmp_path):
    first = _run("policy_on_one_rank", tmp_path)  # plans and saves (rank 0 writes)
    assert (tmp_path / "policy.json").exists() and not first[0]["loaded"]
    again = _run("policy_on_one_rank", tmp_path)
    assert again[0]["loaded"] and again[1]["loaded"]  # rank 0 read it, both apply it
    assert again[0]["keep"] == again[1]["keep"] == first[0]["keep"]


def test_a_garbage_policy_file_on_one_rank_changes_nothing(tmp_path):
    r = _run("garbage_policy_on_rank_1", tmp_path)
    assert r[0]["plans"] == r[1]["plans"] and len(r[0]["plans"]) == 1
    assert "error" not in r[0] and "error" not in r[1]


def test_ranks_plan_a_retained_graph_alike(tmp_path):
    r = _run("retain_graph", tmp_path)
    assert r[0]["plans"] == r[1]["plans"] and r[0]["retained"] == r[1]["retained"] == [True]
    assert r[0]["keep"] == r[1]["keep"] and r[0]["mode"] == r[1]["mode"] == "planned"
    assert r[0]["history"] == r[1]["history"] and r[0]["history"]
    assert "error" not in r[0] and "error" not in r[1]


def test_a_graph_retained_on_one_rank_only_changes_the_same_things_on_every_rank(tmp_path):
    """Rank 1's retaining steps have more windows than rank 0's: the traces cannot be merged, so
    both ranks discard them and the shape runs replay-only, traced, on both, without a hang."""
    r = _run("retain_graph_on_rank_1", tmp_path)
    assert r[0]["plans"] == r[1]["plans"] and r[0]["retained"] == r[1]["retained"]
    assert r[0]["keep"] == r[1]["keep"] and r[0]["mode"] == r[1]["mode"]
    assert "error" not in r[0] and "error" not in r[1]


def test_a_limit_one_rank_cannot_keep_even_replay_only_stops_every_rank_with_the_same_error(tmp_path):
    """Rank 1 alone holds a buffer the profile did not show: the ranks re-plan alike (the largest
    measured peak decides) and both stop with the same PlanError once replay-only is measured over."""
    r = _run("over_on_rank_1", tmp_path)
    assert r[0]["error"] == r[1]["error"]
    assert "kept nothing (replay-only, the smallest peak there is)" in r[0]["error"]
    assert r[0]["history"] == r[1]["history"] and r[0]["history"][-1]["measured_peak_bytes"] > 10**9
