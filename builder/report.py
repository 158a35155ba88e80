"""Build reports (Markdown and HTML) rendered from the manifest with jinja2 templates."""

from __future__ import annotations

from typing import Any

import jinja2

from passes.ir import Graph


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("builder", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "html.j2"]), trim_blocks=True, lstrip_blocks=True)
    env.filters["mib"] = lambda n: f"{n / 2**20:,.2f} MiB"
    env.filters["g"] = lambda x: f"{x:.4g}" if isinstance(x, float) else x
    return env


def render_reports(manifest: dict[str, Any], graph: Graph) -> dict[str, str]:
    """report.md and report.html for one artifact."""
    env = _env()
    ctx = {"m": manifest, "graph_text": str(graph), "op_counts": sorted(graph.count_ops().items())}
    return {
        "report.md": env.get_template("report.md.j2").render(**ctx),
        "report.html": env.get_template("report.html.j2").render(**ctx),
    }
