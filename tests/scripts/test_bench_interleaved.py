"""Smoke test of scripts/bench_interleaved.py: every arm is asked in turn and reported (no timing
assertions)."""

from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_dptrain_methods_get_one_arm_per_code_version_and_the_references_one() -> None:
    bench = load_script("bench_interleaved")
    arms = bench.arms(["plain", "dptrain_ghost", "opacus_hooks"], [("main", "/a"), ("new", "/b")])
    assert arms == [("plain", "plain", "/b"), ("dptrain_ghost (main)", "dptrain_ghost", "/a"),
                    ("dptrain_ghost (new)", "dptrain_ghost", "/b"), ("opacus_hooks", "opacus_hooks", "/b")]


def test_every_arm_reports_a_time_for_every_round_and_its_excess_over_plain(tmp_path: Path) -> None:
    bench = load_script("bench_interleaved")
    out = tmp_path / "ab.json"
    document = bench.main(["--model", "one_layer", "--batch-size", "4", "--steps", "2", "--rounds", "3",
                           "--methods", "plain", "dptrain_hooks", "--versions", f"a={ROOT}", f"b={ROOT}",
                           "--out", str(out)])
    assert set(document["times_ms"]) == {"plain", "dptrain_hooks (a)", "dptrain_hooks (b)"}
    assert all(len(v) == 3 and min(v) > 0 for v in document["times_ms"].values())
    rows = {r["arm"]: r for r in document["summary"]}
    assert rows["plain"]["over_plain_ms"] == 0.0 and rows["plain"]["x_plain"] == 1.0
    assert rows["dptrain_hooks (a)"]["x_plain"] > 0
    assert out.exists()
