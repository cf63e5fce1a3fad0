"""One word for each of three things: a *stage* is a step of the MoE forward (tokens, route, dispatch,
experts, combine), a *hop* one of node dedup's two exchanges, a *range* a profiler's named interval."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# how node dedup's hops or the profiler's ranges were once called "stages"
OTHER_STAGES = re.compile(r"\bstages?[ -][12]\b|stage_seconds|predicted_stage_s|\.stages\b|\b(first|second|two|"
                          r"intra-node|cross-node)[- ]stages?\b|def stage\(|\bStageClock\b|with stage\(")


def _sources() -> list[Path]:
    trees = ("dist_moe", "placement", "benchmarks", "experiments", "examples", "docs")
    return [p for t in trees for p in (ROOT / t).rglob("*") if p.suffix in (".py", ".md")] + [ROOT / "README.md"]


def offending(text: str) -> list[str]:
    return [m.group(0) for m in OTHER_STAGES.finditer(text)]


def test_stage_names_the_forward_s_steps_only():
    found = {str(p.relative_to(ROOT)): hits for p in _sources() if (hits := offending(p.read_text()))}
    assert not found, found


def test_the_rule_sees_each_old_meaning():
    for planted in ("node dedup's stage 2 forwards", "plan.stages[0]", "with stage(\"route\")",
                    "cost.stage_seconds(t)", "the second stage's plan"):
        assert offending(planted), planted
    assert not offending("the route stage runs inside the agreement; the experts stage")
