"""Show the repository, Binder and Colab buttons only when the book has an address.

``repository.url`` in ``_config.yml`` is the one setting: empty, the book has
no buttons that lead nowhere; set (a fork's GitHub address), every chapter
gets a repository button and Binder and Colab launch buttons. Jupyter Book
refuses repository buttons without an address, so this extension turns them
on after Jupyter Book has read its configuration.
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.config import Config

LAUNCH_BUTTONS = {
    "notebook_interface": "jupyterlab",
    "binderhub_url": "https://mybinder.org",
    "colab_url": "https://colab.research.google.com",
}


def enable_buttons(app: Sphinx, config: Config) -> None:
    """Turn the buttons on when ``repository_url`` is set, and off otherwise."""
    options = dict(config.html_theme_options)
    has_address = bool(options.get("repository_url"))
    options["use_repository_button"] = has_address
    options["launch_buttons"] = dict(LAUNCH_BUTTONS) if has_address else {}
    config.html_theme_options = options


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", enable_buttons)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
