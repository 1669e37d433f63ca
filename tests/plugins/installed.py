"""An installed package's policies, as a plugin would declare them: a
``*.dist-info`` folder whose ``entry_points.txt`` names them under
``cadence.scheduling_policies``, put on ``sys.path`` (or ``PYTHONPATH``)."""

from __future__ import annotations

from pathlib import Path

ENTRY_POINTS = {
    "shortest-first-installed": "tests.plugins.shortest_first:ShortestPromptFirst",
    "short-prompts-only": "tests.plugins.shortest_first:ShortPromptsOnly",
}


def install_plugin(site: Path) -> Path:
    """Write the plugin's distribution metadata under ``site``; returns ``site``."""
    dist_info = site / "cadence_policy_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cadence-policy-plugin\nVersion: 0.1\n")
    lines = [f"{name} = {target}" for name, target in ENTRY_POINTS.items()]
    (dist_info / "entry_points.txt").write_text(
        "[cadence.scheduling_policies]\n" + "\n".join(lines) + "\n")
    return site
