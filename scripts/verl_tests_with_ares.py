#!/usr/bin/env python3
"""verl 0.9.1's own CPU unit tests of the functions ares registers, run twice: as verl ships
them, then with verl's functions replaced by ares's. Writes the outcome of
every test of both runs to a JSON file, committed as
`ares-py/tests/fixtures/verl_0_9_1_own_tests.json` (CI has neither torch nor verl, so the
result is committed rather than rerun there).

The replacement rebinds, before any test module is imported, verl's functions and registry
entries to ares's adapters with the same signatures:

    compute_grpo_outcome_advantage / "grpo"   -> ares.verl.ares_grpo
    compute_rloo_outcome_advantage / "rloo"   -> ares.verl.ares_rloo
    compute_policy_loss_vanilla / "vanilla"   -> ares.verl.ares_vanilla
    compute_policy_loss_gspo / "gspo"         -> ares.verl.ares_gspo
    compute_policy_loss_cispo / "cispo"       -> ares.verl.ares_cispo
    compute_policy_loss_clip_cov / "clip_cov" -> ares.verl.ares_clip_cov
    compute_policy_loss_kl_cov / "kl_cov"     -> ares.verl.ares_kl_cov

so a test that compares verl's GRPO with its vectorised GRPO now compares ares's with verl's.
verl 0.9.1's CPU tests call GRPO, RLOO and the vanilla loss (the JSON counts the calls); its
GSPO, CISPO, Clip-Cov and KL-Cov have no CPU test there (`ares-py/tests/test_verl.py` compares
ares's against them directly).
The multi-trajectory tests call verl's `compute_advantage_for_multi_trajectories` with
`adv_estimator="ares_grpo"` in the second run (through `AdvantageEstimator.GRPO` the
function would keep its own GRPO path).

Needs a venv with torch, verl 0.9.1 (and TransferQueue, which verl's v1 utilities import),
pytest and the ares wheel installed:

    python scripts/verl_tests_with_ares.py --sdist verl-0.9.1.tar.gz [--out PATH]

(`pip download --no-deps --no-binary :all: verl==0.9.1` fetches the sdist.)
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

TEST_FILES = [
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_rollout_corr_integration.py",
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
]

SUBSTITUTE = '''
import ares.verl as av
from verl.trainer.ppo import core_algos as ca

av.register()
FUNCTIONS = {
    "compute_grpo_outcome_advantage": ("grpo", av.ares_grpo, ca.ADV_ESTIMATOR_REGISTRY),
    "compute_rloo_outcome_advantage": ("rloo", av.ares_rloo, ca.ADV_ESTIMATOR_REGISTRY),
    "compute_policy_loss_vanilla": ("vanilla", av.ares_vanilla, ca.POLICY_LOSS_REGISTRY),
    "compute_policy_loss_gspo": ("gspo", av.ares_gspo, ca.POLICY_LOSS_REGISTRY),
    "compute_policy_loss_cispo": ("cispo", av.ares_cispo, ca.POLICY_LOSS_REGISTRY),
    "compute_policy_loss_clip_cov": ("clip_cov", av.ares_clip_cov, ca.POLICY_LOSS_REGISTRY),
    "compute_policy_loss_kl_cov": ("kl_cov", av.ares_kl_cov, ca.POLICY_LOSS_REGISTRY),
}
CALLS = {}


def _counted(name, fn):
    def wrapper(*args, **kwargs):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper


for attr, (name, fn, registry) in FUNCTIONS.items():
    assert name in registry, name
    fn = _counted(fn.__name__, fn)
    registry[name] = fn
    setattr(ca, attr, fn)

# the multi-trajectory tests pass verl's GRPO enum, which keeps verl's own path: ask for ares's
from verl.trainer.ppo.v1 import utils as v1

_multi = v1.compute_advantage_for_multi_trajectories


def _multi_as_ares(data, batch_keys, adv_estimator, *args, **kwargs):
    if adv_estimator == ca.AdvantageEstimator.GRPO:
        adv_estimator = "ares_grpo"
    return _multi(data, batch_keys, adv_estimator, *args, **kwargs)


v1.compute_advantage_for_multi_trajectories = _multi_as_ares
'''

COLLECT = '''
import json, os

RESULTS = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        RESULTS[report.nodeid] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    calls = globals().get("CALLS", {})
    with open(os.environ["ARES_VERL_TESTS_OUT"], "w") as f:
        json.dump({"results": RESULTS, "calls": calls}, f, indent=1, sort_keys=True)
'''


def run(root, substitute, out):
    """pytest over each of TEST_FILES in the sdist at `root`, one process per file (verl's
    `TestRegisterAdvEst` empties the estimator registry and does not restore it, which would
    fail any later test that looks a name up); returns {nodeid: outcome}."""
    (root / "conftest.py").write_text(COLLECT + (SUBSTITUTE if substitute else ""))
    result = out.with_suffix(".part.json")
    env = {**os.environ, "ARES_VERL_TESTS_OUT": str(result)}
    outcomes, calls = {}, {}
    for test_file in TEST_FILES:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", test_file],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
        last = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"{'ares substituted' if substitute else 'verl as shipped'}: {test_file}: {last[0]}")
        part = json.loads(result.read_text())
        outcomes.update(part["results"])
        for name, n in part["calls"].items():
            calls[name] = calls.get(name, 0) + n
        result.unlink()
    return outcomes, calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", required=True, help="verl-0.9.1.tar.gz")
    ap.add_argument(
        "--out",
        default=str(pathlib.Path(__file__).resolve().parents[1] / "ares-py/tests/fixtures/verl_0_9_1_own_tests.json"),
    )
    args = ap.parse_args()
    import verl

    if verl.__version__ != "0.9.1":
        raise SystemExit(f"verl {verl.__version__} is installed; this check is written against 0.9.1")
    out = pathlib.Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(args.sdist) as tar:
            tar.extractall(tmp, filter="data")
        (root,) = [p for p in pathlib.Path(tmp).iterdir() if p.is_dir()]
        # the tests import verl from the environment, not from the unpacked source
        (root / "verl").rename(root / "_verl_source_unused")
        shipped, _ = run(root, False, out)
        substituted, calls = run(root, True, out)
    summary = {
        "verl": "0.9.1",
        "files": TEST_FILES,
        "shipped": shipped,
        "ares_substituted": substituted,
        "counts": {
            name: {k: sum(1 for v in res.values() if v == k) for k in ("passed", "failed", "skipped")}
            for name, res in (("shipped", shipped), ("ares_substituted", substituted))
        },
        "differ": sorted(k for k in shipped if substituted.get(k) != shipped[k]),
        # how often the tests of the second run called each ares function: proof they ran
        "ares_calls": calls,
    }
    out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary["counts"]), "differ:", summary["differ"], "ares calls:", calls)


if __name__ == "__main__":
    main()
