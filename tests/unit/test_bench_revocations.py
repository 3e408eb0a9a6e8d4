"""bench_revocations measures what it says: each superseding attestation revokes exactly one
certificate (the workload's oldest live one), and the replica's adoptions go through the
control plane's own ``adopt_rows`` on a mesh of the size asked for."""

from __future__ import annotations

from benchmarks.bench_revocations import adopting, mesh, superseding


def test_the_mesh_and_both_figures() -> None:
    state = mesh(40, 300)
    assert len(state.workloads) == 40 and len(state.revocations) == 300
    assert all(len(w.certificates) == 4 for w in state.workloads.values())
    spent = superseding(state, 50)  # (asserts one revocation added per round)
    assert len(spent) == 50 and all(us >= 0 for us in spent)
    assert len(adopting(state, 10)) == 10
