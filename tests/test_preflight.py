"""``opskit preflight``'s verdicts on node records (opskit.allocation.preflight.judge); the checks on a real 3-node
SLURM are in tests/test_multinode_failures.py."""

from __future__ import annotations

from opskit.allocation.preflight import judge


def record(node: str, tflops=(400.0, 410.0), devices=2, free_gb=900.0, xid=(), pairs=(True, True)) -> dict:
    return {"node": node, "devices": devices, "gemm_tflops": {f"cuda:{i}": t for i, t in enumerate(tflops)},
            "free_gb": free_gb, "xid": list(xid) if xid is not None else None,
            "allreduce": [{"peer": "x", "ok": ok, **({"seconds": 0.01} if ok else {"error": "RuntimeError: down"})}
                          for ok in pairs]}


def problems(result) -> dict[str, list[str]]:
    return {n.node: n.problems for n in result.nodes if n.problems}


def test_each_way_a_node_fails_is_named_with_its_figure():
    records = {"n1": record("n1"), "n2": record("n2", tflops=(400.0, 250.0)), "n3": record("n3", devices=1),
               "n4": record("n4", free_gb=100.0), "n5": record("n5", xid=["NVRM: Xid (PCI:0000:3b:00): 79, GPU has "
                                                                         "fallen off the bus"]),
               "n6": None, "n7": record("n7", pairs=(False, False)), "n8": record("n8", pairs=(False, True))}
    result = judge(records, expected_devices=2, margin=0.2, min_free_gb=500)
    assert result.median_tflops == 400.0  # each node's slowest device, n3's one included
    assert problems(result) == {
        "n2": ["GEMM 250 TFLOP/s, 62% of the median 400"],
        "n3": ["1 GPU(s), expected 2"],
        "n4": ["100 GB free at the checkpoints, a step needs 500"],
        "n5": ["1 GPU Xid line(s) in the kernel log: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"],
        "n6": ["no result (its check died or never started)"],
        "n7": ["all-reduce failed: RuntimeError: down"],
    }  # n8: one pair failed (its neighbour n7's), the other worked
    assert [n.node for n in result.excluded] == ["n2", "n3", "n4", "n5", "n6", "n7"]
    assert result.as_json()["excluded"] == ["n2", "n3", "n4", "n5", "n6", "n7"] and result.notes == []


def test_when_every_all_reduce_fails_no_node_is_blamed_and_cpu_nodes_need_no_gpu():
    records = {n: record(n, devices=0, pairs=(False,)) for n in ("n1", "n2")}
    result = judge(records, expected_devices=0, margin=0.2, min_free_gb=1)
    assert result.excluded == [] and result.notes == [
        "every all-reduce failed (2 nodes): the network or the rendezvous ports, not one node"]
    unreadable_kernel_log = judge({"n1": record("n1", xid=None)}, expected_devices=2, margin=0.2, min_free_gb=1)
    assert unreadable_kernel_log.excluded == []
