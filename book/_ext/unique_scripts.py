"""Include each inline script once per page.

sphinx-thebe adds its configuration (``const THEBE_JS_URL = ...``) every time
Sphinx reads the sources, and Jupyter Book reads them twice, so every page
declared the constant twice and the browser reported a SyntaxError. This
extension drops repeated scripts from each page's script list.
"""

from __future__ import annotations

from sphinx.application import Sphinx


def drop_repeated_scripts(
    app: Sphinx, pagename: str, templatename: str, context: dict, doctree
) -> None:
    """Keep the first of the scripts with the same file name and attributes (body included)."""
    seen, unique = set(), []
    for script in context.get("script_files", []):
        # The same inline script is registered once with filename None and once with "".
        name = getattr(script, "filename", script) or ""
        key = (
            str(name),
            tuple(
                sorted(
                    (k, str(v)) for k, v in getattr(script, "attributes", {}).items()
                )
            ),
        )
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", drop_repeated_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
